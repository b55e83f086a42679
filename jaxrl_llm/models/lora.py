"""LoRA adapters on the decoder's projections (LoRA, arXiv:2106.09685 eq. 3 and §4.1).

A targeted weight W [*in, *out] (our layout, `layers.py`) gets a low-rank update
    y = x·W + (α/r) · (x·A)·B,    A [*in, r],  B [r, *out],
held as flax's `nnx.LoRAParam` variables (a subclass of `nnx.Param`) in a `LoraAdapter` next
to W (`attn.q_lora.lora_a`, ...): splitting the model by `nnx.LoRAParam` gives the adapters
(trained) apart from the base weights (frozen). A is initialised like PEFT's default
(kaiming-uniform with a = √5, i.e. U(−1/√fan_in, 1/√fan_in)) and B = 0, so a fresh adapter
leaves the model exactly as it was. The model's projections are raw parameters consumed by
pure functions (not `nnx.Linear`), so `nnx.LoRA` modules cannot wrap them; the adapters use
its variable type and layout (A then B) instead.

Targets use the Hugging Face / PEFT module names, so `model.lora.targets` reads like a PEFT
`target_modules` list and the adapter export (`lora_export.py`) needs no renaming.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

Array = jax.Array

# PEFT / HF module name -> (our module under a layer, our weight name, leading input dims).
LORA_TARGETS: dict[str, tuple[str, str, int]] = {
    "q_proj": ("attn", "q", 1),
    "k_proj": ("attn", "k", 1),
    "v_proj": ("attn", "v", 1),
    "o_proj": ("attn", "o", 2),
    "gate_proj": ("mlp", "gate", 1),
    "up_proj": ("mlp", "up", 1),
    "down_proj": ("mlp", "down", 1),
}
# Every linear layer of a block (QLoRA, arXiv:2305.14314 §4: adapters on all of them are
# needed to match full fine-tuning).
DEFAULT_TARGETS: tuple[str, ...] = tuple(LORA_TARGETS)
ADAPTER_SUFFIX = "_lora"  # `attn.q` -> its adapter module `attn.q_lora`


def check_targets(targets: Any, *, field: str = "model.lora.targets") -> tuple[str, ...]:
    """`targets` as a tuple of known names; a ValueError names each unknown one and lists the
    valid targets."""
    names = (targets,) if isinstance(targets, str) else tuple(targets)
    unknown = [t for t in names if t not in LORA_TARGETS]
    if unknown:
        raise ValueError(f"{field}: unknown LoRA target(s) {unknown}; valid targets: "
                         f"{list(LORA_TARGETS)}")
    if not names:
        raise ValueError(f"{field} is empty; name at least one of {list(LORA_TARGETS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"{field}={list(names)} names a target twice")
    return names


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """Rank r, scale numerator α and targeted projections (a static, hashable part of a
    `DecoderConfig`)."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self) -> None:
        if self.rank <= 0 or self.alpha <= 0:
            raise ValueError(f"LoRA rank={self.rank} and alpha={self.alpha} must be positive")
        object.__setattr__(self, "targets", check_targets(self.targets))

    @property
    def scale(self) -> float:
        """α / r (LoRA §4.1; PEFT's `scaling` without rsLoRA)."""
        return self.alpha / self.rank

    def weights_of(self, module: str) -> list[tuple[str, int]]:
        """(our weight name, input dims) targeted under `module` ("attn" or "mlp")."""
        return [(w, dims) for t, (m, w, dims) in LORA_TARGETS.items()
                if m == module and t in self.targets]


class LoraAdapter(nnx.Module):
    """A [*(L), *in, r] and B [*(L), r, *out] for one weight [*(L), *in, *out] (L: scanned
    layers); logical axes follow the weight's, the rank axis is replicated."""

    def __init__(self, weight: nnx.Param, in_dims: int, rank: int, rngs: nnx.Rngs, *,
                 stacked: bool):
        shape = tuple(weight.shape)
        axes = tuple(weight.get_metadata().get("out_sharding") or (None,) * len(shape))
        lead = 1 if stacked else 0
        in_shape, out_shape = shape[lead:lead + in_dims], shape[lead + in_dims:]
        in_axes, out_axes = axes[lead:lead + in_dims], axes[lead + in_dims:]
        bound = 1.0 / math.sqrt(math.prod(in_shape))  # kaiming_uniform(a=√5), PEFT's default
        a = jax.random.uniform(rngs.params(), (*shape[:lead], *in_shape, rank), jnp.float32,
                               -bound, bound)
        self.lora_a = nnx.LoRAParam(a.astype(weight.dtype), out_sharding=(
            *axes[:lead], *_fsdp_axes(in_axes, in_shape), None))
        self.lora_b = nnx.LoRAParam(
            jnp.zeros((*shape[:lead], rank, *out_shape), weight.dtype),
            out_sharding=(*axes[:lead], None, *_fsdp_axes(out_axes, out_shape)))


def _fsdp_axes(axes: tuple[Any, ...], shape: tuple[int, ...]) -> tuple[Any, ...]:
    """Logical axes of an adapter factor's non-rank dims: the weight's, except that a factor
    without an "embed" dim (B of q/k/v/gate/up, A of o/down) has its largest dim named
    "embed", so FSDP splits it like every weight matrix instead of replicating it on every
    device (27 M of Llama-3-8B's 42 M rank-16 adapter weights; 208 MiB per v5e chip)."""
    if "embed" in axes or not axes:
        return axes
    largest = max(range(len(shape)), key=lambda i: shape[i])
    return tuple("embed" if i == largest else name for i, name in enumerate(axes))


def attach_adapters(module: nnx.Module, kind: str, spec: LoraSpec, rngs: nnx.Rngs, *,
                    stacked: bool) -> None:
    """Give each targeted weight of `module` (an `Attention` or `MLP`, kind "attn" / "mlp")
    its `LoraAdapter`, named `<weight>_lora`."""
    for name, in_dims in spec.weights_of(kind):
        adapter = LoraAdapter(getattr(module, name), in_dims, spec.rank, rngs, stacked=stacked)
        setattr(module, name + ADAPTER_SUFFIX, adapter)


def lora_delta(adapter: dict[str, Array], x: Array, *, in_dims: int, scale: float,
               dtype: Any) -> Array:
    """(α/r)·(x·A)·B for x [..., *in] -> [..., *out], from a pure adapter dict of one layer.

    Two 2-D matmuls over flattened rows (the form `layers.dense` uses); the rank-r hidden
    is tiny, so the update costs ≈ r/d of the base projection.
    """
    a, b = adapter["lora_a"].astype(dtype), adapter["lora_b"].astype(dtype)
    in_shape, rank, out_shape = a.shape[:in_dims], a.shape[-1], b.shape[1:]
    lead = x.shape[: x.ndim - in_dims]
    rows = x.astype(dtype).reshape(math.prod(lead), math.prod(in_shape))
    h = rows @ a.reshape(math.prod(in_shape), rank)
    y = (h @ b.reshape(rank, math.prod(out_shape))) * jnp.asarray(scale, dtype)
    return y.reshape(*lead, *out_shape)


def delta_weight(adapter: dict[str, Array], in_dims: int, scale: float) -> Array:
    """(α/r)·A·B in float32, shaped like the weight (a leading layer axis when stacked)."""
    a, b = adapter["lora_a"].astype(jnp.float32), adapter["lora_b"].astype(jnp.float32)
    rank = a.shape[-1]
    lead = a.shape[: a.ndim - in_dims - 1]
    in_shape, out_shape = a.shape[len(lead):-1], b.shape[len(lead) + 1:]
    a2 = a.reshape(*lead, math.prod(in_shape), rank)
    b2 = b.reshape(*lead, rank, math.prod(out_shape))
    return (jnp.matmul(a2, b2) * scale).reshape(*lead, *in_shape, *out_shape)


def has_adapters(model: Any) -> bool:
    return getattr(getattr(model, "config", None), "lora", None) is not None


def add_lora(model: Any, spec: LoraSpec, *, seed: int = 0) -> Any:
    """`model` (a `Decoder` without adapters, concrete or abstract) with fresh adapters
    attached in place and `config.lora = spec`; its own weights are untouched (no copy)."""
    c = model.config
    if c.lora is not None:
        raise ValueError("the model already has LoRA adapters")
    moe = getattr(c, "num_experts", 0) > 0
    if moe and spec.weights_of("mlp"):  # its MLP weights are [E, ...] expert stacks
        raise ValueError(
            "model.lora.targets: LoRA on a mixture-of-experts model's experts is not "
            f"supported (targets {list(spec.targets)}); set model.lora.targets to attention "
            "projections (q_proj, k_proj, v_proj, o_proj)")
    rngs = nnx.Rngs(seed)
    blocks = [model.layers] if c.scan_layers else list(model.layers)
    with nnx.use_eager_sharding(False):
        for block in blocks:
            attach_adapters(block.attn, "attn", spec, rngs, stacked=c.scan_layers)
            if not moe:
                attach_adapters(block.mlp, "mlp", spec, rngs, stacked=c.scan_layers)
    model.config = c.replace(lora=spec)
    return model


__all__ = ["ADAPTER_SUFFIX", "DEFAULT_TARGETS", "LORA_TARGETS", "LoraAdapter", "LoraSpec",
           "add_lora", "attach_adapters", "check_targets", "delta_weight", "has_adapters",
           "lora_delta"]
