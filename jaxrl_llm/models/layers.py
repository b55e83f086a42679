"""Building blocks of the decoder: parameters with logical axes, RMSNorm, RoPE, attention, MLP.

Math follows the Hugging Face PyTorch implementations the checkpoints were trained with
(`modeling_llama.py`, `modeling_gemma2.py`, `modeling_rope_utils.py` of transformers 5):
rotate-half RoPE, RMSNorm in float32, softmax in float32.

Every parameter carries logical axis names (metadata `out_sharding`) from this vocabulary:
"vocab", "embed", "q_heads", "kv_heads", "head_dim", "mlp", "norm", and "layers" for the
stacked axis of scanned layers; `parallel/` maps them to mesh axes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_llm.models.config import DecoderConfig
from jaxrl_llm.models.lora import ADAPTER_SUFFIX, attach_adapters, lora_delta
from jaxrl_llm.models.rope import yarn_attention_factor, yarn_inv_freq

Array = jax.Array
# Large negative (not -inf) so a fully masked row (a padding query) stays finite.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def make_param(
    rngs: nnx.Rngs | None,
    shape: Sequence[int],
    axes: Sequence[str],
    *,
    dtype: Any,
    init: str,
    stack: int | None,
) -> nnx.Param:
    """One parameter, optionally stacked with a leading "layers" axis of size `stack`.

    `init`: "normal" (std 0.02, HF's initializer_range), "zeros" or "ones".
    """
    full_shape = tuple(shape) if stack is None else (stack, *shape)
    full_axes = tuple(axes) if stack is None else ("layers", *axes)
    if init == "normal":
        value = 0.02 * jax.random.normal(rngs.params(), full_shape, jnp.float32)
    elif init == "zeros":
        value = jnp.zeros(full_shape, jnp.float32)
    elif init == "ones":
        value = jnp.ones(full_shape, jnp.float32)
    else:
        raise ValueError(f"unknown init {init!r}")
    return nnx.Param(value.astype(dtype), out_sharding=full_axes)


# ---- normalisation -----------------------------------------------------------------------


class RMSNorm(nnx.Module):
    """Holds an RMSNorm scale ("norm" axis); Gemma style stores w with the (1 + w) form, w = 0."""

    def __init__(self, size: int, config: DecoderConfig, *, stack: int | None = None):
        self.scale = make_param(None, (size,), ("norm",), dtype=config.param_jnp_dtype,
                                init="zeros" if config.is_gemma else "ones", stack=stack)


def rms_norm(x: Array, scale: Array, *, eps: float, gemma: bool) -> Array:
    """y = x / sqrt(mean(x²) + eps) · w  (Gemma: · (1 + w)), computed in float32."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    w = scale.astype(jnp.float32)
    return (y * (1.0 + w if gemma else w)).astype(x.dtype)


# ---- rotary position embedding -------------------------------------------------------------


def rope_inv_freq(config: DecoderConfig) -> np.ndarray:
    """Inverse frequencies [head_dim/2] incl. "linear", Llama 3 ("llama3") and "yarn" scaling.

    Same formulas as transformers' `_compute_default/linear/llama3/yarn_rope_parameters`.
    """
    dim = config.head_dim
    if config.rope_scaling is not None and config.rope_scaling["rope_type"] == "yarn":
        return yarn_inv_freq(dim, config.rope_theta, config.rope_scaling)
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64)
                                            .astype(np.float32) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq.astype(np.float32)
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return (inv_freq / factor).astype(np.float32)
    # llama3: long wavelengths scaled by 1/factor, short kept, a smooth ramp in between.
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_len / low
    high_freq_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rope_attention_scale(config: DecoderConfig) -> float:
    """The factor cos and sin are multiplied by: YaRN's attention factor, else 1."""
    scaling = config.rope_scaling
    if scaling is not None and scaling["rope_type"] == "yarn":
        return yarn_attention_factor(scaling)
    return 1.0


def rope_cos_sin(positions: Array, inv_freq: np.ndarray,
                 scale: float = 1.0) -> tuple[Array, Array]:
    """cos, sin [B, T, head_dim] (the two halves repeated, HF rotate-half layout), float32,
    times `scale` (`rope_attention_scale`; HF multiplies after cos/sin, in float32)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    if scale == 1.0:
        return jnp.cos(emb), jnp.sin(emb)
    return jnp.cos(emb) * scale, jnp.sin(emb) * scale


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """x [B, T, H, D] rotated: x·cos + rotate_half(x)·sin, rotate_half(x) = (-x2, x1)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin


# ---- masks ---------------------------------------------------------------------------------


def attention_mask(
    q_segment_ids: Array,
    q_positions: Array,
    q_slots: Array,
    kv_segment_ids: Array,
    kv_positions: Array,
    kv_slots: Array,
    sliding_window: int | None,
) -> Array:
    """Boolean [B, T, S]: key s visible to query t.

    Visible iff the key is not padding (segment id ≠ 0), in the query's segment, not later
    than the query (by slot: packed rows and caches hold keys in write order) and, with a
    sliding window, q_pos − k_pos < window (positions, so padding does not use up the window).
    """
    same = (kv_segment_ids[:, None, :] == q_segment_ids[:, :, None]) & (
        kv_segment_ids[:, None, :] != 0
    )
    causal = kv_slots[None, None, :] <= q_slots[None, :, None]
    mask = same & causal
    if sliding_window is not None:
        mask &= (q_positions[:, :, None] - kv_positions[:, None, :]) < sliding_window
    return mask


# ---- attention and MLP ---------------------------------------------------------------------


def dense(x: Array, w: Array, in_dims: int = 1) -> Array:
    """x [..., *w.shape[:in_dims]] contracted with w -> [..., *w.shape[in_dims:]].

    Computed as one 2-D matmul [rows, in] @ [in, out] with the reshapes around it (free in
    row-major layout). Why: for a 3-D einsum ("btd,df->btf") XLA's CPU backend materialises
    transposed copies of the output gradient for the weight gradient; the 2-D form lets
    dW = xᵀ·dy run as one dot contracting the row axis (measured: SwiGLU MLP fwd+bwd at the
    SmolLM2 shape 111 → 139 GFLOP/s).
    """
    in_shape, out_shape = w.shape[:in_dims], w.shape[in_dims:]
    chex.assert_equal(x.shape[x.ndim - in_dims:], in_shape)
    lead = x.shape[: x.ndim - in_dims]
    y = x.reshape(math.prod(lead), math.prod(in_shape)) @ w.reshape(
        math.prod(in_shape), math.prod(out_shape))
    return y.reshape(*lead, *out_shape)


def project(p: dict[str, Any], name: str, x: Array, config: DecoderConfig,
            in_dims: int = 1) -> Array:
    """x through the weight `p[name]` (compute dtype), plus its LoRA update when the weight
    has an adapter (`models.lora`)."""
    dt = config.compute_jnp_dtype
    y = dense(x.astype(dt), p[name].astype(dt), in_dims)
    adapter = p.get(name + ADAPTER_SUFFIX)
    if adapter is not None:
        y = y + lora_delta(adapter, x, in_dims=in_dims, scale=config.lora.scale, dtype=dt)
    return y


def fuse_projections(p: dict[str, Any]) -> dict[str, Any]:
    """One layer's pure params (or a layer stack's) with q/k/v concatenated by heads into
    `attn.qkv` [d, Hq+2·Hkv, D] and gate/up by columns into `mlp.gate_up` [d, 2F].

    For decoding: a step of a batch of B rows then runs two wide matmuls instead of five
    narrow ones (SmolLM2-135M, B = 32, 2 CPU cores: q/k/v 0.34 → 0.25 ms, gate/up 1.20 →
    1.05 ms per layer). Same products, same values. Layers with LoRA adapters are returned
    unchanged (their weights are not a single matrix).
    """
    attn, mlp_p = p["attn"], p["mlp"]
    if any(key.endswith(ADAPTER_SUFFIX) for key in (*attn, *mlp_p)):
        return p
    fused_attn = {k: w for k, w in attn.items() if k not in ("q", "k", "v")}
    fused_attn["qkv"] = jnp.concatenate([attn["q"], attn["k"], attn["v"]], axis=-2)
    if "router" in mlp_p:  # a mixture of experts (models/moe.py): its experts stay apart
        return dict(p, attn=fused_attn)
    fused_mlp = {k: w for k, w in mlp_p.items() if k not in ("gate", "up")}
    fused_mlp["gate_up"] = jnp.concatenate([mlp_p["gate"], mlp_p["up"]], axis=-1)
    return dict(p, attn=fused_attn, mlp=fused_mlp)


def softcap(x: Array, cap: float | None) -> Array:
    """cap · tanh(x / cap) (Gemma 2 logit soft-capping); identity when cap is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def dot_product_attention(
    q: Array, k: Array, v: Array, mask: Array, *, scale: float, logit_softcap: float | None
) -> Array:
    """Grouped-query attention. q [B,T,Hq,D], k/v [B,S,Hkv,D], mask [B,T,S] -> [B,T,Hq,D].

    Logits and softmax in float32; the weighted sum in the value dtype. Both products are
    batched over (B, Hkv) with the G query heads of a group stacked as G·T rows, so each is a
    plain batched matmul with the batch axes leading: XLA's CPU backend then inserts no
    layout copies around them (fwd+bwd of one SmolLM2-shape layer: 84 → 65 ms).
    """
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, Hkv, S, D]
    logits = jnp.einsum("bkqd,bksd->bkqs", _group_queries(q, hkv), kh,
                        preferred_element_type=jnp.float32)
    probs = _masked_probs(logits, mask, t, scale, logit_softcap, v.dtype)
    return _ungroup(jnp.einsum("bkqs,bksd->bkqd", probs, vh), t)


def cached_attention(
    q: Array, keys_t: Array, values: Array, mask: Array, *, scale: float,
    logit_softcap: float | None,
) -> Array:
    """`dot_product_attention` on the KV cache's layout: keys_t [B,Hkv,D,S] (transposed) and
    values [B,Hkv,S,D]. Both products are then plain (non-transposed) batched matmuls and no
    cache slice is copied into another layout: per decode step of SmolLM2-135M at batch 32 on
    2 CPU cores the score product took 0.38 ms per layer with [B,Hkv,S,D] keys, 0.16 ms here.
    """
    t = q.shape[1]
    logits = jnp.einsum("bkqd,bkds->bkqs", _group_queries(q, keys_t.shape[1]), keys_t,
                        preferred_element_type=jnp.float32)
    probs = _masked_probs(logits, mask, t, scale, logit_softcap, values.dtype)
    return _ungroup(jnp.einsum("bkqs,bksd->bkqd", probs, values), t)


def _group_queries(q: Array, hkv: int) -> Array:
    """q [B,T,Hq,D] -> [B,Hkv,G·T,D]: the G query heads sharing a KV head stacked as rows."""
    b, t, hq, d = q.shape
    g = hq // hkv
    return q.reshape(b, t, hkv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)


def _masked_probs(logits: Array, mask: Array, t: int, scale: float,
                  logit_softcap: float | None, dtype: Any) -> Array:
    """Scaled, soft-capped, masked float32 softmax of grouped logits [B,Hkv,G·T,S]."""
    b, hkv, gt, s = logits.shape
    logits = softcap(logits.reshape(b, hkv, gt // t, t, s) * scale, logit_softcap)
    logits = jnp.where(mask[:, None, None, :, :], logits, MASK_VALUE)
    return jax.nn.softmax(logits, axis=-1).astype(dtype).reshape(b, hkv, gt, s)


def _ungroup(out: Array, t: int) -> Array:
    """[B,Hkv,G·T,D] -> [B,T,Hq,D] (inverse of `_group_queries`)."""
    b, hkv, gt, d = out.shape
    g = gt // t
    return out.reshape(b, hkv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, hkv * g, d)


class Attention(nnx.Module):
    """Attention parameters: GQA projections, optional q/k/v(/o) bias, Qwen3 q/k RMSNorm."""

    def __init__(self, config: DecoderConfig, rngs: nnx.Rngs, *, stack: int | None = None):
        c = config
        p = dict(dtype=c.param_jnp_dtype, stack=stack)
        d, hq, hkv, hd = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        self.q = make_param(rngs, (d, hq, hd), ("embed", "q_heads", "head_dim"),
                            init="normal", **p)
        self.k = make_param(rngs, (d, hkv, hd), ("embed", "kv_heads", "head_dim"),
                            init="normal", **p)
        self.v = make_param(rngs, (d, hkv, hd), ("embed", "kv_heads", "head_dim"),
                            init="normal", **p)
        self.o = make_param(rngs, (hq, hd, d), ("q_heads", "head_dim", "embed"),
                            init="normal", **p)
        if c.qkv_bias:
            self.q_bias = make_param(rngs, (hq, hd), ("q_heads", "head_dim"), init="zeros", **p)
            self.k_bias = make_param(rngs, (hkv, hd), ("kv_heads", "head_dim"), init="zeros", **p)
            self.v_bias = make_param(rngs, (hkv, hd), ("kv_heads", "head_dim"), init="zeros", **p)
        if c.o_bias:
            self.o_bias = make_param(rngs, (d,), ("embed",), init="zeros", **p)
        if c.qk_norm:
            self.q_norm = RMSNorm(hd, c, stack=stack)
            self.k_norm = RMSNorm(hd, c, stack=stack)
        if c.lora is not None:
            attach_adapters(self, "attn", c.lora, rngs, stacked=stack is not None)


def project_qkv(
    p: dict[str, Any], x: Array, cos: Array, sin: Array, config: DecoderConfig
) -> tuple[Array, Array, Array]:
    """x [B,T,d] -> RoPE-rotated q [B,T,Hq,D], rotated k and v [B,T,Hkv,D] (compute dtype).

    `p` is the pure dict of one layer's `Attention` parameters.
    """
    c = config
    dt = c.compute_jnp_dtype
    x = x.astype(dt)
    if "qkv" in p:  # `fuse_projections`: one matmul, split by heads
        q, k, v = jnp.split(project(p, "qkv", x, c),
                            [c.num_heads, c.num_heads + c.num_kv_heads], axis=-2)
    else:
        q, k, v = (project(p, name, x, c) for name in ("q", "k", "v"))
    if c.qkv_bias:
        q = q + p["q_bias"].astype(dt)
        k = k + p["k_bias"].astype(dt)
        v = v + p["v_bias"].astype(dt)
    if c.qk_norm:
        q = rms_norm(q, p["q_norm"]["scale"], eps=c.rms_norm_eps, gemma=c.is_gemma)
        k = rms_norm(k, p["k_norm"]["scale"], eps=c.rms_norm_eps, gemma=c.is_gemma)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def project_out(p: dict[str, Any], attn: Array, config: DecoderConfig) -> Array:
    """Attention output [B,T,Hq,D] -> [B,T,d] through o (and its bias)."""
    dt = config.compute_jnp_dtype
    out = project(p, "o", attn, config, in_dims=2)
    if config.o_bias:
        out = out + p["o_bias"].astype(dt)
    return out


class MLP(nnx.Module):
    """Gated MLP parameters: gate/up [d, F] ("embed", "mlp"), down [F, d]."""

    def __init__(self, config: DecoderConfig, rngs: nnx.Rngs, *, stack: int | None = None):
        c = config
        p = dict(dtype=c.param_jnp_dtype, stack=stack, init="normal")
        self.gate = make_param(rngs, (c.hidden_size, c.intermediate_size), ("embed", "mlp"), **p)
        self.up = make_param(rngs, (c.hidden_size, c.intermediate_size), ("embed", "mlp"), **p)
        self.down = make_param(rngs, (c.intermediate_size, c.hidden_size), ("mlp", "embed"), **p)
        if c.lora is not None:
            attach_adapters(self, "mlp", c.lora, rngs, stacked=stack is not None)


def mlp(p: dict[str, Any], x: Array, config: DecoderConfig) -> Array:
    """down(act(gate(x)) · up(x)); act = SiLU (SwiGLU) or tanh-GELU (Gemma's GeGLU)."""
    dt = config.compute_jnp_dtype
    x = x.astype(dt)
    act: Callable[[Array], Array] = (
        jax.nn.silu if config.hidden_act == "silu"
        else lambda h: jax.nn.gelu(h, approximate=True)
    )
    if "gate_up" in p:  # `fuse_projections`: one matmul, split in halves
        gate, up = jnp.split(project(p, "gate_up", x, config), 2, axis=-1)
    else:
        gate, up = project(p, "gate", x, config), project(p, "up", x, config)
    h = act(gate) * up
    return project(p, "down", h, config)
