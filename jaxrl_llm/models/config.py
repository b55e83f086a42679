"""`DecoderConfig`: the one architecture description shared by every decoder family.

Llama, Mistral, Qwen2, Qwen3, SmolLM2 (a Llama) and Gemma 2 differ only in a handful of flags
(biases, q/k norms, sliding windows, soft-caps, norm style, activation), so one frozen
dataclass describes them all; the mixture-of-experts families (Qwen3-MoE, Mixtral, Qwen2-MoE)
add the expert fields (`num_experts` > 0: every layer's MLP is routed, models/moe.py). `from_hf` / `to_hf` translate a Hugging Face `config.json`
dict in both directions; anything we do not implement is an error naming the field, never a
silently different model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax.core import FrozenDict

from jaxrl_llm.models.hf_config import (  # noqa: F401 (re-exported: the HF tables, the error)
    ARCHITECTURES,
    FAMILIES,
    MOE_FAMILIES,
    SUPPORTED_ROPE_TYPES,
    UnsupportedConfigError,
    fields_from_hf,
    hf_config_dict,
)

Family = Literal["llama", "mistral", "qwen2", "qwen3", "gemma2", "qwen3_moe", "mixtral",
                 "qwen2_moe"]
RematPolicy = Literal["none", "full", "dots", "dots_no_batch"]

LAYER_TYPES: tuple[str, ...] = ("full_attention", "sliding_attention")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
PARAM_DTYPES: tuple[str, ...] = tuple(_DTYPES)  # what parameters and activations may be


def resolve_compute_dtype(name: str, platform: str | None = None) -> str:
    """`model.compute_dtype` / `model.param_dtype`: "auto" is bfloat16 on accelerators (TPU,
    GPU), float32 on CPU (where bf16 matmuls are slower than fp32)."""
    if name != "auto":
        return name

    platform = platform or jax.default_backend()
    return "float32" if platform == "cpu" else "bfloat16"


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


def _check_yarn(scaling: dict[str, Any], max_position_embeddings: int) -> None:
    """YaRN's numbers, in place: a null `factor` is max_position_embeddings /
    original_max_position_embeddings (as transformers); each must be a positive number."""
    if scaling["factor"] is None:
        scaling["factor"] = max_position_embeddings / scaling["original_max_position_embeddings"]
    for key in ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
                "beta_slow", "mscale", "mscale_all_dim"):
        value = scaling.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or value < 0):
            raise UnsupportedConfigError(
                f"rope_scaling of rope_type='yarn' field {key}={value!r} must be a "
                "non-negative number")
    if scaling["factor"] < 1 or scaling["original_max_position_embeddings"] < 1:
        raise UnsupportedConfigError(
            f"rope_scaling of rope_type='yarn' needs factor >= 1 and "
            f"original_max_position_embeddings >= 1 (got factor={scaling['factor']!r}, "
            f"original_max_position_embeddings={scaling['original_max_position_embeddings']!r})")


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
    # How scanned layers decode (models/kv_cache.py `stacked_decode`): auto | unrolled | scanned.
    decode_layers: str = "auto"
    # Attention kernel (models/attention.py): auto | jnp | xla | cudnn | splash | ring.
    attention: str = "auto"
    # LoRA adapters (`models.lora.LoraSpec`; set by `models.lora.add_lora`); None = none.
    lora: Any = None
    # Token ids carried through HF import/export (config.json and generation_config.json).
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    # ---- mixture of experts (models/moe.py); num_experts = 0: a dense MLP ----
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k experts per token
    moe_intermediate_size: int | None = None  # each expert's MLP width
    # Qwen3-MoE/Qwen2-MoE: renormalise the top-k probabilities to sum to 1 (Mixtral: always)
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert
    # Coefficients of the load-balancing loss (Switch, arXiv:2101.03961 eq. 4) and of the
    # router z-loss (ST-MoE, arXiv:2202.08906 eq. 5) added to the train loss.
    router_aux_loss_coef: float = 0.001
    router_z_loss_coef: float = 0.0
    # How tokens reach experts sharded over a mesh's "expert" axis (models/moe_parallel.py).
    moe_dispatch: str = "all_gather"

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
        if self.attention not in ("auto", "jnp", "xla", "cudnn", "splash", "ring"):
            raise UnsupportedConfigError(
                f"attention={self.attention!r} is not one of 'auto', 'jnp', 'xla', 'cudnn', "
                "'splash', 'ring'"
            )
        if self.decode_layers not in ("auto", "unrolled", "scanned"):
            raise UnsupportedConfigError(
                f"decode_layers={self.decode_layers!r} is not one of 'auto', 'unrolled', "
                "'scanned'")
        if self.decode_layers == "scanned" and not self.scan_layers:
            raise UnsupportedConfigError(
                "decode_layers='scanned' needs scan_layers=True (the layer weights stacked)")
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
                        "yarn": ("factor", "original_max_position_embeddings"),
                        "linear": ("factor",), "default": ()}[rope_type]
            for key in required:
                if key not in scaling:
                    raise UnsupportedConfigError(
                        f"rope_scaling of rope_type={rope_type!r} needs field {key!r}"
                    )
            if rope_type == "yarn":
                _check_yarn(scaling, self.max_position_embeddings)
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
        self._check_moe()

    def _check_moe(self) -> None:
        """The expert fields: set for the MoE families (`MOE_FAMILIES`), unset otherwise."""
        e, k = self.num_experts, self.num_experts_per_tok
        if self.family not in MOE_FAMILIES:
            if e or k or self.shared_expert_intermediate_size:
                raise UnsupportedConfigError(
                    f"num_experts={e} / num_experts_per_tok={k} are set but family="
                    f"{self.family!r} is dense; the mixture-of-experts families are "
                    f"{MOE_FAMILIES}")
            return
        if e < 1:
            raise UnsupportedConfigError(f"family={self.family!r} needs num_experts >= 1 "
                                         f"(got {e})")
        if not 1 <= k <= e:
            raise UnsupportedConfigError(
                f"num_experts_per_tok={k} (top-k) must be between 1 and num_experts={e}")
        if self.moe_intermediate_size is None:
            object.__setattr__(self, "moe_intermediate_size", self.intermediate_size)
        if self.moe_intermediate_size < 1:
            raise UnsupportedConfigError(
                f"moe_intermediate_size={self.moe_intermediate_size} must be >= 1")
        if self.family == "mixtral" and not self.norm_topk_prob:
            raise UnsupportedConfigError("family='mixtral' always renormalises its top-k "
                                         "probabilities: norm_topk_prob must be true")
        if (self.shared_expert_intermediate_size > 0) != (self.family == "qwen2_moe"):
            raise UnsupportedConfigError(
                f"shared_expert_intermediate_size={self.shared_expert_intermediate_size}: a "
                "shared expert is what family='qwen2_moe' has (> 0), and only it")
        if self.router_aux_loss_coef < 0 or self.router_z_loss_coef < 0:
            raise UnsupportedConfigError(
                f"router_aux_loss_coef={self.router_aux_loss_coef} and router_z_loss_coef="
                f"{self.router_z_loss_coef} must be >= 0")
        if self.moe_dispatch not in ("all_gather", "all_to_all"):
            raise UnsupportedConfigError(
                f"moe_dispatch={self.moe_dispatch!r} is not one of 'all_gather', 'all_to_all'")

    # ---- derived properties -------------------------------------------------------------
    @property
    def is_gemma(self) -> bool:
        """Gemma 2 style: (1+w) RMSNorm, post-norms, sqrt(d)-scaled embeddings."""
        return self.family == "gemma2"

    @property
    def is_moe(self) -> bool:
        """Every layer's MLP is a routed mixture of experts (models/moe.py)."""
        return self.num_experts > 0

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

    # ---- Hugging Face config.json (models/hf_config.py) --------------------------------
    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], *, source: str = "config.json",
                **overrides: Any) -> DecoderConfig:
        """Build from a HF `config.json` dict; unsupported model types/fields raise, naming them.

        `overrides` set our own fields (param_dtype, compute_dtype, remat, scan_layers, ...).
        """
        fields = {**fields_from_hf(hf, source=source), **overrides}
        try:
            return cls(**fields)
        except UnsupportedConfigError as err:
            raise UnsupportedConfigError(f"{source}: {err}") from None

    def to_hf(self, *, dtype: str | None = None) -> dict[str, Any]:
        """The HF `config.json` dict for this architecture (transformers 5 and legacy keys)."""
        return hf_config_dict(self, dtype=dtype)
