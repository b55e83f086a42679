"""`KVCache` and the decode-time layer layout: one cache buffer per layer, or one stack.

With a KV cache (decoding) a scanned model runs unrolled, each layer on its own cache buffer,
unless `stacked_decode` says otherwise: XLA:CPU copies each layer's slice of a stacked cache out
and back every step (SmolLM2-135M, 16 rows, 2 CPU cores: 431 ms per decode step scanned against
96 ms unrolled), while the TPU compiler updates the stack in place and compiles the scan far
faster (Llama-3-8B decode for v5e: 8.5 s against 93 s, benchmarks/decode_v5e.py) without a
per-layer copy of the weights. `empty_cache` and `fused_decode_params` build the cache and the
layer params in the layout `stacked_decode` picks (`Decoder.init_cache`,
`Decoder.decode_layer_params`); `write_cache` writes one layer's new keys and values.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxrl_llm.models.attention import current_platform
from jaxrl_llm.models.config import DecoderConfig
from jaxrl_llm.models.layers import fuse_projections

Array = jax.Array


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


def write_cache(kv: tuple[Array, Array], k: Array, v: Array, layer_index: Array | int,
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


def fused_decode_params(config: DecoderConfig, params: Any) -> Any:
    """The layers' pure params `params` (`Decoder.pure_layer_params`) with projections fused
    (`layers.fuse_projections`): a list of per-layer trees, or the stack under `stacked_decode`.
    For a scanned model decoded unrolled this copies the layer weights once (the fused
    projections are a copy in either layout)."""
    if stacked_decode(config):
        return fuse_projections(params)
    if config.scan_layers:
        return per_layer(fuse_projections(params), config.num_layers)
    return [fuse_projections(p) for p in params]


def empty_cache(config: DecoderConfig, batch_size: int, max_len: int,
                dtype: Any = None) -> KVCache:
    """An empty `KVCache` for `batch_size` rows of up to `max_len` tokens (compute dtype): one
    buffer per layer, or one stack under `stacked_decode` (module docstring)."""
    c = config
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
