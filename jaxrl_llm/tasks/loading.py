"""Read task files: local JSONL or Parquet (through etils.epath), or a Hugging Face dataset."""

from __future__ import annotations

import io
import json
from typing import Any

from etils import epath


def load_rows(path: str, *, split: str = "train") -> list[dict[str, Any]]:
    """Rows of a task file.

    - `*.jsonl` / `*.json`: one JSON object per line;
    - `*.parquet`: needs `pyarrow`;
    - `hf://NAME[:CONFIG]`: `datasets.load_dataset(NAME, CONFIG, split=split)` (network).
    """
    if path.startswith("hf://"):
        try:
            import datasets  # optional, online only
        except ImportError as err:
            raise ImportError(f"{path}: loading a Hugging Face dataset needs `pip install datasets`") from err
        name, _, config = path[len("hf://"):].partition(":")
        return [dict(r) for r in datasets.load_dataset(name, config or None, split=split)]
    p = epath.Path(path)
    if not p.exists():
        raise FileNotFoundError(f"task file {path} does not exist")
    if p.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as err:
            raise ImportError(f"{path}: reading Parquet needs `pip install pyarrow`") from err
        return pq.read_table(io.BytesIO(p.read_bytes())).to_pylist()
    return read_jsonl(p)


def read_jsonl(path: str | epath.Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file (local or remote), blank lines skipped; a line
    that is not a JSON object is refused naming the file and line (task files, `metrics.jsonl`)."""
    rows = []
    for lineno, line in enumerate(epath.Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{lineno}: not a JSON line: {err}") from err
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def require(row: dict[str, Any], key: str, where: str) -> Any:
    if key not in row:
        raise ValueError(f"{where}: missing field {key!r} (has {sorted(row)})")
    return row[key]
