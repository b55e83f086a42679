"""Hugging Face `config.json` <-> `DecoderConfig` fields, for every supported family.

The translation tables (model types, architectures, the HF fields whose other values would
change the math) and the two directions used by `DecoderConfig.from_hf` / `.to_hf`: an
unsupported model type, architecture or field value is an `UnsupportedConfigError` naming
it, never a silently different model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxrl_llm.core.errors import ModelFileError

# Mixture-of-experts families (models/moe.py): every layer's MLP is a routed set of experts.
MOE_FAMILIES: tuple[str, ...] = ("qwen3_moe", "mixtral", "qwen2_moe")
FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "gemma2", *MOE_FAMILIES)
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}
# The dense family whose attention each MoE family shares (q/k norms, biases, windows).
ATTENTION_OF: dict[str, str] = {"qwen3_moe": "qwen3", "mixtral": "mistral",
                                "qwen2_moe": "qwen2"}
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "llama3", "linear", "yarn")
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


class UnsupportedConfigError(ModelFileError):
    """A Hugging Face config (or field value) this decoder does not implement."""


def fields_from_hf(hf: Mapping[str, Any], *, source: str = "config.json") -> dict[str, Any]:
    """The `DecoderConfig` fields of a HF `config.json` dict; unsupported model types/fields
    raise, naming them and `source`."""
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
    if rope_type in ("llama3", "yarn"):  # as transformers' `standardize_rope_params`
        if "original_max_position_embeddings" in hf:  # a top-level value wins (Phi-3 style)
            rope["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
        rope.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings",
                                                                    2048))
    rope_scaling = None if rope_type == "default" else rope

    attn_family = ATTENTION_OF.get(model_type, model_type)
    attention_bias = bool(hf.get("attention_bias", False))
    qkv_bias = attention_bias or (attn_family == "qwen2" and bool(hf.get("qkv_bias", True)))
    o_bias = attention_bias and attn_family != "qwen2"
    sliding_window = hf.get("sliding_window")
    layer_types = hf.get("layer_types")
    if attn_family in ("qwen2", "qwen3", "llama"):
        # Qwen configs always carry a sliding_window value, used only with
        # use_sliding_window=True (rejected above); Llama has none.
        sliding_window = None
        if layer_types and any(k != "full_attention" for k in layer_types):
            raise fail(f"layer_types={layer_types!r}: only full_attention is supported "
                       f"for {model_type}")
        layer_types = None
    elif attn_family == "mistral":
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
        qk_norm=attn_family == "qwen3",
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
    if model_type in MOE_FAMILIES:
        fields.update(moe_fields_from_hf(hf, model_type, fail))
    return fields


def moe_fields_from_hf(hf: Mapping[str, Any], model_type: str,
                       fail: Any) -> dict[str, Any]:
    """The mixture-of-experts fields of a MoE family's config.json (`MOE_FAMILIES`)."""
    # Qwen3-MoE's hub files say num_experts, transformers 5 writes num_local_experts.
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if experts is None:
        raise fail(f"model_type={model_type!r} needs num_experts (or num_local_experts)")
    if model_type != "mixtral":
        # Dense MLP layers between the MoE ones: not implemented (every layer is MoE here).
        if hf.get("mlp_only_layers"):
            raise fail(f"field mlp_only_layers={hf['mlp_only_layers']!r} is not supported "
                       "(only [] : every layer a mixture of experts)")
        if hf.get("decoder_sparse_step", 1) != 1:
            raise fail(f"field decoder_sparse_step={hf['decoder_sparse_step']!r} is not "
                       "supported (only 1: every layer a mixture of experts)")
    if hf.get("router_jitter_noise", 0.0):
        raise fail(f"field router_jitter_noise={hf['router_jitter_noise']!r} is not "
                   "supported (only 0.0)")
    out: dict[str, Any] = dict(
        num_experts=experts,
        num_experts_per_tok=hf.get("num_experts_per_tok", 2),
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
    )
    if model_type == "mixtral":  # each expert is intermediate_size wide; top-k always renormalised
        out.update(moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=True)
    else:
        out.update(moe_intermediate_size=hf["moe_intermediate_size"],
                   norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
    if model_type == "qwen2_moe":
        out["shared_expert_intermediate_size"] = hf["shared_expert_intermediate_size"]
    return out


def hf_config_dict(config: Any, *, dtype: str | None = None) -> dict[str, Any]:
    """The HF `config.json` dict of a `DecoderConfig` (transformers 5 and legacy keys)."""
    rope_parameters: dict[str, Any] = {"rope_type": "default"}
    if config.rope_scaling is not None:
        rope_parameters = dict(config.rope_scaling)
    rope_parameters["rope_theta"] = config.rope_theta
    legacy_scaling = None
    if config.rope_scaling is not None:
        legacy_scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    hf: dict[str, Any] = {
        "architectures": [ARCHITECTURES[config.family]],
        "model_type": config.family,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": legacy_scaling,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": config.tie_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_id) if isinstance(config.eos_token_id, tuple)
        else config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "dtype": dtype or config.param_dtype,
        # transformers 4.x (and vLLM builds on it) read the older key.
        "torch_dtype": dtype or config.param_dtype,
        "use_cache": True,
    }
    if config.family == "gemma2":
        hf.update(
            hidden_activation="gelu_pytorch_tanh",
            hidden_act="gelu_pytorch_tanh",
            attention_bias=config.qkv_bias,
            query_pre_attn_scalar=config.query_pre_attn_scalar or config.head_dim,
            sliding_window=config.sliding_window,
            layer_types=list(config.layer_types),
            attn_logit_softcapping=config.attn_logit_softcap,
            final_logit_softcapping=config.final_logit_softcap,
        )
    else:
        hf["hidden_act"] = "silu"
        attn_family = ATTENTION_OF.get(config.family, config.family)
        if attn_family in ("llama", "qwen3"):
            hf["attention_bias"] = config.qkv_bias
        if config.family == "llama":
            hf["mlp_bias"] = False
        if attn_family == "mistral":
            hf["sliding_window"] = config.sliding_window
        if attn_family in ("qwen2", "qwen3"):
            hf.update(use_sliding_window=False, sliding_window=None,
                      max_window_layers=config.num_layers,
                      layer_types=["full_attention"] * config.num_layers)
    if config.family in MOE_FAMILIES:
        hf.update(num_experts_per_tok=config.num_experts_per_tok,
                  router_aux_loss_coef=config.router_aux_loss_coef,
                  output_router_logits=False)
        if config.family == "mixtral":
            hf.update(num_local_experts=config.num_experts,
                      intermediate_size=config.moe_intermediate_size, router_jitter_noise=0.0)
        else:
            hf.update(num_experts=config.num_experts,
                      moe_intermediate_size=config.moe_intermediate_size,
                      norm_topk_prob=config.norm_topk_prob, decoder_sparse_step=1,
                      mlp_only_layers=[])
        if config.family == "qwen2_moe":
            hf.update(qkv_bias=config.qkv_bias,
                      shared_expert_intermediate_size=config.shared_expert_intermediate_size)
    return hf
