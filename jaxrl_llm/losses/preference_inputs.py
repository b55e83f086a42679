"""Input checks and shared reductions of the preference and supervised kernels
(`losses.preference`, docs/kernels.md § Preference losses): shapes checked naming the
argument, padding rows weighted 0, `log π(y|x) = Σ_t mask_t logp_t` with masked positions
ignored even if NaN/inf, and (chosen, rejected) pair rows from `pair_index [P, 2]`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.losses.common import record_weights, wmean

Array = jax.Array


def _check_tokens(fn: str, mask: Array, **arrays: Array) -> int:
    """chex shape checks naming the argument; returns the batch size."""
    if jnp.ndim(mask) != 2:
        raise ValueError(f"{fn}: mask must have shape [B, T], got {jnp.shape(mask)}")
    for name, value in arrays.items():
        if jnp.shape(value) != jnp.shape(mask):
            raise ValueError(
                f"{fn}: {name} must have the shape of mask {jnp.shape(mask)}, "
                f"got {jnp.shape(value)}"
            )
    return int(jnp.shape(mask)[0])


def _check_records(fn: str, batch: int, **arrays: Array | None) -> None:
    for name, value in arrays.items():
        if value is not None and jnp.shape(value) != (batch,):
            raise ValueError(f"{fn}: {name} must have shape [{batch}], got {jnp.shape(value)}")


def _sequence_logprob(logp: Array, mask: Array) -> Array:
    """log π(y|x) = Σ_t mask_t logp_t; masked positions may hold NaN/inf (padding)."""
    m = jnp.asarray(mask) > 0
    return jnp.sum(jnp.where(m, logp, 0.0), axis=-1)


def _lengths(mask: Array) -> Array:
    return jnp.sum((jnp.asarray(mask) > 0).astype(jnp.float32), axis=-1)


def _pairs(
    fn: str, pair_index: Array, batch: int, record_weights: Array
) -> tuple[Array, Array, Array]:
    """(chosen rows, rejected rows, pair weights); padding pairs get weight 0."""
    pair_index = jnp.asarray(pair_index)
    if pair_index.ndim != 2 or pair_index.shape[1] != 2:
        raise ValueError(f"{fn}: pair_index must have shape [P, 2], got {pair_index.shape}")
    if not jnp.issubdtype(pair_index.dtype, jnp.integer):
        raise ValueError(f"{fn}: pair_index must hold integers, got dtype {pair_index.dtype}")
    if not isinstance(pair_index, jax.core.Tracer):
        host = np.asarray(pair_index)
        too_big = host >= batch
        if too_big.any():
            p = int(np.argwhere(too_big)[0][0])
            raise ValueError(
                f"{fn}: pair_index[{p}] = {host[p].tolist()} points past the batch of {batch} rows"
            )
        if ((host[:, 0] >= 0) & (host[:, 0] == host[:, 1])).any():
            p = int(np.argmax(host[:, 0] == host[:, 1]))
            raise ValueError(f"{fn}: pair_index[{p}] pairs row {host[p, 0]} with itself")
    real = jnp.all(pair_index >= 0, axis=1)
    chosen = jnp.clip(pair_index[:, 0], 0, batch - 1)
    rejected = jnp.clip(pair_index[:, 1], 0, batch - 1)
    weights = jnp.where(real, record_weights[chosen] * record_weights[rejected], 0.0)
    return chosen, rejected, (weights > 0).astype(jnp.float32)


def _pair_logratios(fn, logp, ref_logp, mask, pair_index, record_mask):
    batch = _check_tokens(fn, mask, logp=logp, ref_logp=ref_logp)
    _check_records(fn, batch, record_mask=record_mask)
    chosen, rejected, pw = _pairs(fn, pair_index, batch, record_weights(record_mask, batch))
    logratio = _sequence_logprob(logp, mask) - _sequence_logprob(ref_logp, mask)
    return logratio[chosen], logratio[rejected], pw, chosen


def _pair_metrics(beta, chosen_lr, rejected_lr, pw) -> dict[str, Array]:
    delta = chosen_lr - rejected_lr
    return {
        "chosen_logratio": wmean(chosen_lr, pw),
        "rejected_logratio": wmean(rejected_lr, pw),
        "chosen_reward": wmean(beta * chosen_lr, pw),
        "rejected_reward": wmean(beta * rejected_lr, pw),
        "reward_margin": wmean(beta * delta, pw),
        "reward_accuracy": wmean((delta > 0).astype(jnp.float32), pw),
        "num_pairs": jnp.sum(pw),
    }
