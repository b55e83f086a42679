"""`Decoder`: the Flax NNX decoder-only transformer for every supported family.

Returns final hidden states (after the final norm), per docs/architecture.md § Contracts; the loss takes
log-probs from `hidden @ unembedding()` in chunks (docs/kernels.md § Token log-probs). `logits()` is for sampling and
tests only.

Inputs
  tokens [B, T] int32; segment_ids [B, T] (0 = padding, equal ids attend to each other,
  causally; default all ones); positions [B, T] (RoPE positions; default `arange(T)` without a
  cache, see `KVCache` with one). Packed rows: give each sequence its own segment id and
  positions restarting at 0.

Layers are either a `nnx.List` of `Block`s (`scan_layers=False`) or one `Block` whose
parameters carry a leading "layers" axis and run under `jax.lax.scan` (`scan_layers=True`):
same numerics, same HF names (models/decoder_block.py). Each layer is wrapped in
`jax.checkpoint` with the policy named by `config.remat`. With a KV cache (decoding) a scanned
model runs unrolled, each layer on its own cache buffer, unless `stacked_decode` says otherwise
(models/kv_cache.py).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_llm.models.attention import (
    attention_mesh,
    current_mesh,
    fsdp_only,
    gather_sequence,
    resolve,
    self_attention,
)
from jaxrl_llm.models.config import DecoderConfig
from jaxrl_llm.models.decoder_block import REMAT_POLICIES, Block, layer_forward
from jaxrl_llm.models.kv_cache import KVCache, empty_cache, fused_decode_params, per_layer
from jaxrl_llm.models.layer_scan import LayerGradAccumulator, accumulating_layer_scan
from jaxrl_llm.models.layers import (
    RMSNorm,
    attention_mask,
    dot_product_attention,
    make_param,
    rms_norm,
    rope_attention_scale,
    rope_cos_sin,
    rope_inv_freq,
    softcap,
)
from jaxrl_llm.models.moe import MoeAux, MoeStats, finish_aux
from jaxrl_llm.parallel.context import load_balance_order

Array = jax.Array


class Decoder(nnx.Module):
    """Decoder-only transformer (Llama / Mistral / Qwen2 / Qwen3 / SmolLM2 / Gemma 2).

    Parameters and logical axes (prefix "layers" on layer params when `scan_layers`):
      embed [V, d] ("vocab", "embed"); lm_head [V, d] ("vocab", "embed") when untied;
      final_norm.scale [d] ("norm",); per layer: attn_norm / mlp_norm (/ post_attn_norm /
      post_mlp_norm for Gemma 2) .scale [d] ("norm",); attn.q [d, Hq, D]
      ("embed", "q_heads", "head_dim"); attn.k, attn.v [d, Hkv, D] ("embed", "kv_heads",
      "head_dim"); attn.o [Hq, D, d] ("q_heads", "head_dim", "embed"); attn.q_bias [Hq, D],
      attn.k_bias / v_bias [Hkv, D]; attn.o_bias [d] ("embed",); attn.q_norm / k_norm .scale
      [D] ("norm",); mlp.gate, mlp.up [d, F] ("embed", "mlp"); mlp.down [F, d] ("mlp", "embed").

    Built with eager sharding off by default, so no mesh is needed; read the annotations with
    `logical_axes(model)` (or `nnx.get_partition_spec(nnx.state(model))`).
    """

    def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs, eager_sharding: bool = False):
        c = config
        with nnx.use_eager_sharding(eager_sharding):
            self.embed = make_param(rngs, (c.vocab_size, c.hidden_size), ("vocab", "embed"),
                                    dtype=c.param_jnp_dtype, init="normal", stack=None)
            if c.scan_layers:
                self.layers = Block(c, rngs, stack=c.num_layers)
            else:
                self.layers = nnx.List([Block(c, rngs) for _ in range(c.num_layers)])
            self.final_norm = RMSNorm(c.hidden_size, c)
            if not c.tie_embeddings:
                # Stored as rows [V, d] like the embedding (and HF's lm_head.weight): the
                # chunked log-prob kernel slices vocabulary rows (see losses/logprobs.py).
                self.lm_head = make_param(rngs, (c.vocab_size, c.hidden_size),
                                          ("vocab", "embed"), dtype=c.param_jnp_dtype,
                                          init="normal", stack=None)
        self.config = c
        self.final_logit_softcap: float | None = c.final_logit_softcap

    # ---- public API -----------------------------------------------------------------------
    def unembedding(self) -> Array:
        """[d, V]: the embedding table transposed when tied, else lm_head transposed."""
        table = self.embed if self.config.tie_embeddings else self.lm_head
        return table[...].T

    def logits(self, hidden: Array) -> Array:
        """[B, T, V] float32 logits (soft-capped for Gemma 2). Sampling and tests only."""
        out = jnp.einsum("btd,dv->btv", hidden, self.unembedding().astype(hidden.dtype),
                         preferred_element_type=jnp.float32)
        return softcap(out, self.final_logit_softcap)

    def pure_layer_params(self) -> Any:
        """The layers' pure params: one stacked dict (scanned) or a list of per-layer dicts."""
        if self.config.scan_layers:
            return nnx.to_pure_dict(nnx.state(self.layers, nnx.Param))
        return [nnx.to_pure_dict(nnx.state(block, nnx.Param)) for block in self.layers]

    def decode_layer_params(self) -> Any:
        """The layers' pure params with projections fused (`layers.fuse_projections`): a list
        of per-layer trees, or the stack under `stacked_decode`. Build once outside a decode
        loop and pass as `layer_params` to every step. For a scanned model decoded unrolled
        this copies the layer weights once (the fused projections are a copy in either
        layout)."""
        return fused_decode_params(self.config, self.pure_layer_params())

    def init_cache(self, batch_size: int, max_len: int, dtype: Any = None) -> KVCache:
        """An empty `KVCache` for `batch_size` rows of up to `max_len` tokens (compute dtype):
        one buffer per layer, or one stack under `stacked_decode` (models/kv_cache.py)."""
        return empty_cache(self.config, batch_size, max_len, dtype)

    def __call__(
        self,
        tokens: Array,
        *,
        positions: Array | None = None,
        segment_ids: Array | None = None,
        cache: KVCache | None = None,
        layer_params: Any = None,
        grad_accumulator: LayerGradAccumulator | None = None,
        context_order: int = 1,
        routing: Array | None = None,
        return_moe: bool = False,
    ) -> Any:
        """Hidden states [B, T, d] after the final norm; `(hidden, new_cache)` with a cache;
        with `return_moe` (a mixture of experts) a `moe.MoeAux` after them:
        `(hidden, aux)` / `(hidden, new_cache, aux)`.

        routing [L, B, T, k] (a mixture of experts): replay these experts in every layer,
        their gates recomputed from the current routers (`moe.moe_forward`), as returned in
        `MoeAux.routing` (in the rows' token order, the load-balanced one under context
        parallelism); a token whose ids are negative takes its own top-k there.

        context_order: (no cache) c > 1 says the rows' tokens are in the load-balanced order
        of c context shards (`parallel.context.load_balance_order`): causality compares the
        tokens' original slots, and the keys and values are gathered over the "context" axis.

        layer_params: the layers' pure params to use instead of the module's (e.g.
        `decode_layer_params()`, built once before a decode loop).
        grad_accumulator: (`scan_layers`, no cache) the layer weights are float32 masters run
        through `layer_scan.accumulating_layer_scan`: their gradient is this plus the gradient."""
        c = self.config
        assert grad_accumulator is None or (cache is None and c.scan_layers), "scan_layers only"
        if (routing is not None or return_moe) and not c.is_moe:
            raise ValueError(f"routing / return_moe: family={c.family!r} has no experts")
        if grad_accumulator is not None and c.is_moe:  # its scan carries no router sums
            raise ValueError("the in-scan gradient accumulator does not run mixtures of experts")
        if routing is not None:
            chex.assert_shape(routing, (c.num_layers, *tokens.shape, c.num_experts_per_tok))
        assert context_order == 1 or cache is None, "context parallelism has no KV cache"
        chex.assert_rank(tokens, 2)
        b, t = tokens.shape
        if segment_ids is None:
            segment_ids = jnp.ones((b, t), jnp.int32)
        segment_ids = segment_ids.astype(jnp.int32)
        chex.assert_shape(segment_ids, (b, t))
        if positions is None:
            if cache is None:
                positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
            else:
                counted = jnp.cumsum((segment_ids != 0).astype(jnp.int32), axis=1)
                positions = jnp.maximum(cache.lengths[:, None] + counted - 1, 0)
        positions = positions.astype(jnp.int32)
        chex.assert_shape(positions, (b, t))

        dt = c.compute_jnp_dtype
        table = self.embed[...]
        if context_order > 1:  # gather the table over "context" first (`fsdp_only`)
            table = fsdp_only(table, ("vocab", "embed"))
        x = jnp.take(table, tokens, axis=0).astype(dt)
        if c.is_gemma:
            # HF multiplies by sqrt(d) rounded to the activation dtype.
            x = x * jnp.asarray(math.sqrt(c.hidden_size), dtype=dt)
        cos, sin = rope_cos_sin(positions, rope_inv_freq(c), rope_attention_scale(c))

        order = None if context_order == 1 else load_balance_order(t, context_order)
        q_slots = jnp.arange(t, dtype=jnp.int32) if order is None else jnp.asarray(order)
        if cache is None:
            kv_seg, kv_pos, kv_slots = segment_ids, positions, q_slots
            cache_index = None
        else:
            chex.assert_shape(cache.segment_ids, (b, None))
            cache_index = cache.index
            q_slots = q_slots + cache_index
            kv_seg = jax.lax.dynamic_update_slice(cache.segment_ids, segment_ids,
                                                  (0, cache_index))
            kv_pos = jax.lax.dynamic_update_slice(cache.positions, positions, (0, cache_index))
            kv_slots = jnp.arange(cache.max_len, dtype=jnp.int32)
        sliding = c.sliding_layers
        # Without a cache a fused kernel may run (models/attention.py); with one, or for "jnp",
        # the explicit masks, built once for all layers.
        impl = "jnp" if cache is not None else resolve(
            c.attention, dtype=dt, logit_softcap=c.attn_logit_softcap,
            context=order is not None)
        masks_kinds = set(sliding)
        masks = {} if impl != "jnp" else {
            kind: attention_mask(segment_ids, positions, q_slots, kv_seg, kv_pos, kv_slots,
                                 c.sliding_window if kind else None)
            for kind in set(sliding)
        }

        token_mask = (segment_ids != 0).astype(jnp.float32)

        def layer(p, x, is_sliding, kv, layer_index=0, layer_routing=None):
            if not masks:
                mask = functools.partial(
                    self_attention, segment_ids=segment_ids, scale=c.attn_scale,
                    logit_softcap=c.attn_logit_softcap, window=c.sliding_window,
                    is_local=sliding[0] if len(masks_kinds) == 1 else is_sliding,
                    implementation=impl, order=order)
            elif len(masks) == 1:
                mask = next(iter(masks.values()))
            elif isinstance(is_sliding, bool):
                mask = masks[is_sliding]
            else:
                mask = jnp.where(is_sliding, masks[True], masks[False])
            if order is not None and masks:  # queries stay split; keys/values gathered
                explicit = mask
                mask = lambda q, k, v: dot_product_attention(
                    q, gather_sequence(k), gather_sequence(v), explicit, scale=c.attn_scale,
                    logit_softcap=c.attn_logit_softcap)
            return layer_forward(p, x, cos, sin, mask, kv, cache_index, c, layer_index,
                                 token_mask, layer_routing)

        params = self.pure_layer_params() if layer_params is None else layer_params
        # With a cache: scanned only over a stacked cache (`stacked_decode`, models/kv_cache.py).
        stacked = cache is not None and not isinstance(cache.k, (list, tuple))
        scanned = c.scan_layers and cache is None
        if stacked and isinstance(params, (list, tuple)):
            raise ValueError("a stacked KV cache (stacked_decode) needs the stacked layer "
                             "params of a scanned model, got a per-layer list")
        if cache is not None and not stacked and not isinstance(params, (list, tuple)):
            params = per_layer(params, c.num_layers)
        layer_xs = jnp.asarray(sliding)
        kv = None if cache is None else (cache.k, cache.v)
        remat_layer = layer
        if c.remat != "none" and cache is None:  # decoding has no backward pass
            policy = REMAT_POLICIES[c.remat]
            if c.scan_layers:  # under scan CSE cannot undo the remat, so skip its barrier
                remat_layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)
            else:  # unrolled: `is_sliding` is a Python value, static
                remat_layer = jax.checkpoint(layer, policy=policy, static_argnums=(2,))
        stats = None  # MoE: every layer's `MoeStats`, stacked on a leading [L] axis

        if grad_accumulator is not None:  # recomputes each layer in its own backward pass
            mesh = current_mesh()  # the backward pass is traced outside the caller's context

            def accumulated_layer(p, h, is_sliding):
                with attention_mesh(mesh):
                    return layer(p, h, is_sliding, None)[0]

            x = accumulating_layer_scan(accumulated_layer, params, grad_accumulator, x,
                                        layer_xs)
        elif scanned:

            def body(x, xs):
                p, is_sliding, r = xs
                x, _, s = remat_layer(p, x, is_sliding, None, 0, r)
                return x, s

            x, stats = jax.lax.scan(body, x, (params, layer_xs, routing))
        elif stacked:  # decoding under the layer scan, the stacked cache in the carry

            def cached_body(carry, xs):
                x, kv = carry
                p, is_sliding, index, r = xs
                x, kv, s = layer(p, x, is_sliding, kv, index, r)
                return (x, kv), s

            indices = jnp.arange(c.num_layers, dtype=jnp.int32)
            (x, kv), stats = jax.lax.scan(cached_body, (x, kv),
                                          (params, layer_xs, indices, routing))
        else:
            new_k, new_v, per_layer_stats = [], [], []
            for i, p in enumerate(params):
                layer_kv = None if kv is None else (kv[0][i], kv[1][i])
                r = None if routing is None else routing[i]
                x, layer_kv, s = remat_layer(p, x, sliding[i], layer_kv, 0, r)
                per_layer_stats.append(s)
                if layer_kv is not None:
                    new_k.append(layer_kv[0])
                    new_v.append(layer_kv[1])
            if kv is not None:
                kv = (tuple(new_k), tuple(new_v))
            if c.is_moe:
                stats = MoeStats(*(jnp.stack(parts) for parts in zip(*per_layer_stats)))

        hidden = rms_norm(x, self.final_norm.scale[...], eps=c.rms_norm_eps, gemma=c.is_gemma)
        aux: tuple[MoeAux, ...] = (finish_aux(stats, c.num_experts),) if return_moe else ()
        if cache is None:
            return (hidden, *aux) if aux else hidden
        new_cache = KVCache(
            k=kv[0],
            v=kv[1],
            segment_ids=kv_seg,
            positions=kv_pos,
            index=cache.index + t,
            lengths=cache.lengths + jnp.sum(segment_ids != 0, axis=1, dtype=jnp.int32),
        )
        return (hidden, new_cache, *aux)


def logical_axes(model: nnx.Module) -> Any:
    """A `nnx.State` shaped like the model's params whose leaves are tuples of logical names.

    E.g. `logical_axes(model)["layers"][0]["attn"]["q"]` == ("embed", "q_heads", "head_dim")
    (scanned: `["layers"]["attn"]["q"]` == ("layers", "embed", "q_heads", "head_dim")).
    """
    state = nnx.state(model, nnx.Param)
    return jax.tree.map(
        lambda v: tuple(v.get_metadata()["out_sharding"]),
        state,
        is_leaf=lambda v: isinstance(v, nnx.Variable),
    )
