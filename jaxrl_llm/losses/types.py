"""The contract every loss kernel returns, and the caller-facing input check."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class LossOutput(NamedTuple):
    """A loss as `total / weight`.

    `total` is a sum of per-record (or per-token) losses and `weight` the matching count, so
    summing both over micro-batches and devices and dividing once gives the exact full-batch
    loss — never a mean of means. `metrics` are scalars of this batch (already reduced).
    """

    total: jax.Array
    weight: jax.Array
    metrics: Mapping[str, jax.Array]

    @property
    def loss(self) -> jax.Array:
        """`total / weight`, guarded against an empty batch (weight 0 gives loss 0)."""
        return self.total / jnp.maximum(self.weight, 1e-12)


def finite_or_raise(**arrays: object) -> None:
    """Refuse NaN/inf in concrete (host or device) inputs, naming the argument.

    For use at the caller-facing boundary (data loading, the trainer), outside jit: a traced
    array is skipped because its values are not known yet.
    """
    for name, value in arrays.items():
        if value is None or isinstance(value, jax.core.Tracer):
            continue
        arr = np.asarray(value)
        if not np.issubdtype(arr.dtype, np.floating):
            continue
        bad = ~np.isfinite(arr)
        if bad.any():
            where = np.argwhere(bad)[0].tolist()
            raise ValueError(
                f"{name} contains {int(bad.sum())} non-finite value(s) (first at index {where}: "
                f"{arr[tuple(where)]!r}); refusing to train on NaN/inf"
            )
