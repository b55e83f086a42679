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

Context parallelism (`order`: the rows' tokens are in `parallel.context.load_balance_order`
over a mesh's "context" axis): queries stay split over "context", keys and values are
all-gathered over it (MaxText's all-gather strategy), and causality compares original slots.
"jnp" expresses that with sharding constraints and an explicit mask (GSPMD inserts the
gather); "splash" runs in a `shard_map` with the queries' shard of a kernel built with
`q_seq_shards` and a mask whose query sequence is the reorder (the gathered keys are put back
in the original order inside the map, so key blocks stay contiguous). "cudnn"/"xla" take no
such mask: "auto" picks "jnp" on GPU then, and asking for them is refused. "ring"
(`models/ring.py`) is the other strategy: keys and values travel round the "context" axis one
chunk at a time instead of being gathered (without a context split it is "jnp").

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
import numpy as np
from jax.experimental.pallas.ops.tpu import splash_attention as sa
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sa_mask
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm.core.errors import ConfigError
from jaxrl_llm.models.layers import attention_mask, dot_product_attention
from jaxrl_llm.models.ring import ring_attention
from jaxrl_llm.parallel.context import inverse_order
from jaxrl_llm.parallel.mesh import CONTEXT_AXIS, batch_axes, batch_shards, context_shards
from jaxrl_llm.parallel.rules import DEFAULT_PARAM_RULES, logical_to_mesh_spec

Array = jax.Array
IMPLEMENTATIONS: tuple[str, ...] = ("auto", "jnp", "xla", "cudnn", "splash", "ring")
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
            logit_softcap: float | None = None, context: bool = False) -> str:
    """The implementation that will run: "auto" by platform; cuDNN's unsupported cases → "jnp".

    `context`: the tokens are in a context-parallel order (module docstring): "auto" never
    picks "cudnn"/"xla" then, and asking for them raises `ConfigError`."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"model.attention={implementation!r} is not one of {IMPLEMENTATIONS}")
    platform = platform or current_platform()
    if context and implementation in ("xla", "cudnn"):
        raise ConfigError(
            f"model.attention={implementation} cannot run context parallelism (mesh.context > 1):"
            " it takes no load-balanced causal mask; set model.attention=auto, jnp, splash or "
            "ring")
    if implementation == "ring":  # nothing to pass round without a context split
        return "ring" if context else "jnp"
    if implementation == "auto":
        implementation = {"tpu": "splash", "gpu": "cudnn"}.get(platform, CPU_DEFAULT)
        if context and implementation == "cudnn":
            implementation = "jnp"
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
    order: np.ndarray | None = None,
) -> Array:
    """Causal GQA self-attention. q [B,T,Hq,D], k/v [B,T,Hkv,D], segment_ids [B,T] -> [B,T,Hq,D].

    `is_local` (a bool or, under a layer scan, a traced bool) selects the sliding window
    `window` for this layer; `order` (static): the original slot of each slot, for rows in a
    context-parallel order; see the module docstring for the implementations.
    """
    b, t, hq, d = q.shape
    chex.assert_shape(k, (b, t, None, d))
    chex.assert_equal_shape([k, v])
    chex.assert_shape(segment_ids, (b, t))
    impl = resolve(implementation, dtype=q.dtype, logit_softcap=logit_softcap,
                   context=order is not None)
    if impl == "splash" and (t // context_shards(_MESH.get()) % 128):
        impl = "jnp"  # the kernel tiles each device's queries in 128-wide blocks
    fn = partial(_IMPLS[impl], scale=scale, logit_softcap=logit_softcap, order=order)
    if window is None or is_local is False:
        return fn(q, k, v, segment_ids, window=None)
    if is_local is True:
        return fn(q, k, v, segment_ids, window=window)
    return jax.lax.cond(is_local, partial(fn, window=window), partial(fn, window=None),
                        q, k, v, segment_ids)


def gather_sequence(x: Array) -> Array:
    """`x` [B, T, ...] constrained to be whole along T (all-gathered over "context") on the
    current mesh; the other dimensions keep the sharding GSPMD gives them."""
    mesh = _MESH.get()
    if context_shards(mesh) == 1:
        return x
    spec = P(P.UNCONSTRAINED, None, *([P.UNCONSTRAINED] * (x.ndim - 2)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def fsdp_only(x: Array, logical: tuple[str, ...]) -> Array:
    """A parameter `x` (logical axes `logical`) constrained to its layout without the
    "context" split of the state (`parallel.rules`: "embed" → ("fsdp", "context")). For the
    embedding lookup: from a table whose d is split over (fsdp, context), GSPMD cannot move
    the looked-up [B, T, d] rows to (rows over fsdp, tokens over context) except by
    replicating them; with the table gathered over "context" it is the FSDP all-to-all."""
    mesh = _MESH.get()
    if context_shards(mesh) == 1:
        return x
    rules = {**DEFAULT_PARAM_RULES, "embed": "fsdp"}
    spec = logical_to_mesh_spec(logical, x.shape, mesh, rules)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def _jnp(q, k, v, seg, *, scale, logit_softcap, window, order=None):
    t = q.shape[1]
    slots = jnp.arange(t, dtype=jnp.int32) if order is None else jnp.asarray(order, jnp.int32)
    pos = jnp.broadcast_to(slots, seg.shape)  # the window is counted in (original) slots
    kv_seg = seg if order is None else gather_sequence(seg)
    kv_pos = pos if order is None else gather_sequence(pos)
    mask = attention_mask(seg, pos, slots, kv_seg, kv_pos, slots, window)
    if order is not None:
        k, v = gather_sequence(k), gather_sequence(v)
    return dot_product_attention(q, k, v, mask, scale=scale, logit_softcap=logit_softcap)


def one_sequence_per_row(seg: Array) -> Array:
    """True when every row of `seg` [B, T] is 1…1 0…0: one record, right-padded (not packed)."""
    return jnp.all((seg <= 1) & (seg >= 0)) & jnp.all(seg[:, 1:] <= seg[:, :-1])


def _nn(q, k, v, seg, *, scale, logit_softcap, window, implementation, order=None):
    del logit_softcap, order  # `resolve` routes soft-capped and context-parallel calls away
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


class OrderedCausalMask(sa_mask._ComputableMask):
    """Splash's causal (optionally windowed) mask for queries in a permuted order: query row i
    is original slot `order[i]`, key column j original slot j (module docstring)."""

    def __init__(self, shape: tuple[int, int], order: np.ndarray, window: int | None,
                 shard_count: int = 1):
        self.window = window

        def visible(q_ids, kv_ids):
            causal = q_ids >= kv_ids
            return causal if window is None else causal & (q_ids - kv_ids < window)

        super().__init__(shape=shape, mask_function=visible, shard_count=shard_count)
        self.q_sequence = np.asarray(order, np.int32)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, OrderedCausalMask) and self.shape == other.shape
                and self.window == other.window
                and np.array_equal(self.q_sequence, other.q_sequence))

    def __hash__(self) -> int:
        return hash((type(self), self.shape, self.window, self.q_sequence.tobytes()))


def _splash_kernel(t: int, hq: int, dtype: Any, *, logit_softcap, window, interpret,
                   order: np.ndarray | None = None, shards: int = 1):
    """The splash kernel for rows of `t` tokens and `hq` heads; with `order`, the queries are
    split over `shards` context shards (`q_seq_shards`) and masked by `OrderedCausalMask`."""
    precision = jax.config.jax_default_matmul_precision
    if dtype != jnp.float32 and precision in ("highest", "float32"):
        # Mosaic cannot lower a bf16 dot at fp32 contract precision (the kernel's backward is
        # traced later, outside any context we could set here): refuse before compiling.
        raise ConfigError(
            f"JAX_DEFAULT_MATMUL_PRECISION={precision} cannot compile splash attention on "
            f"{dtype} inputs (Mosaic has no fp32-precision {dtype} dot); unset it, or set "
            "model.attention=jnp, or model.compute_dtype=float32")
    if order is not None:
        head_mask = OrderedCausalMask((t, t), order, window, shards)
    elif window is None:
        head_mask = sa.CausalMask((t, t))
    else:  # key slot ≥ query slot − (window − 1), and causal
        head_mask = sa.LocalMask((t, t), (window - 1, 0), 0)
    bq = _block(t // shards)
    sizes = sa.BlockSizes(block_q=bq, block_kv=bq, block_kv_compute=bq, block_q_dkv=bq,
                          block_kv_dkv=bq, block_kv_dkv_compute=bq, block_q_dq=bq,
                          block_kv_dq=bq)
    return sa.make_splash_mha(sa.MultiHeadMask([head_mask] * hq), block_sizes=sizes,
                              head_shards=1, q_seq_shards=shards,
                              attn_logits_soft_cap=logit_softcap, interpret=interpret)


def _apply_splash(kernel, q, k, v, seg_q, seg_kv, scale):
    """The kernel on per-device shapes: q [B,Tq,Hq,D], k/v [B,T,Hkv,D] -> [B,Tq,Hq,D]."""
    qh = (q * jnp.asarray(scale, q.dtype)).transpose(0, 2, 1, 3)  # the kernel does not scale
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    def one(qi, ki, vi, sq, skv):
        return kernel(qi, ki, vi, segment_ids=sa.SegmentIds(q=sq, kv=skv))

    return jax.vmap(one)(qh, kh, vh, seg_q, seg_kv).transpose(0, 2, 1, 3)


def _splash_local(q, k, v, seg, *, scale, logit_softcap, window, interpret):
    """Splash on per-device shapes: q [B,T,Hq,D], k/v [B,T,Hkv,D]."""
    kernel = _splash_kernel(q.shape[1], q.shape[2], q.dtype, logit_softcap=logit_softcap,
                            window=window, interpret=interpret)
    return _apply_splash(kernel, q, k, v, seg, seg, scale)


def _splash(q, k, v, seg, *, scale, logit_softcap, window, order=None):
    interpret = current_platform() != "tpu"
    local = partial(_splash_local, scale=scale, logit_softcap=logit_softcap, window=window,
                    interpret=interpret)
    mesh = _MESH.get()
    if mesh is None or mesh.size == 1:
        return local(q, k, v, seg)
    rows = batch_axes(mesh) if q.shape[0] % batch_shards(mesh) == 0 else None
    tensor = mesh.shape.get("tensor", 1)
    heads = "tensor" if tensor > 1 and k.shape[2] % tensor == 0 else None
    qkv = P(rows, None, heads, None)
    if order is not None and context_shards(mesh) > 1:
        return _splash_context(q, k, v, seg, mesh, rows, heads, order, scale=scale,
                               logit_softcap=logit_softcap, window=window, interpret=interpret)
    return jax.shard_map(local, mesh=mesh, in_specs=(qkv, qkv, qkv, P(rows, None)),
                         out_specs=qkv, check_vma=False)(q, k, v, seg)


def _splash_context(q, k, v, seg, mesh, rows, heads, order, *, scale, logit_softcap, window,
                    interpret):
    """Splash under context parallelism: each device's queries (its two load-balanced chunks)
    against all keys and values, gathered over "context" by the map's input specs."""
    c = context_shards(mesh)
    kernel = _splash_kernel(q.shape[1], q.shape[2], q.dtype, logit_softcap=logit_softcap,
                            window=window, interpret=interpret, order=order, shards=c)
    kernel_spec = kernel.manual_sharding_spec(NamedSharding(mesh, P(None, CONTEXT_AXIS)))
    inverse = inverse_order(order)

    def local(kernel, q, k, v, seg_q, seg_kv):
        # gathered keys back in the original order: the mask's key columns are original slots
        k, v, seg_kv = k[:, inverse], v[:, inverse], seg_kv[:, inverse]
        return _apply_splash(kernel, q, k, v, seg_q, seg_kv, scale)

    q_spec, kv_spec = P(rows, CONTEXT_AXIS, heads, None), P(rows, None, heads, None)
    return jax.shard_map(local, mesh=mesh,
                         in_specs=(kernel_spec, q_spec, kv_spec, kv_spec, P(rows, CONTEXT_AXIS),
                                   P(rows, None)),
                         out_specs=q_spec, check_vma=False)(kernel, q, k, v, seg, seg)


def _ring(q, k, v, seg, *, scale, logit_softcap, window, order=None):
    mesh = _MESH.get()
    if order is None or context_shards(mesh) == 1:
        return _jnp(q, k, v, seg, scale=scale, logit_softcap=logit_softcap, window=window,
                    order=order)
    return ring_attention(q, k, v, seg, mesh=mesh, order=order, scale=scale,
                          logit_softcap=logit_softcap, window=window)


_IMPLS = {
    "jnp": _jnp,
    "ring": _ring,
    "xla": partial(_nn, implementation="xla"),
    "cudnn": partial(_nn, implementation="cudnn"),
    "splash": _splash,
}
