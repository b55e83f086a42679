"""Non-finite values in the train step: which quantity went bad first, and when to give up.

The jitted step skips an update whose loss or gradient norm is not finite (parameters and
optimizer state kept bit for bit, `train/step.py`) and reports `NONFINITE_KEY`: the index,
into `nonfinite_quantities(params)`, of the first non-finite quantity in the order
batch fields → loss → gradient leaves → gradient norm (−1 when every one is finite). On the
host, `NonfiniteGuard` counts skipped steps and stops the run after
`train.max_nonfinite_steps` consecutive ones, naming the step and that quantity.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import jax
import jax.numpy as jnp

# Metric holding the index of the first non-finite quantity (popped by the guard, not logged).
NONFINITE_KEY = "nonfinite_first"
# Float fields of a `Batch` (data/batch.py) checked in the step, in this order.
BATCH_FLOAT_FIELDS = ("rewards", "mu_logprobs", "ref_logprobs", "behavior_logprobs",
                      "loss_mask", "record_mask")


class NonFiniteError(FloatingPointError):
    """Too many consecutive steps had a non-finite loss or gradient."""


def nonfinite_quantities(params: Any) -> tuple[str, ...]:
    """Names, in the order the step checks them, of the quantities `NONFINITE_KEY` indexes."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    grads = tuple(f"gradient of params{jax.tree_util.keystr(path)}" for path, _ in leaves)
    return (*(f"batch field {name}" for name in BATCH_FLOAT_FIELDS), "loss", *grads,
            "gradient global norm (overflow)")


def first_nonfinite(batch: Any, loss: jax.Array, grads: Any, grad_norm: jax.Array) -> jax.Array:
    """int32 index into `nonfinite_quantities` of the first non-finite quantity, −1 if none.

    Traceable (used inside the jitted step); each check is one reduction per array."""
    checks = [jnp.all(jnp.isfinite(getattr(batch, name))) for name in BATCH_FLOAT_FIELDS]
    checks.append(jnp.isfinite(loss))
    checks += [jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]
    checks.append(jnp.isfinite(grad_norm))
    bad = ~jnp.stack(checks)
    return jnp.where(jnp.any(bad), jnp.argmax(bad), -1).astype(jnp.int32)


class NonfiniteGuard:
    """Host-side counter of skipped steps (`update_skipped` from the step).

    `observe(step, scalars)` pops `NONFINITE_KEY` from a step's host metrics, updates the
    counts and raises `NonFiniteError` once `limit` consecutive steps were skipped.
    `metrics()` gives the row entries `train/nonfinite_skips` (skipped steps since this run
    started or resumed) and `train/consecutive_nonfinite` (the current streak)."""

    def __init__(self, names: tuple[str, ...], limit: int) -> None:
        self.names, self.limit = names, limit
        self.total = 0
        self.consecutive = 0
        self.first: tuple[int, str] | None = None  # (step, quantity) starting the streak

    def name(self, code: float) -> str:
        i = int(code)
        return self.names[i] if 0 <= i < len(self.names) else "loss or gradient norm"

    def observe(self, step: int, scalars: MutableMapping[str, float]) -> None:
        code = scalars.pop(NONFINITE_KEY, -1.0)
        if not scalars.get("update_skipped", 0.0):
            self.consecutive, self.first = 0, None
            return
        self.total += 1
        self.consecutive += 1
        if self.first is None:
            self.first = (step, self.name(code))
        if self.consecutive >= self.limit:
            first_step, quantity = self.first
            raise NonFiniteError(
                f"step {step}: {self.consecutive} consecutive steps skipped for non-finite "
                f"values (train.max_nonfinite_steps={self.limit}); the first, at step "
                f"{first_step}, had a non-finite {quantity} (loss={scalars.get('loss')}, "
                f"grad_norm={scalars.get('grad_norm')}); stopping"
            )

    def metrics(self) -> dict[str, float]:
        return {"train/nonfinite_skips": float(self.total),
                "train/consecutive_nonfinite": float(self.consecutive)}
