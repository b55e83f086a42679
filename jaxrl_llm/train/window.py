"""Training-time metrics aggregated over a logging window.

The train step returns one scalar per metric per step (loss, taper objective, clipped
fractions, ratios, log-prob drift, entropy, gradient norms, ...). Every `log_every` steps the
trainer writes one row: the *mean* of each rate-like metric over the window's steps and the
*sum* of each count-like metric (records, tokens, clipped records), so that a row's counts
are what the window consumed.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

# A metric is a count (summed over the window) when its name says so.
COUNT_PREFIXES = ("num_", "n_", "count_")
COUNT_SUFFIXES = ("_count", "count", "_sum", "_tokens", "_records")


def is_count_metric(name: str) -> bool:
    """Counts are summed over a window; every other metric is averaged."""
    leaf = name.rsplit("/", 1)[-1]
    return leaf.startswith(COUNT_PREFIXES) or leaf.endswith(COUNT_SUFFIXES)


class MetricWindow:
    """Accumulates per-step scalar metrics; `flush()` returns the window row and resets.

    Steps may report different keys (an optional metric, an eval every few steps): each mean is
    over the steps that reported it. Values are pulled to host floats when added, which is the
    one device→host sync per step the trainer does anyway for its progress bar.
    """

    def __init__(self) -> None:
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self.steps = 0

    def add(self, metrics: Mapping[str, object]) -> None:
        self.steps += 1
        for name, value in metrics.items():
            arr = np.asarray(value, np.float64)
            if arr.size != 1:
                raise ValueError(f"metric {name!r} must be a scalar; got shape {arr.shape}")
            self._sums[name] = self._sums.get(name, 0.0) + float(arr.reshape(()))
            self._counts[name] = self._counts.get(name, 0) + 1

    def __len__(self) -> int:
        return self.steps

    def flush(self) -> dict[str, float]:
        """Window means (sums for counts), then start a new window."""
        row = {
            name: total if is_count_metric(name) else total / self._counts[name]
            for name, total in self._sums.items()
        }
        self._sums.clear()
        self._counts.clear()
        self.steps = 0
        return row
