"""`Block`: one decoder layer's parameters, and `block_forward`, the layer on a pure parameter
dict (pre-norm attention and MLP, Gemma 2's post-norms, an optional KV-cache pair written in
place). The MLP is a dense gated MLP, or for the mixture-of-experts families a routed `MoE`
(models/moe.py), whose routing and auxiliary-loss sums `layer_forward` also returns.
`REMAT_POLICIES` names the `jax.checkpoint` policies of `config.remat` that `Decoder` wraps
each layer in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from jaxrl_llm.models.config import DecoderConfig
from jaxrl_llm.models.kv_cache import write_cache
from jaxrl_llm.models.layers import (
    MLP,
    Attention,
    RMSNorm,
    cached_attention,
    dot_product_attention,
    mlp,
    project_out,
    project_qkv,
    rms_norm,
)
from jaxrl_llm.models.moe import MoE, MoeStats, moe_forward

Array = jax.Array

REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole layer in the backward pass
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


class Block(nnx.Module):
    """One decoder layer's parameters (optionally stacked `stack` deep for the scan)."""

    def __init__(self, config: DecoderConfig, rngs: nnx.Rngs, *, stack: int | None = None):
        d = config.hidden_size
        self.attn_norm = RMSNorm(d, config, stack=stack)
        self.attn = Attention(config, rngs, stack=stack)
        self.mlp_norm = RMSNorm(d, config, stack=stack)
        self.mlp = MoE(config, rngs, stack=stack) if config.is_moe else MLP(config, rngs,
                                                                            stack=stack)
        if config.is_gemma:
            self.post_attn_norm = RMSNorm(d, config, stack=stack)
            self.post_mlp_norm = RMSNorm(d, config, stack=stack)


def block_forward(
    p: dict[str, Any],
    x: Array,
    cos: Array,
    sin: Array,
    mask: Array | Callable[[Array, Array, Array], Array],
    kv: tuple[Array, Array] | None,
    cache_index: Array | None,
    config: DecoderConfig,
    layer_index: Array | int = 0,
) -> tuple[Array, tuple[Array, Array] | None]:
    """One pre-norm layer on the pure parameter dict `p` -> (x, kv): `layer_forward` without
    the MoE statistics (every token counted)."""
    x, kv, _ = layer_forward(p, x, cos, sin, mask, kv, cache_index, config, layer_index)
    return x, kv


def layer_forward(
    p: dict[str, Any],
    x: Array,
    cos: Array,
    sin: Array,
    mask: Array | Callable[[Array, Array, Array], Array],
    kv: tuple[Array, Array] | None,
    cache_index: Array | None,
    config: DecoderConfig,
    layer_index: Array | int = 0,
    token_mask: Array | None = None,
    routing: Array | None = None,
) -> tuple[Array, tuple[Array, Array] | None, MoeStats | None]:
    """One pre-norm layer on the pure parameter dict `p` -> (x, kv, MoE stats or None).

    mask: the [B, T, S] mask for `layers.dot_product_attention`, or a function
    `(q, k, v) -> attention output` (a fused kernel from `models/attention.py`).
    kv: None, this layer's cache pair [B, Hkv, D, S] / [B, Hkv, S, D], or the whole stacked
    pair [L, B, Hkv, D, S] / [L, B, Hkv, S, D] read and written at `layer_index` (`KVCache`).
    The new keys and values are written in place (one dynamic_update_slice on the
    loop-carried buffer, so a decode step never copies the cache) and the updated pair is
    returned.
    token_mask [B, T] (MoE): the tokens its auxiliary-loss sums count (default all);
    routing [B, T, k] (MoE): replay those experts (`moe.moe_forward`).
    """
    c = config
    norm = lambda h, name: rms_norm(h, p[name]["scale"], eps=c.rms_norm_eps, gemma=c.is_gemma)
    q, k, v = project_qkv(p["attn"], norm(x, "attn_norm"), cos, sin, c)
    if kv is not None:
        kv = write_cache(kv, k, v, layer_index, cache_index)
        keys_t, values = kv
        if keys_t.ndim == 5:  # the stack: this layer's slice
            keys_t, values = (jax.lax.dynamic_index_in_dim(a, layer_index, 0, keepdims=False)
                              for a in kv)
        attn = cached_attention(q, keys_t.astype(q.dtype), values.astype(q.dtype), mask,
                                scale=c.attn_scale, logit_softcap=c.attn_logit_softcap)
    elif callable(mask):
        attn = mask(q, k, v)
    else:
        attn = dot_product_attention(q, k, v, mask, scale=c.attn_scale,
                                     logit_softcap=c.attn_logit_softcap)
    h = project_out(p["attn"], attn, c)
    if c.is_gemma:
        h = norm(h, "post_attn_norm")
    x = x + h
    stats = None
    if c.is_moe:
        if token_mask is None:
            token_mask = jax.numpy.ones(x.shape[:2], jax.numpy.float32)
        h, stats = moe_forward(p["mlp"], norm(x, "mlp_norm"), c, token_mask, routing)
    else:
        h = mlp(p["mlp"], norm(x, "mlp_norm"), c)
    if c.is_gemma:
        h = norm(h, "post_mlp_norm")
    return x + h, kv, stats
