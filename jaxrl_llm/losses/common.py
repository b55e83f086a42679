"""Shared pieces of the policy-gradient kernels: input checks, masked reductions, aggregation.

Conventions (every kernel in `policy_gradient`, `ppo` and `off_rl`):
- `mask [B, T]` is 1 on completion tokens; values at masked positions are ignored, even
  when they are NaN/inf (padding may hold anything).
- `record_mask [B]` (optional) is a per-record weight: 0 for padding rows, usually 1
  otherwise. Per-record losses are summed with this weight and `weight = Σ record_mask`.
- Ratios are formed in log space and the log-ratio is capped at `LOG_RATIO_CAP` before any
  `exp`, so nothing overflows for any sequence length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import chex
import jax
import jax.numpy as jnp

Array = jax.Array
Scalar = float | Array

# Largest log-ratio ever exponentiated: e^30 ≈ 1.1e13. Beyond it an upper truncation bound
# acts as if b = e^30 (the taper continues log-linearly), so even full importance sampling
# (`b = inf`) keeps float32 gradients and their squared norms finite.
LOG_RATIO_CAP = 30.0

Aggregation = Literal[
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]
AGGREGATIONS: tuple[str, ...] = (
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm",
)

# ----------------------------------------------------------------------------- input checks


def check_tokens(**arrays: Array | None) -> tuple[int, int]:
    """All given per-token arrays are [B, T] of one shape; log-probs are floating point."""
    named = {k: v for k, v in arrays.items() if v is not None}
    first_name, first = next(iter(named.items()))
    if jnp.ndim(first) != 2:
        raise ValueError(f"{first_name} must have shape [B, T], got {jnp.shape(first)}")
    shape = tuple(jnp.shape(first))
    for name, value in named.items():
        chex.assert_shape(
            value, shape, custom_message=f"argument {name!r} must match {first_name} {shape}"
        )
        if name != "mask" and not jnp.issubdtype(jnp.asarray(value).dtype, jnp.floating):
            raise ValueError(f"{name} must be floating point, got dtype {jnp.asarray(value).dtype}")
    return shape  # type: ignore[return-value]


def check_records(batch: int, **arrays: Array | None) -> None:
    for name, value in arrays.items():
        if value is None:
            continue
        if jnp.ndim(value) != 1 or jnp.shape(value)[0] != batch:
            raise ValueError(
                f"{name} must have shape [B] = ({batch},) to match the per-token arrays, "
                f"got {jnp.shape(value)}"
            )



def group_batch(
    tokens: dict[str, Array], rewards: Array, group_ids: Array, advantages: Array | None,
    record_mask: Array | None, compute: Callable[[Array], Array],
) -> tuple[int, int, Array, Array, Array]:
    """Checked inputs of a group kernel as `(B, T, m, rm, Â)`: the per-token arrays `tokens`
    (one of them `mask`) [B, T], token and record weights, and the given `advantages` [B]
    (0 on padding rows) or `compute(rm)`, the kernel's own on this call's whole groups."""
    b, t = check_tokens(**tokens)
    check_records(b, rewards=rewards, group_ids=group_ids, advantages=advantages,
                  record_mask=record_mask)
    m, rm = token_record_weights(tokens["mask"], record_mask, b)
    if advantages is None:
        return b, t, m, rm, compute(rm)
    return b, t, m, rm, jnp.where(rm > 0, jnp.asarray(advantages, jnp.float32), 0.0)


def check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def record_weights(record_mask: Array | None, batch: int) -> Array:
    if record_mask is None:
        return jnp.ones((batch,), jnp.float32)
    return jnp.asarray(record_mask).astype(jnp.float32)


def token_record_weights(mask: Array, record_mask: Array | None, batch: int) -> tuple[Array, Array]:
    """Token weights (zeroed on padding rows, so their garbage never enters) and record weights."""
    rm = record_weights(record_mask, batch)
    m = jnp.asarray(mask).astype(jnp.float32) * (rm > 0)[:, None]
    return m, rm


# ----------------------------------------------------------------------------- shared maths


def token_weights(mask: Array) -> Array:
    return jnp.asarray(mask).astype(jnp.float32)


def masked(x: Array, m: Array) -> Array:
    """`x` on tokens with m > 0 and 0 elsewhere (garbage in padding cannot leak, not even NaN)."""
    return jnp.where(m > 0, jnp.asarray(x, jnp.float32), 0.0)


def sequence_logprob(logp: Array, mask: Array) -> Array:
    """`log π(y|x) = Σ_t mask_t logπ_t` per record [B] (docs/kernels.md notation)."""
    m = token_weights(mask)
    return jnp.sum(masked(logp, m) * m, axis=-1)


def completion_lengths(mask: Array) -> Array:
    """`|y| = Σ_t mask_t` per record [B]."""
    return jnp.sum(token_weights(mask), axis=-1)


def safe_len(m: Array) -> Array:
    return jnp.maximum(jnp.sum(m, axis=-1), 1.0)


def wmean(x: Array, w: Array) -> Array:
    """`Σ w·x / Σ w` over the entries with w > 0; 0 when the weights sum to 0.

    Entries of weight 0 (masked tokens, padding rows) never reach the result, not even a NaN
    or inf held there: `sum(x * w)` alone would give NaN, since NaN·0 = NaN in IEEE. A batch
    with no weight (no negative records, say) gives 0 rather than NaN: the trainer averages
    each metric over a logging window's steps (`train/window.py`), and one NaN step would
    turn the whole window's row into null.
    """
    x = jnp.where(w > 0, x, 0.0)
    return jnp.sum(w * x) / jnp.maximum(jnp.sum(w), 1e-12)


def wmax(x: Array, w: Array) -> Array:
    """Max over entries with w > 0; 0 when there are none."""
    any_valid = jnp.any(w > 0)
    return jnp.where(any_valid, jnp.max(jnp.where(w > 0, x, -jnp.inf)), 0.0)


def aggregate_records(
    token_sums: Array,
    lengths: Array,
    record_mask: Array,
    mode: Aggregation,
    max_len: Scalar,
) -> tuple[Array, Array]:
    """`(total, weight)` of `aggregate` from per-record token sums `Σ_t m ℓ` and lengths `|y|`.

    The one definition of the four modes, shared by the per-token kernels (`aggregate`) and
    the record-level ones (TOPR's taper value is a per-record quantity, i.e. the token sum
    of its stop-gradient per-token form `−A·sg(w)·logπ_t`).
    """
    check_choice("aggregation", mode, AGGREGATIONS)
    rm = record_mask
    if mode == "token-mean":
        return jnp.sum(rm * token_sums), jnp.sum(rm * lengths)
    if mode == "seq-mean-token-sum":
        per_record = token_sums
    elif mode == "seq-mean-token-mean":
        per_record = token_sums / jnp.maximum(lengths, 1.0)
    else:
        if not isinstance(max_len, jax.core.Tracer) and float(max_len) <= 0:
            raise ValueError(f"max_len must be > 0, got {max_len}")
        per_record = token_sums / max_len
    return jnp.sum(rm * per_record), jnp.sum(rm)


def aggregate(
    per_token_loss: Array,
    mask: Array,
    mode: Aggregation = "token-mean",
    max_len: int | None = None,
    record_mask: Array | None = None,
) -> tuple[Array, Array]:
    """Reduce a per-token loss [B, T] to `(total, weight)` (aggregation names as verl).

    - `token-mean`: Σ_b Σ_t m ℓ / Σ_b Σ_t m (every token of the batch weighs the same);
    - `seq-mean-token-sum`: Σ_b (Σ_t m ℓ) / #records;
    - `seq-mean-token-mean`: Σ_b (Σ_t m ℓ / |y_b|) / #records;
    - `seq-mean-token-sum-norm`: Σ_b (Σ_t m ℓ / max_len) / #records (Dr.GRPO), with a
      constant `max_len` (default: the static padded length T).

    `#records` is Σ record_mask. Summing both outputs over micro-batches gives the exact
    full-batch value of every mode (for the seq-mean modes, because `max_len` is a constant).
    """
    check_choice("mode", mode, AGGREGATIONS)
    b, t = check_tokens(per_token_loss=per_token_loss, mask=mask)
    check_records(b, record_mask=record_mask)
    m, rm = token_record_weights(mask, record_mask, b)
    sums = jnp.sum(masked(per_token_loss, m) * m, axis=-1)
    return aggregate_records(sums, jnp.sum(m, axis=-1), rm, mode, t if max_len is None else max_len)
