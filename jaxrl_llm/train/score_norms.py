"""VCPO's pre-pass over the whole batch, before the train step's micro-batch split.

VCPO's off-policy optimal baseline (losses/variance_controlled.py, arXiv:2602.17616) weighs
each record by `w_i² ‖∇_θ log π(y_i)‖²`: the norm of one record's score needs a backward pass
of its own. This module runs one per row (`lax.map`: one parameter-sized gradient alive at a
time, about one more forward and backward of the batch per step), and hands the norms, the
sequence log-ratios and the completion lengths to `variance_controlled.vcpo_batch`, which
returns the advantages the micro-batches train on and the step's `update_scale`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_llm.config import ConfigError, ExperimentConfig
from jaxrl_llm.data.batch import Batch
from jaxrl_llm.losses.logprobs import token_logprobs
from jaxrl_llm.losses.variance_controlled import vcpo_batch
from jaxrl_llm.train.loss_fn import temperature
from jaxrl_llm.train.state import cast_to_dtypes


def squared_norm(tree: Any) -> jax.Array:
    """`Σ x²` over every leaf of `tree`, in float32."""
    return sum((jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)),
               jnp.zeros((), jnp.float32))


def record_scores(config: ExperimentConfig, mesh: Any, st: Any, params: Any, batch: Batch,
                  forward: Callable[..., Any]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per record [B]: `‖∇_θ Σ_t mask_t log π_t‖²` over the trainable `params`, the sequence
    log-ratio `Σ_t mask_t (log π_t − log μ_t)` and the completion length `Σ_t mask_t`, one row
    at a time. `forward` is the train step's (`train.forward.forward`, passed in: no import cycle).
    One record per row: packed rows (`data.pack`) are refused."""
    if batch.records_per_row != 1:
        raise ConfigError(f"loss.name={config.loss.name} needs one record per row for its "
                          "per-record gradient norms; set data.pack=false")
    lc = config.loss
    tau = temperature(config)
    logmu = batch.mu_logprobs if lc.mu_source == "trainer" else batch.behavior_logprobs

    def one(i: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        def row(x: jax.Array) -> jax.Array:
            return jax.lax.dynamic_slice_in_dim(x, i, 1, axis=0)

        m = row(batch.loss_mask).astype(jnp.float32)

        def seq_logp(p: Any) -> tuple[jax.Array, jax.Array]:
            hidden, unembed, softcap = forward(
                st.graphdef, cast_to_dtypes(p, st.param_dtypes), st.model_state,
                row(batch.inputs), row(batch.positions), row(batch.segment_ids), mesh,
                routing=None if batch.routing is None else row(batch.routing))
            logp = token_logprobs(hidden, unembed, row(batch.targets),
                                  chunk_size=lc.logprob_chunk_size, temperature=tau,
                                  softcap=softcap)
            logp = jnp.where(m > 0, logp, 0.0)
            return jnp.sum(logp * m), logp

        (_, logp), grads = jax.value_and_grad(seq_logp, has_aux=True)(params)
        mu = jnp.where(m > 0, row(logmu).astype(jnp.float32), 0.0)
        return squared_norm(grads), jnp.sum((logp - mu) * m), jnp.sum(m)

    return jax.lax.map(one, jnp.arange(batch.batch_size))


def vcpo_prepass(config: ExperimentConfig, mesh: Any, st: Any, params: Any, batch: Batch,
                 forward: Callable[..., Any]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(advantages [B], metrics with `update_scale`) of VCPO on the whole batch."""
    norms, log_w, lengths = record_scores(config, mesh, st, params, batch, forward)
    spec = config.loss.spec
    adv, _, metrics = vcpo_batch(batch.rewards, batch.group_ids, batch.record_mask,
                                 jax.lax.stop_gradient(log_w), norms, lengths,
                                 **spec.kernel_options(dict(config.loss)))
    return adv, metrics
