"""Rows of RELIABILITY.md, recorded by the tests that exercise each failure scenario.

A reliability test calls `record(...)` once per scenario with the number of runs it made and
how many of them failed (a failing run also fails its test, so a committed table with non-zero
failures cannot come from a green run). `pytest --reliability-report=RELIABILITY.md` writes the
table at the end of the session from exactly the tests that ran, so the file cannot drift from
the tests (tests/conftest.py registers the option).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Row", "ROWS", "record", "render"]


@dataclass(frozen=True)
class Row:
    section: str  # e.g. "fault injection", "bad input", "non-finite", "rewards under attack"
    scenario: str  # what was done, e.g. "SIGKILL mid-step"
    runs: int
    failures: int
    detail: str = ""  # the input tried and the message it gave, or the property checked


ROWS: list[Row] = []


def record(section: str, scenario: str, *, runs: int, failures: int, detail: str = "") -> None:
    """Add one scenario's outcome to the session's reliability table."""
    if runs < 1 or not 0 <= failures <= runs:
        raise ValueError(f"record({scenario!r}): need runs >= 1 and 0 <= failures <= runs")
    ROWS.append(Row(section, scenario, runs, failures, " ".join(detail.split())))


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render(rows: list[Row]) -> str:
    """The markdown file: one table per section, rows in a stable (sorted) order."""
    out = [
        "# Reliability",
        "",
        "Written by the test run itself: `python -m pytest -q -m \"reliability\" "
        "--reliability-report=RELIABILITY.md` (see the README). Each row is one scenario a test "
        "exercised, with the number of runs it made and how many failed.",
        "",
    ]
    for section in sorted({r.section for r in rows}):
        out += [f"## {section}", "", "| scenario | runs | failures | detail |",
                "| --- | --- | --- | --- |"]
        for r in sorted((r for r in rows if r.section == section), key=lambda r: r.scenario):
            out.append(f"| {_cell(r.scenario)} | {r.runs} | {r.failures} | {_cell(r.detail)} |")
        out.append("")
    return "\n".join(out)
