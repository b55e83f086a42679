"""One JSON-lines reader (`tasks.loading.read_jsonl`) for task files and `metrics.jsonl`:
rows in file order with blank lines skipped, and a bad line refused naming file and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxrl_llm.tasks.countdown import CountdownTask
from jaxrl_llm.tasks.loading import load_rows, read_jsonl


def test_rows_in_order_blank_lines_skipped(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n\n   \n{"a": 2, "b": [3]}\n')
    assert read_jsonl(path) == [{"a": 1}, {"a": 2, "b": [3]}]
    assert load_rows(str(path)) == [{"a": 1}, {"a": 2, "b": [3]}]


@pytest.mark.parametrize("text, message", [
    ('{"a": 1}\n{"a": \n', r"rows.jsonl:2: not a JSON line"),
    ('{"a": 1}\n\n[1, 2]\n', r"rows.jsonl:3: expected a JSON object, got list"),
])
def test_a_bad_line_is_refused_naming_file_and_line(tmp_path: Path, text: str,
                                                    message: str) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        read_jsonl(path)


def test_countdown_file_reads_through_the_same_reader(tmp_path: Path) -> None:
    path = tmp_path / "countdown.jsonl"
    path.write_text('{"nums": [1, 2, 3], "target": 6}\n{"nums": [4, 5], "target": 9}\n')
    problems = CountdownTask(path=str(path)).load()
    assert [(p.metadata["numbers"], p.metadata["target"]) for p in problems] == [
        ([1, 2, 3], 6), ([4, 5], 9)]
    path.write_text('{"nums": [1, 2, 3], "target": 6}\nnot json\n')
    with pytest.raises(ValueError, match=r"countdown.jsonl:2: not a JSON line"):
        CountdownTask(path=str(path)).load()
