"""Tiny random Hugging Face (PyTorch) checkpoints of every supported family, for tests.

Each builder returns a transformers config; `make_hf_model` initialises it with a fixed torch
seed (with 1-D parameters — norms and biases — perturbed so they are not all ones/zeros) and
`save_hf` writes it with transformers' own `save_pretrained`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

COMMON = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)


def hf_configs() -> dict:
    """name -> transformers config, covering every family and feature in the parity tests."""
    import transformers as tf

    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    return {
        # SmolLM2-like: tied embeddings, GQA, Llama 3.x rope scaling.
        "llama3_tied": tf.LlamaConfig(**{**COMMON, "num_hidden_layers": 2},
                                      tie_word_embeddings=True, rope_theta=500_000.0,
                                      rope_scaling=llama3),
        # Untied, linear rope scaling, attention_bias (q/k/v/o biases).
        "llama_linear_bias": tf.LlamaConfig(**{**COMMON, "num_hidden_layers": 2},
                                            rope_scaling={"rope_type": "linear", "factor": 2.0},
                                            attention_bias=True),
        "mistral_window": tf.MistralConfig(**COMMON, head_dim=16, sliding_window=4),
        "qwen2_bias": tf.Qwen2Config(**{**COMMON, "num_hidden_layers": 2}),
        "qwen3_qknorm": tf.Qwen3Config(**{**COMMON, "num_hidden_layers": 2}, head_dim=16,
                                       tie_word_embeddings=True),
        # YaRN (Qwen's long-context RoPE) over 4 original positions, to 4 × 4 = 16
        "qwen3_yarn": tf.Qwen3Config(**{**COMMON, "num_hidden_layers": 2,
                                        "max_position_embeddings": 16}, head_dim=16,
                                     rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 4}),
        "gemma2": tf.Gemma2Config(
            **COMMON, head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
            attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
    }


def make_hf_model(config, seed: int = 0):
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def save_hf(model, path: Path, **kwargs) -> Path:
    model.save_pretrained(str(path), **kwargs)
    return path


def hf_logits(model, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(torch.tensor(tokens), attention_mask=torch.tensor(mask))
    return out.logits.float().numpy()


def padded_batch(seed: int = 0, batch: int = 3, length: int = 12, vocab: int = 256):
    """Tokens [B, T] and a right-padding mask (row lengths T, T-4, T-7)."""
    rng = np.random.RandomState(seed)
    tokens = rng.randint(3, vocab, (batch, length)).astype(np.int32)
    mask = np.ones((batch, length), np.int32)
    for row, pad in enumerate([0, 4, 7][:batch]):
        if pad:
            mask[row, length - pad:] = 0
            tokens[row, length - pad:] = 0
    return tokens, mask


def moe_hf_configs() -> dict:
    """name -> transformers config of each mixture-of-experts family (models/moe.py): 8, 4
    and 6 experts, top-2 / top-2 / top-3, Qwen3-MoE's renormalised top-k, Qwen2-MoE's
    un-normalised one with its shared expert."""
    import transformers as tf

    base = {**COMMON, "num_hidden_layers": 2}
    return {
        "qwen3_moe": tf.Qwen3MoeConfig(**base, head_dim=16, moe_intermediate_size=32,
                                       num_experts=8, num_experts_per_tok=2,
                                       norm_topk_prob=True),
        "mixtral": tf.MixtralConfig(**{**base, "intermediate_size": 32}, num_local_experts=4,
                                    num_experts_per_tok=2),
        "qwen2_moe": tf.Qwen2MoeConfig(**base, moe_intermediate_size=32,
                                       shared_expert_intermediate_size=48, num_experts=6,
                                       num_experts_per_tok=3, norm_topk_prob=False),
    }


def build_checkpoints(configs: dict, tmp_path_factory) -> dict:
    """name -> (torch model, the directory transformers saved it to), one per config."""
    out = {}
    for name, config in configs.items():
        model = make_hf_model(config)
        out[name] = (model, save_hf(model, tmp_path_factory.mktemp(name)))
    return out
