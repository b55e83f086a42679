"""The `model:` section (read by the opener and the weights loader: policy/, weights/)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import (
    Field,
    model_validator,
)

from jaxrl_llm.config.base import Section


class LoraConfig(Section):
    """LoRA adapters (models/lora.py; LoRA arXiv:2106.09685): only they are trained, the base
    weights stay frozen, and the reference policy is the base (adapters off)."""

    rank: int = Field(8, gt=0)  # r, the adapters' inner width
    alpha: float = Field(16.0, gt=0)  # the update is scaled by alpha / rank
    # PEFT / HF module names (models.lora.LORA_TARGETS); default: every linear layer.
    targets: list[Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                          "down_proj"]] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                 "up_proj", "down_proj"], min_length=1)


class ModelConfig(Section):
    """Which decoder to train, and its numerics (models/)."""

    # where the weights come from: random init, an HF directory or Hub id, a GGUF file, or the
    # packaged SmolLM2-135M-Instruct GGUF (docs/integrations.md)
    source: Literal["random", "hf", "gguf", "smollm2"] = "random"
    path: str | None = Field(None, description="HF directory or GGUF file for source hf/gguf, "
                             "or a Hugging Face Hub id (org/name) for source hf")
    revision: str | None = Field(None, description="hub revision (branch, tag, commit) of a hub id")
    # random models: the decoder family (pretrained sources read theirs); qwen3_moe, mixtral
    # and qwen2_moe are mixtures of experts (models/moe.py: set num_experts and its keys)
    family: Literal["llama", "mistral", "qwen2", "qwen3", "gemma2", "qwen3_moe", "mixtral",
                    "qwen2_moe"] = "llama"
    # Architecture of a random-init model (ignored when loading weights, which carry their own).
    vocab_size: int = Field(512, gt=0)  # random models: vocabulary size
    hidden_size: int = Field(128, gt=0)  # random models: hidden width d
    intermediate_size: int = Field(384, gt=0)  # random models: MLP width
    num_layers: int = Field(2, gt=0)  # random models: decoder layers
    num_heads: int = Field(4, gt=0)  # random models: query heads
    num_kv_heads: int = Field(2, gt=0)  # random models: key/value heads (grouped-query attention)
    # random models: per-head width; null = hidden_size / num_heads
    head_dim: int | None = Field(None, gt=0)
    # random models: the longest position RoPE is set up for
    max_position_embeddings: int = Field(2048, gt=0)
    rope_theta: float = Field(10_000.0, gt=0)  # random models: RoPE base
    rope_scaling: dict[str, Any] | None = Field(
        None, description="RoPE scaling as a HF config.json's rope_scaling ({rope_type: linear "
        "| llama3 | yarn, factor, ...}); random models: theirs; hf/gguf sources (and vLLM's "
        "engine, as hf_overrides): replaces the file's, as Qwen3's model card enables YaRN past 32,768 tokens ({rope_type: yarn, "
        "factor: 4.0, original_max_position_embeddings: 32768}); null: the file's (none for "
        "random models)")
    rms_norm_eps: float = Field(1e-6, gt=0)  # random models: RMSNorm epsilon
    # Mistral: every layer; Gemma 2: the even (local) layers. None = full attention everywhere.
    sliding_window: int | None = Field(None, gt=0)
    tie_embeddings: bool = True  # random models: the unembedding is the embedding's transpose
    # auto: bfloat16 on TPU/GPU (with optim.master_weights_fp32 the optimizer keeps fp32
    # master weights; the log-prob kernel's log-softmax is fp32), float32 on CPU.
    param_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # dtype of the activations and matmuls; auto: bfloat16 on TPU/GPU, float32 on CPU
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # Default by source (`_memory_sane_defaults`): pretrained sources scan the layers and
    # rematerialise them (full), random models neither. Measured by `plan` for SmolLM2-135M at
    # 4×768 tokens on CPU: 13.9 GiB peak unrolled, 3.5 GiB scanned with remat=full.
    remat: Literal["none", "full", "dots", "dots_no_batch"] = Field(
        "none", description="activation rematerialisation of each layer in the backward pass "
        "(needs scan_layers); default: full for pretrained sources (hf, gguf, smollm2), none "
        "for random")
    scan_layers: bool = Field(
        False, description="run the layers under one jax.lax.scan (stacked weights); "
        "default: true for pretrained sources, false for random")
    decode_layers: Literal["auto", "unrolled", "scanned"] = Field(
        "auto", description="how sampling runs a scanned model's layers: unrolled (one KV "
        "buffer and one weight copy per layer: XLA:CPU copies each layer's slice of a stacked "
        "cache every step), scanned (the stacked cache updated in place by the TPU compiler; "
        "no weight copy, a faster compile), auto: scanned on TPU, else unrolled; needs "
        "scan_layers for scanned")
    lora: LoraConfig | None = None  # None: full fine-tuning
    # random models: experts per layer of a mixture-of-experts family (qwen3_moe, mixtral,
    # qwen2_moe; models/moe.py); 0: a dense MLP
    num_experts: int = Field(0, ge=0)
    num_experts_per_tok: int = Field(0, ge=0)  # random models: top-k experts of each token
    # random models: each expert's MLP width; null = intermediate_size
    moe_intermediate_size: int | None = Field(None, gt=0)
    # random models: renormalise the top-k router probabilities (Mixtral always does)
    norm_topk_prob: bool = True
    # random models: qwen2_moe's sigmoid-gated shared expert's width (> 0 for it, 0 otherwise)
    shared_expert_intermediate_size: int = Field(0, ge=0)
    router_aux_loss_coef: float | None = Field(
        None, ge=0, description="weight of the load-balancing loss (Switch Transformer, "
        "arXiv:2101.03961 eq. 4, pooled over layers as transformers computes it) added to the "
        "train loss and logged as loss/router_aux_loss; null: the weights file's "
        "router_aux_loss_coef (0.001 for random models)")
    router_z_loss_coef: float = Field(
        0.0, ge=0, description="weight of the router z-loss (ST-MoE, arXiv:2202.08906 eq. 5) "
        "added to the train loss and logged as loss/router_z_loss; Qwen3-MoE and Mixtral "
        "train without one (0)")
    # how tokens reach experts split over mesh.expert (models/moe_dispatch.py): all_gather
    # (gather the expert group's tokens, reduce-scatter the outputs) or all_to_all (static
    # worst-case buffers: k times the traffic, kept to measure against)
    moe_dispatch: Literal["all_gather", "all_to_all"] = "all_gather"
    routing_replay: Literal["off", "sampler"] = Field(
        "off", description="a mixture of experts' routing replay (R3, arXiv:2510.11370; "
        "docs/moe.md): sampler = the JAX sampler records each completion token's experts in "
        "its records (Record.routing) and the score pass and the train step route those "
        "tokens to them, the gates recomputed from the current router over them (prompt "
        "tokens: the trainer's own routing); off = every forward routes by its own router")
    # Attention kernel (models/attention.py): auto = splash on TPU, cuDNN on GPU, jnp on CPU;
    # ring: with mesh.context > 1, keys/values passed round the context axis instead of
    # all-gathered (models/ring.py; jnp math, one ring step's scores live at a time, in the
    # backward pass too: less memory than all-gather with jnp; splash keeps none), else jnp.
    attention: Literal["auto", "jnp", "xla", "cudnn", "splash", "ring"] = "auto"

    @model_validator(mode="before")
    @classmethod
    def _memory_sane_defaults(cls, data: Any) -> Any:
        """Unset remat / scan_layers: full + scanned for pretrained weights (a real model's
        activations dominate memory), none + unrolled for random (tiny test) models."""
        if isinstance(data, Mapping):
            pretrained = data.get("source", "random") != "random"
            data = dict(data)
            if data.get("scan_layers") is None:
                data["scan_layers"] = pretrained
            if data.get("remat") is None:
                data["remat"] = "full" if pretrained and data["scan_layers"] is True else "none"
        return data

    @model_validator(mode="after")
    def _rope_scaling_supported(self) -> ModelConfig:
        if self.rope_scaling is not None:  # here, not at the top: only then is JAX needed
            from jaxrl_llm.weights.loading import check_rope_scaling

            check_rope_scaling(self.rope_scaling, self.max_position_embeddings)
        return self

    @model_validator(mode="after")
    def _experts_fit(self) -> ModelConfig:
        moe = self.family in ("qwen3_moe", "mixtral", "qwen2_moe")
        if self.source == "random" and moe and not 1 <= self.num_experts_per_tok <= max(
                self.num_experts, 1):
            raise ValueError(
                f"model.num_experts_per_tok={self.num_experts_per_tok} (top-k) must be between "
                f"1 and model.num_experts={self.num_experts} for model.family={self.family}")
        if self.source == "random" and not moe and self.routing_replay != "off":
            raise ValueError(f"model.routing_replay={self.routing_replay} replays a mixture of "
                             f"experts' routing, but model.family={self.family} is dense: set "
                             "model.routing_replay=off")
        if self.source == "random" and not moe and self.num_experts:
            raise ValueError(f"model.num_experts={self.num_experts} is set but model.family="
                             f"{self.family} is dense: use qwen3_moe, mixtral or qwen2_moe")
        return self

    @model_validator(mode="after")
    def _remat_needs_scan(self) -> ModelConfig:
        # Unrolled, XLA schedules the recomputed layers early and keeps the activations anyway
        # (plan, SmolLM2-135M at 4×768 on CPU: 13.4 GiB with remat=full vs 13.9 without).
        if self.remat != "none" and not self.scan_layers:
            raise ValueError(
                f"model.remat={self.remat} saves no memory with model.scan_layers=false (the "
                "compiler keeps every layer's activations when the layers are unrolled): set "
                "model.scan_layers=true, or model.remat=none")
        if self.decode_layers == "scanned" and not self.scan_layers:
            raise ValueError(
                "model.decode_layers=scanned decodes the stacked layer weights of a scanned "
                "model: set model.scan_layers=true, or model.decode_layers=auto")
        return self
