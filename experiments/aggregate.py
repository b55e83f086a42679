"""Mean ± SE over seeds, the one way every experiment script summarises its runs (the
`{"mean": ..., "se": ...}` entries of results.json)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np


def mean_se(values: Sequence[Sequence[float]] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and standard error over axis 0 (the seeds); SE 0 with one seed."""
    a = np.asarray(values, dtype=np.float64)
    se = a.std(axis=0, ddof=1) / math.sqrt(a.shape[0]) if a.shape[0] > 1 else np.zeros(a.shape[1:])
    return a.mean(axis=0), se


def over_seeds(runs: Sequence[Sequence[Mapping[str, Any]]],
               key: str | Callable[[Mapping[str, Any]], float], *,
               first: int = 0) -> dict[str, list[float]]:
    """Mean ± SE over seeds of one metric along the runs, as results.json keeps it:
    `runs[i]` is seed i's rows (probes, iterations), `key` a row's field or a function of the
    row, rows from `first` on (1: the trainer's metrics, which step 0 has not)."""
    value = key if callable(key) else (lambda row: row[key])
    mean, se = mean_se([[value(row) for row in rows[first:]] for rows in runs])
    return {"mean": mean.tolist(), "se": se.tolist()}


def mean_and_se(values: Sequence[float] | np.ndarray) -> dict[str, float]:
    """Mean ± SE of one number per seed (or per draw, per question); SE 0 for one value."""
    mean, se = mean_se(np.asarray(values, dtype=np.float64).reshape(-1, 1))
    return {"mean": float(mean[0]), "se": float(se[0])}
