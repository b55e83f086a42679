"""`DecoderConfig`: the one architecture description shared by every decoder family.

Llama, Mistral, Qwen2, Qwen3, SmolLM2 (a Llama) and Gemma 2 differ only in a handful of flags
(biases, q/k norms, sliding windows, soft-caps, norm style, activation), so one frozen
dataclass describes them all. `from_hf` / `to_hf` translate a Hugging Face `config.json`
dict in both directions; anything we do not implement is an error naming the field, never a
silently different model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal

import jax.numpy as jnp
from flax.core import FrozenDict

from jaxrl_llm.errors import ModelFileError

Family = Literal["llama", "mistral", "qwen2", "qwen3", "gemma2"]
RematPolicy = Literal["none", "full", "dots", "dots_no_batch"]

FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "gemma2")
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
}
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "llama3", "linear")
LAYER_TYPES: tuple[str, ...] = ("full_attention", "sliding_attention")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
PARAM_DTYPES: tuple[str, ...] = tuple(_DTYPES)  # what parameters and activations may be

# HF config keys we read, per family (everything else is either harmless metadata we ignore
# or in `_REJECT_IF_SET`).
_REJECT_IF_SET: dict[str, Any] = {
    # key: the only value we support (anything else changes the math and is an error)
    "mlp_bias": False,
    "use_sliding_window": False,
    "use_bidirectional_attention": None,
    "quantization_config": None,
    "partial_rotary_factor": 1.0,
    "rope_interleaved": False,  # SmolLM2 configs say false; true would be GPT-J style RoPE
}


def resolve_compute_dtype(name: str, platform: str | None = None) -> str:
    """`model.compute_dtype` / `model.param_dtype`: "auto" is bfloat16 on accelerators (TPU,
    GPU), float32 on CPU (where bf16 matmuls are slower than fp32)."""
    if name != "auto":
        return name
    import jax

    platform = platform or jax.default_backend()
    return "float32" if platform == "cpu" else "bfloat16"


class UnsupportedConfigError(ModelFileError):
    """A Hugging Face config (or field value) this decoder does not implement."""


def dtype_name(value: Any, *, field: str = "dtype",
               choices: tuple[str, ...] = PARAM_DTYPES) -> str:
    """The name ("float32", "bfloat16", ...) of a dtype given as a string, a numpy/JAX scalar
    type (`jnp.float32`, `np.float16`) or a `np.dtype`; refused, naming `field` and listing
    `choices`, when it is none of them. Every public `dtype=` argument goes through here."""
    try:
        name = value if isinstance(value, str) else jnp.dtype(value).name
    except (TypeError, ValueError):
        name = None
    if name not in choices:
        raise UnsupportedConfigError(
            f"{field}={value!r} is not a supported dtype: use one of {list(choices)} "
            "(as a string, or the numpy/JAX type such as jnp.bfloat16)"
        )
    return name


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Architecture and numerics of one decoder (see module docstring).

    `layer_types[i]` is "full_attention" or "sliding_attention" (the latter uses
    `sliding_window`: a query at position p sees keys at positions p - sliding_window < q ≤ p,
    as in HF). When `layer_types` is None every layer is sliding iff `sliding_window` is set
    (Mistral); it is normalised to a tuple in `__post_init__`.
    """

    family: Family = "llama"
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None
    rope_theta: float = 10_000.0
    rope_scaling: Mapping[str, Any] | None = None
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    max_position_embeddings: int = 2048
    hidden_act: Literal["silu", "gelu_tanh"] = "silu"
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: RematPolicy = "none"
    scan_layers: bool = False
    # Attention kernel (models/attention.py): auto | jnp | xla | cudnn | splash.
    attention: str = "auto"
    # LoRA adapters (`models.lora.LoraSpec`; set by `models.lora.add_lora`); None = none.
    lora: Any = None
    # Token ids carried through HF import/export (config.json and generation_config.json).
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)
        if self.family not in FAMILIES:
            raise UnsupportedConfigError(f"family={self.family!r} is not one of {FAMILIES}")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise UnsupportedConfigError(
                    f"hidden_size={self.hidden_size} is not divisible by num_heads="
                    f"{self.num_heads}; set head_dim"
                )
            set_("head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedConfigError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads="
                f"{self.num_kv_heads} (grouped-query attention)"
            )
        if self.head_dim % 2:
            raise UnsupportedConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        set_("param_dtype", dtype_name(self.param_dtype, field="param_dtype"))
        set_("compute_dtype", dtype_name(self.compute_dtype, field="compute_dtype"))
        if self.remat not in ("none", "full", "dots", "dots_no_batch"):
            raise UnsupportedConfigError(
                f"remat={self.remat!r} is not one of 'none', 'full', 'dots', 'dots_no_batch'"
            )
        if self.attention not in ("auto", "jnp", "xla", "cudnn", "splash"):
            raise UnsupportedConfigError(
                f"attention={self.attention!r} is not one of 'auto', 'jnp', 'xla', 'cudnn', "
                "'splash'"
            )
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise UnsupportedConfigError(f"hidden_act={self.hidden_act!r} is not supported")
        if self.rope_scaling is not None:
            scaling = dict(self.rope_scaling)
            rope_type = scaling.get("rope_type", scaling.get("type"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise UnsupportedConfigError(
                    f"rope_scaling rope_type={rope_type!r} is not supported "
                    f"(supported: {SUPPORTED_ROPE_TYPES})"
                )
            scaling["rope_type"] = rope_type
            scaling.pop("type", None)
            scaling.pop("rope_theta", None)
            required = {"llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                   "original_max_position_embeddings"),
                        "linear": ("factor",), "default": ()}[rope_type]
            for key in required:
                if key not in scaling:
                    raise UnsupportedConfigError(
                        f"rope_scaling of rope_type={rope_type!r} needs field {key!r}"
                    )
            set_("rope_scaling", None if rope_type == "default" else FrozenDict(scaling))
        if self.layer_types is None:
            kind = "sliding_attention" if self.sliding_window else "full_attention"
            set_("layer_types", (kind,) * self.num_layers)
        else:
            set_("layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_layers:
            raise UnsupportedConfigError(
                f"layer_types has {len(self.layer_types)} entries, num_layers={self.num_layers}"
            )
        for kind in self.layer_types:
            if kind not in LAYER_TYPES:
                raise UnsupportedConfigError(f"layer_types entry {kind!r} is not in {LAYER_TYPES}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise UnsupportedConfigError("layer_types has sliding_attention but no sliding_window")
        if isinstance(self.eos_token_id, list):
            set_("eos_token_id", tuple(self.eos_token_id))

    # ---- derived properties -------------------------------------------------------------
    @property
    def is_gemma(self) -> bool:
        """Gemma 2 style: (1+w) RMSNorm, post-norms, sqrt(d)-scaled embeddings."""
        return self.family == "gemma2"

    @property
    def param_jnp_dtype(self) -> Any:
        return _DTYPES[self.param_dtype]

    @property
    def compute_jnp_dtype(self) -> Any:
        return _DTYPES[self.compute_dtype]

    @property
    def attn_scale(self) -> float:
        """Query scaling: 1/sqrt(query_pre_attn_scalar) (Gemma 2) else 1/sqrt(head_dim)."""
        return 1.0 / math.sqrt(self.query_pre_attn_scalar or self.head_dim)

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        return tuple(kind == "sliding_attention" for kind in self.layer_types)

    def replace(self, **changes: Any) -> DecoderConfig:
        return dataclasses.replace(self, **changes)

    # ---- Hugging Face config.json -------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], *, source: str = "config.json",
                **overrides: Any) -> DecoderConfig:
        """Build from a HF `config.json` dict; unsupported model types/fields raise, naming them.

        `overrides` set our own fields (param_dtype, compute_dtype, remat, scan_layers, ...).
        """
        def fail(msg: str) -> UnsupportedConfigError:
            return UnsupportedConfigError(f"{source}: {msg}")

        model_type = hf.get("model_type")
        if model_type not in FAMILIES:
            raise fail(f"model_type={model_type!r} is not supported (supported: {FAMILIES})")
        archs = hf.get("architectures") or [ARCHITECTURES[model_type]]
        for arch in archs:
            if arch != ARCHITECTURES[model_type]:
                raise fail(
                    f"architectures entry {arch!r} is not supported for model_type "
                    f"{model_type!r} (expected {ARCHITECTURES[model_type]!r})"
                )
        for key, allowed in _REJECT_IF_SET.items():
            value = hf.get(key, allowed)
            if value != allowed and not (allowed is None and value is False):
                raise fail(f"field {key}={value!r} is not supported (only {allowed!r})")
        act_key = "hidden_activation" if model_type == "gemma2" else "hidden_act"
        act = hf.get(act_key) or hf.get("hidden_act")
        expected_act = "gelu_pytorch_tanh" if model_type == "gemma2" else "silu"
        if act is not None and act != expected_act:
            raise fail(f"field {act_key}={act!r} is not supported for {model_type} "
                       f"(only {expected_act!r})")

        rope = dict(hf.get("rope_parameters") or {})
        legacy = dict(hf.get("rope_scaling") or {})
        if legacy:  # as transformers reads a file with both: the legacy rope_scaling wins
            if "type" in legacy:
                legacy.setdefault("rope_type", legacy.pop("type"))
            rope = {**rope, **legacy}
        theta = rope.pop("rope_theta", hf.get("rope_theta", 10_000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise fail(f"rope_scaling rope_type={rope_type!r} is not supported "
                       f"(supported: {SUPPORTED_ROPE_TYPES})")
        if rope.pop("partial_rotary_factor", 1.0) not in (1, 1.0, None):
            raise fail("rope_parameters partial_rotary_factor != 1 is not supported")
        rope_scaling = None if rope_type == "default" else rope

        attention_bias = bool(hf.get("attention_bias", False))
        qkv_bias = model_type == "qwen2" or attention_bias
        o_bias = attention_bias and model_type != "qwen2"
        sliding_window = hf.get("sliding_window")
        layer_types = hf.get("layer_types")
        if model_type in ("qwen2", "qwen3", "llama"):
            # Qwen configs always carry a sliding_window value, used only with
            # use_sliding_window=True (rejected above); Llama has none.
            sliding_window = None
            if layer_types and any(k != "full_attention" for k in layer_types):
                raise fail(f"layer_types={layer_types!r}: only full_attention is supported "
                           f"for {model_type}")
            layer_types = None
        elif model_type == "mistral":
            layer_types = None
        elif model_type == "gemma2" and layer_types is None:
            # HF's Gemma 2 default: even layers local (sliding), odd layers global.
            layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                           for i in range(hf["num_hidden_layers"])]
        gemma = model_type == "gemma2"
        fields: dict[str, Any] = dict(
            family=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim"),
            rope_theta=float(theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=model_type == "qwen3",
            sliding_window=sliding_window,
            layer_types=tuple(layer_types) if layer_types else None,
            attn_logit_softcap=hf.get("attn_logit_softcapping") if gemma else None,
            final_logit_softcap=hf.get("final_logit_softcapping") if gemma else None,
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar") if gemma else None,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            hidden_act="gelu_tanh" if gemma else "silu",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
        )
        fields.update(overrides)
        try:
            return cls(**fields)
        except UnsupportedConfigError as err:
            raise fail(str(err)) from None

    def to_hf(self, *, dtype: str | None = None) -> dict[str, Any]:
        """The HF `config.json` dict for this architecture (transformers 5 and legacy keys)."""
        rope_parameters: dict[str, Any] = {"rope_type": "default"}
        if self.rope_scaling is not None:
            rope_parameters = dict(self.rope_scaling)
        rope_parameters["rope_theta"] = self.rope_theta
        legacy_scaling = None
        if self.rope_scaling is not None:
            legacy_scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
        hf: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.family]],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": legacy_scaling,
            "rope_parameters": rope_parameters,
            "tie_word_embeddings": self.tie_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple)
            else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "dtype": dtype or self.param_dtype,
            # transformers 4.x (and vLLM builds on it) read the older key.
            "torch_dtype": dtype or self.param_dtype,
            "use_cache": True,
        }
        if self.family == "gemma2":
            hf.update(
                hidden_activation="gelu_pytorch_tanh",
                hidden_act="gelu_pytorch_tanh",
                attention_bias=self.qkv_bias,
                query_pre_attn_scalar=self.query_pre_attn_scalar or self.head_dim,
                sliding_window=self.sliding_window,
                layer_types=list(self.layer_types),
                attn_logit_softcapping=self.attn_logit_softcap,
                final_logit_softcapping=self.final_logit_softcap,
            )
        else:
            hf["hidden_act"] = "silu"
            if self.family in ("llama", "qwen3"):
                hf["attention_bias"] = self.qkv_bias
            if self.family == "llama":
                hf["mlp_bias"] = False
            if self.family == "mistral":
                hf["sliding_window"] = self.sliding_window
            if self.family in ("qwen2", "qwen3"):
                hf.update(use_sliding_window=False, sliding_window=None,
                          max_window_layers=self.num_layers,
                          layer_types=["full_attention"] * self.num_layers)
        return hf

    @classmethod
    def from_model_config(cls, model: Any) -> DecoderConfig:
        """A random-init config from the `model:` section (`jaxrl_llm.config.ModelConfig`)."""
        return cls(
            family=model.family,
            vocab_size=model.vocab_size,
            hidden_size=model.hidden_size,
            intermediate_size=model.intermediate_size,
            num_layers=model.num_layers,
            num_heads=model.num_heads,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            rope_theta=model.rope_theta,
            rms_norm_eps=model.rms_norm_eps,
            tie_embeddings=model.tie_embeddings,
            qkv_bias=model.family == "qwen2",
            qk_norm=model.family == "qwen3",
            sliding_window=model.sliding_window,
            layer_types=(
                tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                      for i in range(model.num_layers))
                if model.family == "gemma2" and model.sliding_window else None
            ),
            attn_logit_softcap=50.0 if model.family == "gemma2" else None,
            final_logit_softcap=30.0 if model.family == "gemma2" else None,
            query_pre_attn_scalar=None,
            max_position_embeddings=model.max_position_embeddings,
            hidden_act="gelu_tanh" if model.family == "gemma2" else "silu",
            param_dtype=resolve_compute_dtype(model.param_dtype),
            compute_dtype=resolve_compute_dtype(model.compute_dtype),
            remat=model.remat,
            scan_layers=model.scan_layers,
            attention=getattr(model, "attention", "auto"),
        )
