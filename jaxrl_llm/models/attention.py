"""Causal self-attention behind one function, with a fused kernel per platform.

`self_attention(q, k, v, segment_ids, ...)` computes what `layers.dot_product_attention` does
with `layers.attention_mask` for a forward without a KV cache: a query attends to the keys of
its own segment at or before its slot (and, for a sliding-window layer, fewer than `window`
slots back), with the scores optionally soft-capped (Gemma 2). Implementations
(`model.attention`):

- "splash" — TPU: Pallas splash attention (`jax.experimental.pallas.ops.tpu.
  splash_attention`), a flash-style kernel that never materialises the [B, H, T, S] scores; GQA
  native, segment ids, `LocalMask` for the window, `attn_logits_soft_cap`. Mosaic kernels are
  not partitioned automatically, so under a mesh (`attention_mesh`) it runs in a `shard_map`
  over the batch axes (and "tensor" over heads). Off TPU it runs in Pallas' interpret mode (tests).
- "cudnn" — GPU: `jax.nn.dot_product_attention(implementation="cudnn")` (flash attention in
  cuDNN) with `is_causal` and `local_window_size`, plus the segment mask only when a row is
  packed or left-padded (a `lax.cond` on `one_sequence_per_row`: cuDNN takes the mask as a
  [B, 1, T, S] bias, which cost 1.6× at T = 4,096 on an H100). cuDNN has no logit soft-cap
  and needs fp16/bf16, so those cases run the "jnp" path.
- "xla" — the same call with `implementation="xla"` (the reference for the cuDNN arguments).
- "jnp" — `layers.dot_product_attention` on an explicit mask (today's path; also every call
  with a KV cache, whose masks the fused kernels do not express).
- "auto" — "splash" on TPU, "cudnn" on GPU, `CPU_DEFAULT` on CPU (measured faster here, see
  benchmarks/results/attention_cpu.json).

Padding: the fused paths mask by segment equality, so a padding query (segment 0) attends to
the padding keys before it instead of to nothing; padding outputs are never read by a real
token (no real query sees a padding key), so real tokens' values and gradients are identical.
The window is counted in slots, which equals the position difference inside a segment (the
loader writes consecutive positions per segment).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from functools import partial
from typing import Any

import chex
import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as sa
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxrl_llm.core.errors import ConfigError
from jaxrl_llm.models.layers import attention_mask, dot_product_attention
from jaxrl_llm.parallel.mesh import BATCH_AXES

Array = jax.Array
IMPLEMENTATIONS: tuple[str, ...] = ("auto", "jnp", "xla", "cudnn", "splash")
# What "auto" picks on CPU: "jnp" vs "xla" measured by benchmarks/attention.py on the 2-core CPU.
CPU_DEFAULT = "jnp"
_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("attention_mesh", default=None)


@contextlib.contextmanager
def attention_mesh(mesh: Mesh | None) -> Iterator[None]:
    """While tracing a model under this context, the fused kernels use `mesh`: its platform
    decides "auto" and splash runs in a `shard_map` over it."""
    token = _MESH.set(mesh)
    try:
        yield
    finally:
        _MESH.reset(token)


def current_mesh() -> Mesh | None:
    """The mesh set by the innermost `attention_mesh` (None outside one)."""
    return _MESH.get()


def current_platform() -> str:
    """The platform the traced computation is for: the mesh's devices, else the default."""
    mesh = _MESH.get()
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
    return "gpu" if platform in ("cuda", "rocm") else platform


def resolve(implementation: str, *, platform: str | None = None, dtype: Any = None,
            logit_softcap: float | None = None) -> str:
    """The implementation that will run: "auto" by platform; cuDNN's unsupported cases → "jnp"."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"model.attention={implementation!r} is not one of {IMPLEMENTATIONS}")
    platform = platform or current_platform()
    if implementation == "auto":
        implementation = {"tpu": "splash", "gpu": "cudnn"}.get(platform, CPU_DEFAULT)
    if implementation == "cudnn" and (
        logit_softcap is not None
        or (dtype is not None and jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16))
        or platform != "gpu"
    ):
        # cuDNN: no soft-cap, half precision only, GPU only; the XLA call has no soft-cap either.
        return "xla" if logit_softcap is None else "jnp"
    if implementation == "xla" and logit_softcap is not None:
        return "jnp"
    return implementation


def self_attention(
    q: Array,
    k: Array,
    v: Array,
    segment_ids: Array,
    *,
    scale: float,
    logit_softcap: float | None = None,
    window: int | None = None,
    is_local: bool | Array = False,
    implementation: str = "auto",
) -> Array:
    """Causal GQA self-attention. q [B,T,Hq,D], k/v [B,T,Hkv,D], segment_ids [B,T] -> [B,T,Hq,D].

    `is_local` (a bool or, under a layer scan, a traced bool) selects the sliding window
    `window` for this layer; see the module docstring for the implementations.
    """
    b, t, hq, d = q.shape
    chex.assert_shape(k, (b, t, None, d))
    chex.assert_equal_shape([k, v])
    chex.assert_shape(segment_ids, (b, t))
    impl = resolve(implementation, dtype=q.dtype, logit_softcap=logit_softcap)
    if impl == "splash" and t % 128:
        impl = "jnp"  # the kernel tiles the sequence in 128-wide blocks
    fn = partial(_IMPLS[impl], scale=scale, logit_softcap=logit_softcap)
    if window is None or is_local is False:
        return fn(q, k, v, segment_ids, window=None)
    if is_local is True:
        return fn(q, k, v, segment_ids, window=window)
    return jax.lax.cond(is_local, partial(fn, window=window), partial(fn, window=None),
                        q, k, v, segment_ids)


def _jnp(q, k, v, seg, *, scale, logit_softcap, window):
    t = q.shape[1]
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), seg.shape)
    mask = attention_mask(seg, pos, pos[0], seg, pos, pos[0], window)
    return dot_product_attention(q, k, v, mask, scale=scale, logit_softcap=logit_softcap)


def one_sequence_per_row(seg: Array) -> Array:
    """True when every row of `seg` [B, T] is 1…1 0…0: one record, right-padded (not packed)."""
    return jnp.all((seg <= 1) & (seg >= 0)) & jnp.all(seg[:, 1:] <= seg[:, :-1])


def _nn(q, k, v, seg, *, scale, logit_softcap, window, implementation):
    del logit_softcap  # `resolve` routes soft-capped attention to "jnp"
    call = partial(jax.nn.dot_product_attention, scale=scale, is_causal=True,
                   local_window_size=None if window is None else (window - 1, 0),
                   implementation=implementation)

    def masked(q, k, v, seg):
        same = (seg[:, :, None] == seg[:, None, :])[:, None]  # [B, 1, T, S]
        return call(q, k, v, mask=same)

    # Unpacked right-padded rows need no segment mask: causality already keeps every real
    # query off the padding after it (padded queries' outputs are never read). cuDNN then
    # skips its [B, 1, T, S] bias: 1.6× faster at T = 4,096 (benchmarks/attention.py, H100).
    return jax.lax.cond(one_sequence_per_row(seg), lambda q, k, v, seg: call(q, k, v),
                        masked, q, k, v, seg)


def _block(t: int, prefer: int = 512) -> int:
    size = prefer
    while t % size:
        size //= 2
    return size


def _splash_local(q, k, v, seg, *, scale, logit_softcap, window, interpret):
    """Splash on per-device shapes: q [B,T,Hq,D], k/v [B,T,Hkv,D]."""
    b, t, hq, d = q.shape
    precision = jax.config.jax_default_matmul_precision
    if q.dtype != jnp.float32 and precision in ("highest", "float32"):
        # Mosaic cannot lower a bf16 dot at fp32 contract precision (the kernel's backward is
        # traced later, outside any context we could set here): refuse before compiling.
        raise ConfigError(
            f"JAX_DEFAULT_MATMUL_PRECISION={precision} cannot compile splash attention on "
            f"{q.dtype} inputs (Mosaic has no fp32-precision {q.dtype} dot); unset it, or set "
            "model.attention=jnp, or model.compute_dtype=float32")
    if window is None:
        head_mask = sa.CausalMask((t, t))
    else:  # key slot ≥ query slot − (window − 1), and causal
        head_mask = sa.LocalMask((t, t), (window - 1, 0), 0)
    bq = _block(t)
    sizes = sa.BlockSizes(block_q=bq, block_kv=bq, block_kv_compute=bq, block_q_dkv=bq,
                          block_kv_dkv=bq, block_kv_dkv_compute=bq, block_q_dq=bq,
                          block_kv_dq=bq)
    kernel = sa.make_splash_mha(sa.MultiHeadMask([head_mask] * hq), block_sizes=sizes,
                                head_shards=1, q_seq_shards=1,
                                attn_logits_soft_cap=logit_softcap, interpret=interpret)
    qh = (q * jnp.asarray(scale, q.dtype)).transpose(0, 2, 1, 3)  # the kernel does not scale
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    def one(qi, ki, vi, si):
        return kernel(qi, ki, vi, segment_ids=sa.SegmentIds(q=si, kv=si))

    return jax.vmap(one)(qh, kh, vh, seg).transpose(0, 2, 1, 3)


def _splash(q, k, v, seg, *, scale, logit_softcap, window):
    interpret = current_platform() != "tpu"
    local = partial(_splash_local, scale=scale, logit_softcap=logit_softcap, window=window,
                    interpret=interpret)
    mesh = _MESH.get()
    if mesh is None or mesh.size == 1:
        return local(q, k, v, seg)
    shards = 1
    for axis in BATCH_AXES:
        shards *= mesh.shape.get(axis, 1)
    rows = BATCH_AXES if q.shape[0] % shards == 0 else None
    tensor = mesh.shape.get("tensor", 1)
    heads = "tensor" if tensor > 1 and k.shape[2] % tensor == 0 else None
    qkv = P(rows, None, heads, None)
    return jax.shard_map(local, mesh=mesh, in_specs=(qkv, qkv, qkv, P(rows, None)),
                         out_specs=qkv, check_vma=False)(q, k, v, seg)


_IMPLS = {
    "jnp": _jnp,
    "xla": partial(_nn, implementation="xla"),
    "cudnn": partial(_nn, implementation="cudnn"),
    "splash": _splash,
}
