"""Mixture-of-experts MLP: a top-k softmax router and dropless expert MLPs on grouped matmuls.

One MoE layer (Qwen3-MoE, Mixtral, Qwen2-MoE as transformers' `*SparseMoeBlock`s compute it):

    p = softmax(x · W_router)                       [N, E], float32
    (ids, v) = top_k(p, k)                          the k experts of each token
    g = v / Σ v   (norm_topk_prob; Mixtral always)  else g = v     (the gates)
    y = Σ_j g_j · down_{ids_j}( silu(gate_{ids_j}(x)) · up_{ids_j}(x) )
        (+ sigmoid(x · w_sg) · shared(x)          Qwen2-MoE's shared expert)

Dropless (no capacity factor, no token dropped): the N·k (token, expert) pairs are sorted by
expert and each expert's rows go through its weights as one group of `jax.lax.ragged_dot`
(models/moe_dispatch.py; a grouped matmul on TPU and GPU; XLA:CPU computes it as a masked
dense product, E times the work, fine for tests). The router runs in float32 whatever the
compute dtype, so its top-k choices do not flip with bf16 rounding of the logits.

Routing in and out: `moe_forward(..., routing=ids)` replays given experts (R3-style routing
replay, arXiv:2510.11370: the experts are the given ones, their gates are recomputed from the
current router's probabilities over them, renormalised as the family does; ids < 0 on a token:
its own top-k); every call returns the experts it used, so a sampler can record them and a
trainer replay them (`Decoder(return_moe=True)`; docs/moe.md).

Auxiliary losses (their per-layer sums come out of each layer, `MoeStats`; the decoder pools
them over layers, `finish_aux`):
- load balancing, as transformers' `load_balancing_loss_func` (Switch Transformer,
  arXiv:2101.03961 eqs. 4-6) pooled over layers: E · Σ_e f_e · P_e with f_e the fraction of
  (token, top-k slot) assignments to expert e and P_e the mean router probability of e, both
  over every layer's non-padding tokens (f sums to k, as in transformers);
- router z-loss (ST-MoE, arXiv:2202.08906 eq. 5): the mean over tokens and layers of
  (log Σ_e exp logit_e)².

Expert parallelism (a mesh with an "expert" axis): `models/moe_dispatch.experts_sharded`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_llm.models.config import DecoderConfig, UnsupportedConfigError
from jaxrl_llm.models.layers import make_param, mlp
from jaxrl_llm.models.moe_dispatch import dispatch_mesh, experts_local, experts_sharded

Array = jax.Array


class MoE(nnx.Module):
    """Parameters of one MoE layer (optionally stacked `stack` deep for the layer scan).

    router [d, E] ("embed", None); gate, up [E, d, F] ("experts", "embed", "mlp"); down
    [E, F, d] ("experts", "mlp", "embed"); Qwen2-MoE: shared_gate, shared_up [d, Fs],
    shared_down [Fs, d] and shared_expert_gate [d, 1].
    """

    def __init__(self, config: DecoderConfig, rngs: nnx.Rngs, *, stack: int | None = None):
        c = config
        d, e, f = c.hidden_size, c.num_experts, c.moe_intermediate_size
        p = dict(dtype=c.param_jnp_dtype, stack=stack, init="normal")
        self.router = make_param(rngs, (d, e), ("embed", None), **p)
        self.gate = make_param(rngs, (e, d, f), ("experts", "embed", "mlp"), **p)
        self.up = make_param(rngs, (e, d, f), ("experts", "embed", "mlp"), **p)
        self.down = make_param(rngs, (e, f, d), ("experts", "mlp", "embed"), **p)
        if c.shared_expert_intermediate_size:
            fs = c.shared_expert_intermediate_size
            self.shared_gate = make_param(rngs, (d, fs), ("embed", "mlp"), **p)
            self.shared_up = make_param(rngs, (d, fs), ("embed", "mlp"), **p)
            self.shared_down = make_param(rngs, (fs, d), ("mlp", "embed"), **p)
            self.shared_expert_gate = make_param(rngs, (d, 1), ("embed", None), **p)
        if c.lora is not None and any(t in c.lora.targets
                                      for t in ("gate_proj", "up_proj", "down_proj")):
            raise UnsupportedConfigError(
                "LoRA on a mixture-of-experts model's experts is not supported: set "
                "model.lora.targets to attention projections (q_proj, k_proj, v_proj, o_proj)")


def is_moe_params(p: dict[str, Any]) -> bool:
    """Whether one layer's `mlp` params are a MoE layer's (they have a router)."""
    return "router" in p


class MoeStats(NamedTuple):
    """One MoE layer's routing and the sums its auxiliary losses need (non-padding tokens).

    ids [B, T, k] int32: the experts each token went to; counts [E]: (token, slot)
    assignments per expert; prob_sum [E]: Σ over tokens of the router probabilities;
    z_sum []: Σ over tokens of logsumexp(logits)²; tokens []: the tokens counted."""

    ids: Array
    counts: Array
    prob_sum: Array
    z_sum: Array
    tokens: Array


class MoeAux(NamedTuple):
    """What a MoE decoder returns beside its hidden states (`Decoder(return_moe=True)`).

    routing [L, B, T, k] int32: every layer's experts per token (what replay takes back);
    aux_loss, z_loss []: the load-balancing and z losses (unweighted; the train step adds
    `router_aux_loss_coef` · aux_loss + `router_z_loss_coef` · z_loss)."""

    routing: Array
    aux_loss: Array
    z_loss: Array


def route(router: Array, x: Array, config: DecoderConfig,
          routing: Array | None = None) -> tuple[Array, Array, Array]:
    """(ids [N, k] int32, gates [N, k] float32, logits [N, E] float32) for tokens x [N, d].

    routing: [N, k] expert ids to use instead of the top-k (replay); their gates are the
    current router's probabilities of those experts, renormalised when the family does. A
    token whose row holds a negative id takes the router's own top-k (a token the replayed
    record has no experts for: a prompt token, padding)."""
    c = config
    logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)
    values, ids = jax.lax.top_k(probs, c.num_experts_per_tok)
    if routing is not None:
        chex.assert_shape(routing, (x.shape[0], c.num_experts_per_tok))
        given = jnp.all(routing >= 0, axis=-1, keepdims=True)
        ids = jnp.where(given, routing.astype(jnp.int32), ids)
        values = jnp.take_along_axis(probs, ids, axis=-1)
    if c.norm_topk_prob:
        values = values / jnp.sum(values, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), values, logits


def layer_stats(ids: Array, logits: Array, token_mask: Array, num_experts: int) -> tuple:
    """(counts [E], prob_sum [E], z_sum [], tokens []) over the tokens where `token_mask`
    ([N] float) is 1: the per-layer sums of both auxiliary losses (module docstring)."""
    w = token_mask.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    one_hot = jax.nn.one_hot(ids, num_experts, dtype=jnp.float32)  # [N, k, E]
    counts = jnp.einsum("nke,n->e", one_hot, w)
    prob_sum = jnp.einsum("ne,n->e", probs, w)
    z = jax.nn.logsumexp(logits, axis=-1)
    return counts, prob_sum, jnp.sum(jnp.square(z) * w), jnp.sum(w)


def moe_forward(p: dict[str, Any], x: Array, config: DecoderConfig, token_mask: Array,
                routing: Array | None = None) -> tuple[Array, MoeStats]:
    """One MoE layer on x [B, T, d] (`token_mask` [B, T]: 1 for real tokens) -> (y [B, T, d]
    in the compute dtype, its `MoeStats`). routing [B, T, k]: replay those experts."""
    c = config
    b, t, d = x.shape
    dt = c.compute_jnp_dtype
    flat = x.reshape(b * t, d)
    replay = None if routing is None else routing.reshape(b * t, -1)
    ids, gates, logits = route(p["router"], flat, c, replay)
    mesh = dispatch_mesh()
    if mesh is not None:  # per device, experts split over the "expert" axis if it has one
        y = experts_sharded(p, x, ids.reshape(b, t, -1), gates.reshape(b, t, -1), c, mesh)
        y = y.reshape(b * t, d)
    else:
        y = experts_local(p, flat, ids, gates, c)
    y = y.astype(dt)
    if "shared_gate" in p:  # Qwen2-MoE: a dense expert every token takes, sigmoid-gated
        shared = mlp({"gate": p["shared_gate"], "up": p["shared_up"], "down": p["shared_down"]},
                     flat, c)
        weight = jax.nn.sigmoid(jnp.dot(flat.astype(dt), p["shared_expert_gate"].astype(dt)))
        y = y + weight * shared
    stats = layer_stats(ids, logits, token_mask.reshape(-1), c.num_experts)
    return y.reshape(b, t, d), MoeStats(ids.reshape(b, t, -1), *stats)


def finish_aux(stats: MoeStats, num_experts: int) -> MoeAux:
    """The decoder's `MoeAux` from every layer's `MoeStats` stacked on a leading [L] axis:
    transformers' pooled load-balancing loss and the mean z-loss (module docstring)."""
    tokens = jnp.maximum(jnp.sum(stats.tokens), 1.0)  # L · (non-padding tokens)
    f = jnp.sum(stats.counts, axis=0) / tokens
    prob = jnp.sum(stats.prob_sum, axis=0) / tokens
    aux = num_experts * jnp.sum(jax.lax.stop_gradient(f) * prob)
    return MoeAux(stats.ids, aux, jnp.sum(stats.z_sum) / tokens)


def router_losses(aux: MoeAux, config: DecoderConfig) -> tuple[Array, dict[str, Array]]:
    """(router_aux_loss_coef · aux_loss + router_z_loss_coef · z_loss, both losses as
    metrics): what the train step adds to its loss, and logs."""
    penalty = (config.router_aux_loss_coef * aux.aux_loss
               + config.router_z_loss_coef * aux.z_loss)
    metrics = {"router_aux_loss": jax.lax.stop_gradient(aux.aux_loss),
               "router_z_loss": jax.lax.stop_gradient(aux.z_loss)}
    return penalty, metrics


__all__ = ["MoE", "MoeAux", "MoeStats", "finish_aux", "is_moe_params", "layer_stats",
           "moe_forward", "route", "router_losses"]
