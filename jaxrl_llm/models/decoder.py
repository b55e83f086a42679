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
same numerics, same HF names. Each layer is wrapped in `jax.checkpoint` with the policy named
by `config.remat`. With a KV cache (decoding) a scanned model runs unrolled, each layer on its
own cache buffer, unless `stacked_decode` says otherwise: XLA:CPU copies each layer's slice of a
stacked cache out and back every step (SmolLM2-135M, 16 rows, 2 CPU cores: 431 ms per decode
step scanned against 96 ms unrolled), while the TPU compiler updates the stack in place and
compiles the scan far faster (Llama-3-8B decode for v5e: 8.5 s against 93 s,
benchmarks/decode_v5e.py) without a per-layer copy of the weights.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import chex
import jax
import jax.numpy as jnp
from flax import nnx, struct

from jaxrl_llm.models.attention import (
    attention_mesh,
    current_mesh,
    current_platform,
    fsdp_only,
    gather_sequence,
    resolve,
    self_attention,
)
from jaxrl_llm.models.config import DecoderConfig
from jaxrl_llm.models.layer_scan import LayerGradAccumulator, accumulating_layer_scan
from jaxrl_llm.models.layers import (
    MLP,
    Attention,
    RMSNorm,
    attention_mask,
    cached_attention,
    dot_product_attention,
    fuse_projections,
    make_param,
    mlp,
    project_out,
    project_qkv,
    rms_norm,
    rope_attention_scale,
    rope_cos_sin,
    rope_inv_freq,
    softcap,
)
from jaxrl_llm.parallel.context import load_balance_order

Array = jax.Array

REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole layer in the backward pass
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


@struct.dataclass
class KVCache:
    """Key/value cache for incremental decoding (a pytree; shapes are static).

    k             L × [B, Hkv, D, S] keys (after RoPE) of each layer, transposed (or one
                  stacked [L, B, Hkv, D, S] array: `stacked_decode`)
    v             L × [B, Hkv, S, D] values of each layer (or [L, B, Hkv, S, D])
    segment_ids   [B, S] int32       segment id of each slot; 0 = empty or padding (never seen)
    positions     [B, S] int32       RoPE position of each slot (for the sliding window)
    index         [] int32           next slot to write (the same for every row)
    lengths       [B] int32          number of non-padding tokens written per row

    A call with T tokens writes them to slots [index, index + T) of every row, then
    index += T and lengths += (number of tokens with segment id ≠ 0). Queries see cache slots
    that are non-padding, in the same segment, at or before their own slot (and within the
    sliding window by position). Default positions with a cache continue each row:
    `lengths[:, None] + cumsum(segment_ids != 0) - 1`, so a left- or right-padded prompt
    (segment_ids = its attention mask) gets positions 0..n-1 on its real tokens and each
    decode step (segment_ids = 1) gets the row's next position. The layouts are the ones
    `layers.cached_attention` multiplies without a transpose; k and v are tuples of one array
    per layer, so a layer reads its own buffer instead of copying a slice out of a stack,
    except under `stacked_decode` (a scanned model decoded under its layer scan).
    Writing past S is not checked inside jit: the caller must keep index + T ≤ S. Attention
    always spans all S slots (static shapes; the sampler grows S between windows of steps);
    k/v are updated with dynamic_update_slice, in place when the cache is a loop carry
    (`lax.while_loop` / `fori_loop`) or a donated jit argument.
    """

    k: tuple[Array, ...] | Array
    v: tuple[Array, ...] | Array
    segment_ids: Array
    positions: Array
    index: Array
    lengths: Array

    @property
    def max_len(self) -> int:
        return jax.tree.leaves(self.v)[0].shape[-2]


class Block(nnx.Module):
    """One decoder layer's parameters (optionally stacked `stack` deep for the scan)."""

    def __init__(self, config: DecoderConfig, rngs: nnx.Rngs, *, stack: int | None = None):
        d = config.hidden_size
        self.attn_norm = RMSNorm(d, config, stack=stack)
        self.attn = Attention(config, rngs, stack=stack)
        self.mlp_norm = RMSNorm(d, config, stack=stack)
        self.mlp = MLP(config, rngs, stack=stack)
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
    """One pre-norm layer on the pure parameter dict `p`.

    mask: the [B, T, S] mask for `layers.dot_product_attention`, or a function
    `(q, k, v) -> attention output` (a fused kernel from `models/attention.py`).
    kv: None, this layer's cache pair [B, Hkv, D, S] / [B, Hkv, S, D], or the whole stacked
    pair [L, B, Hkv, D, S] / [L, B, Hkv, S, D] read and written at `layer_index` (`KVCache`).
    The new keys and values are written in place (one dynamic_update_slice on the
    loop-carried buffer, so a decode step never copies the cache) and the updated pair is
    returned.
    """
    c = config
    norm = lambda h, name: rms_norm(h, p[name]["scale"], eps=c.rms_norm_eps, gemma=c.is_gemma)
    q, k, v = project_qkv(p["attn"], norm(x, "attn_norm"), cos, sin, c)
    if kv is not None:
        kv = _write_cache(kv, k, v, layer_index, cache_index)
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
    h = mlp(p["mlp"], norm(x, "mlp_norm"), c)
    if c.is_gemma:
        h = norm(h, "post_mlp_norm")
    return x + h, kv


def _write_cache(kv: tuple[Array, Array], k: Array, v: Array, layer_index: Array | int,
                 slot: Array) -> tuple[Array, Array]:
    """Write k, v [B, T, Hkv, D] at slots [slot, slot + T) of the cache pair (the `KVCache`
    layouts: one layer's buffers, or a stack indexed by `layer_index`)."""
    ck, cv = kv
    new_k = k.transpose(0, 2, 3, 1).astype(ck.dtype)  # [B, Hkv, D, T]
    new_v = v.transpose(0, 2, 1, 3).astype(cv.dtype)  # [B, Hkv, T, D]
    if ck.ndim == 5:
        return (jax.lax.dynamic_update_slice(ck, new_k[None], (layer_index, 0, 0, 0, slot)),
                jax.lax.dynamic_update_slice(cv, new_v[None], (layer_index, 0, 0, slot, 0)))
    return (jax.lax.dynamic_update_slice(ck, new_k, (0, 0, 0, slot)),
            jax.lax.dynamic_update_slice(cv, new_v, (0, 0, slot, 0)))


def stacked_decode(config: DecoderConfig) -> bool:
    """Does sampling run this model's layers under its layer scan, on a stacked KV cache?
    `decode_layers`: "scanned" / "unrolled", or "auto": scanned for a scanned model traced for a
    TPU (the mesh's platform, `attention.current_platform`), unrolled elsewhere (module
    docstring)."""
    if not config.scan_layers or config.decode_layers == "unrolled":
        return False
    return config.decode_layers == "scanned" or current_platform() == "tpu"


def per_layer(stacked: Any, num_layers: int) -> list[Any]:
    """A scanned model's stacked layer params (leading "layers" axis) as a list of per-layer
    trees (copies under jit: decoding reads each layer's weights from its own buffers)."""
    return [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(num_layers)]


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
        params = self.pure_layer_params()
        if stacked_decode(self.config):
            return fuse_projections(params)
        if self.config.scan_layers:
            return per_layer(fuse_projections(params), self.config.num_layers)
        return [fuse_projections(p) for p in params]

    def init_cache(self, batch_size: int, max_len: int, dtype: Any = None) -> KVCache:
        """An empty `KVCache` for `batch_size` rows of up to `max_len` tokens (compute dtype):
        one buffer per layer, or one stack under `stacked_decode` (module docstring)."""
        c = self.config
        dtype = dtype or c.compute_jnp_dtype
        k_shape = (batch_size, c.num_kv_heads, c.head_dim, max_len)
        v_shape = (batch_size, c.num_kv_heads, max_len, c.head_dim)
        if stacked_decode(c):
            k = jnp.zeros((c.num_layers, *k_shape), dtype)
            v = jnp.zeros((c.num_layers, *v_shape), dtype)
        else:
            k = tuple(jnp.zeros(k_shape, dtype) for _ in range(c.num_layers))
            v = tuple(jnp.zeros(v_shape, dtype) for _ in range(c.num_layers))
        return KVCache(
            k=k,
            v=v,
            segment_ids=jnp.zeros((batch_size, max_len), jnp.int32),
            positions=jnp.zeros((batch_size, max_len), jnp.int32),
            index=jnp.zeros((), jnp.int32),
            lengths=jnp.zeros((batch_size,), jnp.int32),
        )

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
    ) -> Array | tuple[Array, KVCache]:
        """Hidden states [B, T, d] after the final norm; `(hidden, new_cache)` with a cache.

        context_order: (no cache) c > 1 says the rows' tokens are in the load-balanced order
        of c context shards (`parallel.context.load_balance_order`): causality compares the
        tokens' original slots, and the keys and values are gathered over the "context" axis.

        layer_params: the layers' pure params to use instead of the module's (e.g.
        `decode_layer_params()`, built once before a decode loop).
        grad_accumulator: (`scan_layers`, no cache) the layer weights are float32 masters run
        through `layer_scan.accumulating_layer_scan`: their gradient is this plus the gradient."""
        c = self.config
        assert grad_accumulator is None or (cache is None and c.scan_layers), "scan_layers only"
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

        def layer(p, x, is_sliding, kv, layer_index=0):
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
            return block_forward(p, x, cos, sin, mask, kv, cache_index, c, layer_index)

        params = self.pure_layer_params() if layer_params is None else layer_params
        # With a cache: scanned only over a stacked cache (`stacked_decode`, module docstring).
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

        if grad_accumulator is not None:  # recomputes each layer in its own backward pass
            mesh = current_mesh()  # the backward pass is traced outside the caller's context

            def accumulated_layer(p, h, is_sliding):
                with attention_mesh(mesh):
                    return layer(p, h, is_sliding, None)[0]

            x = accumulating_layer_scan(accumulated_layer, params, grad_accumulator, x,
                                        layer_xs)
        elif scanned:

            def body(x, xs):
                p, is_sliding = xs
                return remat_layer(p, x, is_sliding, None)[0], None

            x, _ = jax.lax.scan(body, x, (params, layer_xs))
        elif stacked:  # decoding under the layer scan, the stacked cache in the carry

            def cached_body(carry, xs):
                x, kv = carry
                p, is_sliding, index = xs
                return layer(p, x, is_sliding, kv, index), None

            indices = jnp.arange(c.num_layers, dtype=jnp.int32)
            (x, kv), _ = jax.lax.scan(cached_body, (x, kv), (params, layer_xs, indices))
        else:
            new_k, new_v = [], []
            for i, p in enumerate(params):
                layer_kv = None if kv is None else (kv[0][i], kv[1][i])
                x, layer_kv = remat_layer(p, x, sliding[i], layer_kv)
                if layer_kv is not None:
                    new_k.append(layer_kv[0])
                    new_v.append(layer_kv[1])
            if kv is not None:
                kv = (tuple(new_k), tuple(new_v))

        hidden = rms_norm(x, self.final_norm.scale[...], eps=c.rms_norm_eps, gemma=c.is_gemma)
        if cache is None:
            return hidden
        new_cache = KVCache(
            k=kv[0],
            v=kv[1],
            segment_ids=kv_seg,
            positions=kv_pos,
            index=cache.index + t,
            lengths=cache.lengths + jnp.sum(segment_ids != 0, axis=1, dtype=jnp.int32),
        )
        return hidden, new_cache


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
