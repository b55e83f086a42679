"""Metric rows to `metrics.jsonl` (always) and TensorBoard (tensorboardX) (docs/architecture.md § Contracts).

One row per logging window: `{"step": s, "time": unix seconds, name: value, ...}`. On resume
from a checkpoint at step s, rows after s (written by the interrupted run past its last
checkpoint) are dropped, so the file reads as one uninterrupted run. `run_dir` may be local or
remote (`gs://`, through `etils.epath`); object stores cannot append, so there the whole file
is rewritten at each row.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from types import TracebackType

from etils import epath

from jaxrl_llm.paths import PathLike, as_path, is_remote

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def _json_value(value: object) -> object:
    """Host scalars as JSON numbers; non-finite values become null (strict JSON)."""
    if hasattr(value, "item"):
        value = value.item()  # numpy / jax scalars
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def truncate_after(path: epath.Path, step: int) -> int:
    """Rewrite a metrics JSONL keeping rows with `step <= step`; returns rows dropped."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row_step = json.loads(line).get("step", 0)
        except (json.JSONDecodeError, AttributeError):
            dropped += 1  # a torn last line from a killed process
            continue
        if row_step <= step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(path)
    return dropped


class MetricsLogger:
    """Writes metric rows; `enabled=False` (non-zero processes of a multi-host job) is a no-op.

    Use as a context manager or call `close()`; rows are flushed as they are written so a
    killed run keeps everything logged before the kill.
    """

    def __init__(
        self,
        run_dir: PathLike,
        *,
        resume_step: int | None = None,
        tensorboard: bool = True,
        enabled: bool = True,
    ) -> None:
        self.run_dir = as_path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.enabled = enabled
        self._writer = None
        self._file = None
        self._rows: list[str] | None = None  # remote: every row so far, rewritten per row
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            truncate_after(self.path, resume_step)
        elif self.path.exists():
            self.path.unlink()  # a fresh run starts a fresh log
        if is_remote(self.path):
            self._rows = (self.path.read_text().splitlines(keepends=True)
                          if self.path.exists() else [])
        else:
            self._file = self.path.open("a")
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(logdir=str(self.run_dir / TENSORBOARD_DIR),
                                         purge_step=resume_step)

    def log(self, step: int, metrics: Mapping[str, object]) -> dict[str, object]:
        """Write one row; returns it as written."""
        row: dict[str, object] = {"step": int(step), "time": round(time.time(), 3)}
        row.update({name: _json_value(value) for name, value in metrics.items()})
        if not self.enabled:
            return row
        line = json.dumps(row) + "\n"
        if self._rows is not None:
            self._rows.append(line)
            self.path.write_text("".join(self._rows))
        else:
            assert self._file is not None
            self._file.write(line)
            self._file.flush()
        if self._writer is not None:
            for name, value in row.items():
                if name not in ("step", "time") and isinstance(value, int | float):
                    self._writer.add_scalar(name, value, global_step=int(step))
            self._writer.flush()
        return row

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
