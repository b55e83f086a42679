"""Every citation in the package, docs, README, configs and launch scripts can be followed.

Papers are cited by short name with their arXiv id (TOPR arXiv:2503.14286, FPA arXiv:2509.19893,
PKPO by its title) and the project's own definitions by `docs/kernels.md` / `docs/architecture.md`
sections. Documents outside the repository (a private spec, stack notes, design notes, an issue
tracker) and papers by local file number ("000 eq. 7", "[002]") are not followable.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".sbatch", ".toml"}

# (why it is refused, pattern). `\bSPEC\b` leaves identifiers such as LOSS_SPECS alone.
FORBIDDEN: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("the project spec outside the repository", re.compile(r"\bSPEC\b")),
    ("stack notes outside the repository", re.compile(r"\bSTACK\.md\b")),
    ("design notes outside the repository", re.compile(r"\bDESIGN(\.md)?\b")),
    ("an issue tracker entry", re.compile(r"\bissues? \d+\b", re.IGNORECASE)),
    ("a paper by local file number", re.compile(r"(?<![\d.,])\b00[0-3]\b(?= (eq|§|Fig|Table|App|Thm)\b)")),
    ("a paper by local file number", re.compile(r"\[00[0-3]\]")),
)


def _scanned_files() -> list[Path]:
    files = [ROOT / "README.md"]
    for folder in ("jaxrl_llm", "docs", "configs", "launch"):
        files += sorted(p for p in (ROOT / folder).rglob("*")
                        if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts)
    return files


def _offences(text: str) -> list[tuple[int, str, str]]:
    """(line number, why, line) for each forbidden reference in `text`."""
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        for why, pattern in FORBIDDEN:
            if pattern.search(line):
                out.append((i, why, line.strip()))
    return out


def test_the_scan_covers_the_package_docs_configs_and_launch_scripts() -> None:
    rel = {p.relative_to(ROOT).as_posix() for p in _scanned_files()}
    for expected in ("README.md", "docs/kernels.md", "jaxrl_llm/losses/pkpo.py",
                     "configs/quickstart.yaml", "launch/vllm_host.sh"):
        assert expected in rel, expected


@pytest.mark.parametrize("line, bad", [
    ("the taper (SPEC §2).", True),
    ("gotcha, see STACK.md", True),
    ('per DESIGN "Contracts"', True),
    ("added for issue 8", True),
    ("Issue 14 asked for it", True),
    ("the taper of 000 eq. 11", True),
    ("Papers: [002] FPA", True),
    ("LOSS_SPECS[name].kernel", False),
    ("DEFAULT_SPECIALS = ()", False),
    ("the taper of TOPR eq. 11 (TOPR arXiv:2503.14286)", False),
    ("learning_rate: 0.003", False),
    ("| 0.602 | 0.336 | 0.003 | 9 min |", False),
    ("(≈ 12,000/64 × 3)", False),
])
def test_the_patterns_tell_unfollowable_from_followable(line: str, bad: bool) -> None:
    assert bool(_offences(line)) is bad


def test_no_reference_to_documents_outside_the_repository() -> None:
    found = [f"{p.relative_to(ROOT)}:{i}: {why}: {line}"
             for p in _scanned_files()
             for i, why, line in _offences(p.read_text(encoding="utf-8"))]
    assert not found, ("cite papers by short name and arXiv id and the project's definitions by "
                       "docs/ section instead of:\n" + "\n".join(found))
