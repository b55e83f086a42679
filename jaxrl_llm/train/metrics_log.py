"""Metric rows to `metrics.jsonl` (always), TensorBoard (tensorboardX) and Weights & Biases
(optional, `metrics.wandb=true`) (docs/architecture.md § Contracts).

Every destination is a `MetricsWriter` (`write(step, row)`, `close()`): `JsonlWriter`,
`TensorBoardWriter`, `WandbWriter`; `MetricsLogger` builds the row once and hands it to each.
One row per logging window: `{"step": s, "time": unix seconds, name: value, ...}`. On resume
from a checkpoint at step s, rows after s (written by the interrupted run past its last
checkpoint) are dropped, so the file reads as one uninterrupted run. `run_dir` may be local or
remote (`gs://`, through `etils.epath`); object stores cannot append, so there the whole file
is rewritten at each row.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import string
import sys
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Protocol

from etils import epath

from jaxrl_llm.core.atomic import atomic_write_text
from jaxrl_llm.core.paths import PathLike, as_path, is_remote

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id"  # the run's wandb id, so a resumed run continues the same run


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
        atomic_write_text(path, "".join(line + "\n" for line in kept))
    return dropped


class MetricsWriter(Protocol):
    """One destination of metric rows (a row: {"step", "time", name: JSON value, ...})."""

    def write(self, step: int, row: Mapping[str, object]) -> None: ...

    def close(self) -> None: ...


def _scalars(row: Mapping[str, object]) -> dict[str, float]:
    """The plottable values of a row (numbers; not step/time, not null)."""
    return {name: value for name, value in row.items()
            if name not in ("step", "time") and isinstance(value, int | float)
            and not isinstance(value, bool)}


class JsonlWriter:
    """`metrics.jsonl`: one JSON row per line, flushed per row (remote: rewritten per row)."""

    def __init__(self, path: epath.Path, *, resume_step: int | None) -> None:
        self.path = path
        self._file = None
        self._rows: list[str] | None = None  # remote: every row so far, rewritten per row
        if resume_step is not None:
            truncate_after(self.path, resume_step)
        elif self.path.exists():
            self.path.unlink()  # a fresh run starts a fresh log
        if is_remote(self.path):
            self._rows = (self.path.read_text().splitlines(keepends=True)
                          if self.path.exists() else [])
        else:
            self._file = self.path.open("a")

    def write(self, step: int, row: Mapping[str, object]) -> None:
        line = json.dumps(dict(row)) + "\n"
        if self._rows is not None:
            self._rows.append(line)
            self.path.write_text("".join(self._rows))
        else:
            assert self._file is not None
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _summary_writer() -> Any:
    """tensorboardX's `SummaryWriter`, imported without torch: tensorboardX imports torch
    (about 2 s of CPU at every `train` start) only to accept torch tensors, never logged here."""
    if "tensorboardX" not in sys.modules and "torch" not in sys.modules:
        sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` -> ImportError
        try:
            import tensorboardX  # noqa: F401 (the import is the point)
        finally:
            del sys.modules["torch"]  # a later `import torch` works as usual
    from tensorboardX import SummaryWriter

    return SummaryWriter


class TensorBoardWriter:
    """Scalars under `run_dir/tensorboard` (a resume purges events after its step)."""

    def __init__(self, logdir: epath.Path, *, resume_step: int | None) -> None:
        self._writer: Any = _summary_writer()(logdir=str(logdir), purge_step=resume_step)

    def write(self, step: int, row: Mapping[str, object]) -> None:
        for name, value in _scalars(row).items():
            self._writer.add_scalar(name, value, global_step=int(step))
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _new_run_id() -> str:
    """A wandb-style run id: 8 characters of [a-z0-9]."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


class WandbWriter:
    """A Weights & Biases run (`pip install 'jaxrl_llm[wandb]'`).

    settings: the `metrics:` config section (project, entity, name, mode, tags). The run's id
    is kept in `run_dir/wandb_run_id`, so a resumed training run continues the same wandb run
    (`resume="allow"`); rows are plotted against our `step` (logged as a metric), not wandb's
    own step counter, which refuses the steps a resume logs again. WANDB_MODE=offline (or
    `metrics.wandb_mode=offline`) writes the run under WANDB_DIR (default: `run_dir`) without
    network; `wandb sync` uploads it later.
    """

    def __init__(self, run_dir: epath.Path, settings: Any, *, run_name: str,
                 config: Mapping[str, Any] | None) -> None:
        try:
            import wandb
        except ImportError as err:
            raise ImportError("metrics.wandb=true needs the wandb package: "
                              "pip install 'jaxrl_llm[wandb]'") from err
        id_file = run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.exists() else _new_run_id()
        # WANDB_DIR wins (wandb's own setting); else beside the metrics, when local.
        local = not is_remote(run_dir) and not os.environ.get("WANDB_DIR")
        directory = str(run_dir) if local else None
        self._run: Any = wandb.init(
            project=settings.wandb_project, entity=settings.wandb_entity,
            name=settings.wandb_name or run_name, tags=list(settings.wandb_tags) or None,
            mode=settings.wandb_mode, id=run_id, resume="allow", dir=directory,
            config=dict(config or {}))
        id_file.write_text(run_id + "\n")
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")

    def write(self, step: int, row: Mapping[str, object]) -> None:
        self._run.log({"step": int(step), **_scalars(row)})

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


class MetricsLogger:
    """Writes metric rows to every writer; `enabled=False` (non-zero processes of a multi-host
    job) is a no-op.

    JSONL always; TensorBoard when `tensorboard`; wandb when `wandb` (the `metrics:` config
    section) has `wandb=true`; plus any `writers` given. Use as a context manager or call
    `close()`; rows are flushed as they are written so a killed run keeps everything logged
    before the kill.
    """

    def __init__(
        self,
        run_dir: PathLike,
        *,
        resume_step: int | None = None,
        tensorboard: bool = True,
        enabled: bool = True,
        wandb: Any | None = None,
        run_name: str = "run",
        run_config: Mapping[str, Any] | None = None,
        writers: Sequence[MetricsWriter] = (),
    ) -> None:
        self.run_dir = as_path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.enabled = enabled
        self.writers: list[MetricsWriter] = []
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.writers.append(JsonlWriter(self.path, resume_step=resume_step))
        if tensorboard:
            self.writers.append(TensorBoardWriter(self.run_dir / TENSORBOARD_DIR,
                                                  resume_step=resume_step))
        if wandb is not None and wandb.wandb:
            self.writers.append(WandbWriter(self.run_dir, wandb, run_name=run_name,
                                            config=run_config))
        self.writers.extend(writers)

    def log(self, step: int, metrics: Mapping[str, object]) -> dict[str, object]:
        """Write one row to every writer; returns it as written."""
        row: dict[str, object] = {"step": int(step), "time": round(time.time(), 3)}
        row.update({name: _json_value(value) for name, value in metrics.items()})
        if self.enabled:
            for writer in self.writers:
                writer.write(int(step), row)
        return row

    def close(self) -> None:
        for writer in self.writers:
            writer.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
