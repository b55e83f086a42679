"""LoRA adapters on the decoder: zero adapters change nothing (exactly); trained (nonzero)
adapters give transformers the same logits once merged into the HF export, and `peft` —
an independent implementation of the LoRA update — loads our adapter export onto the base
HF model and matches too; an unknown target is a config error naming it."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm.config import ConfigError, config_from_dict
from jaxrl_llm.losses.logprobs import token_logprobs
from jaxrl_llm.models.config import DecoderConfig
from jaxrl_llm.models.decoder import Decoder
from jaxrl_llm.models.lora import DEFAULT_TARGETS, LORA_TARGETS, LoraSpec, add_lora
from jaxrl_llm.weights import hf
from jaxrl_llm.weights.lora_export import ADAPTER_CONFIG, merge_lora, save_peft_adapter
from tests.models.tiny_hf import hf_configs, make_hf_model

TOKENS = np.array([[1, 7, 20, 33, 64, 90, 127, 3, 200, 45],
                   [5, 9, 250, 17, 2, 0, 11, 88, 31, 6]], np.int32)


@nnx.jit
def _jit_logprobs(model: Decoder, tokens: jax.Array) -> jax.Array:
    targets = jnp.roll(tokens, -1, axis=1)
    return token_logprobs(model(tokens), model.unembedding(), targets, chunk_size=64,
                          softcap=model.final_logit_softcap)


@nnx.jit
def _jit_logits(model: Decoder, tokens: jax.Array) -> jax.Array:
    return model.logits(model(tokens))


def _logprobs(model: Decoder, tokens: np.ndarray) -> np.ndarray:
    return np.asarray(_jit_logprobs(model, jnp.asarray(tokens)))


def _logits(model: Decoder, tokens: np.ndarray) -> np.ndarray:
    return np.asarray(_jit_logits(model, jnp.asarray(tokens)))


def _randomise_adapters(model: Decoder, seed: int, std: float = 0.2) -> None:
    """Both A and B nonzero (a trained adapter), in place."""
    state = nnx.state(model, nnx.LoRAParam)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    new = [std * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
    nnx.update(model, jax.tree.unflatten(treedef, new))


@pytest.mark.parametrize("family, scan", [pytest.param("llama", False, marks=pytest.mark.slow),
                                          ("llama", True),
                                          pytest.param("qwen2", False, marks=pytest.mark.slow),
                                          ("gemma2", True)])
def test_zero_adapters_give_exactly_the_base_logprobs(family, scan):
    config = DecoderConfig(family=family, vocab_size=256, hidden_size=32, intermediate_size=48,
                           num_layers=2, num_heads=4, num_kv_heads=2, scan_layers=scan,
                           qkv_bias=family == "qwen2", tie_embeddings=family == "gemma2")
    model = Decoder(config, rngs=nnx.Rngs(3))
    base = _logprobs(model, TOKENS)
    add_lora(model, LoraSpec(rank=4, alpha=8.0), seed=5)
    adapters = jax.tree.leaves(nnx.state(model, nnx.LoRAParam))
    # Seven targets × (A, B), per layer or stacked.
    assert len(adapters) == 2 * len(DEFAULT_TARGETS) * (1 if scan else config.num_layers)
    assert any(float(jnp.abs(a).max()) > 0 for a in adapters)  # A is random, B = 0
    np.testing.assert_array_equal(_logprobs(model, TOKENS), base)
    # ... and the adapters are live: a nonzero B moves the log-probs.
    _randomise_adapters(model, seed=1)
    assert np.abs(_logprobs(model, TOKENS) - base).max() > 1e-2


def test_a_decoder_built_with_lora_in_its_config_has_the_targeted_adapters_only():
    spec = LoraSpec(rank=2, alpha=2.0, targets=("o_proj", "down_proj"))
    config = DecoderConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_layers=2,
                           num_heads=2, num_kv_heads=1, lora=spec)
    model = Decoder(config, rngs=nnx.Rngs(0))
    names = {"/".join(map(str, path)) for path, _ in nnx.to_flat_state(
        nnx.state(model, nnx.LoRAParam))}
    assert names == {f"layers/{i}/{m}/{w}_lora/lora_{x}" for i in range(2)
                     for m, w in (("attn", "o"), ("mlp", "down")) for x in "ab"}
    # o [Hq, D, d]: A [Hq, D, r], B [r, d]; the rank axis is never split.
    o = model.layers[0].attn.o_lora
    assert o.lora_a.shape == (2, 8, 2) and o.lora_b.shape == (2, 16)
    assert o.lora_b.get_metadata()["out_sharding"] == (None, "embed")
    # A factor without an "embed" dim gets its largest dim split by FSDP instead.
    assert o.lora_a.get_metadata()["out_sharding"] == ("q_heads", "embed", None)
    down = model.layers[0].mlp.down_lora
    assert down.lora_a.get_metadata()["out_sharding"] == ("embed", None)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A tiny untied Llama with q/k/v/o biases, saved by transformers (the base model)."""
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("lora_base") / "base"
    make_hf_model(hf_configs()["llama_linear_bias"], seed=4).save_pretrained(out)
    return out


def _hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()


@pytest.mark.slow  # ≈ 19 s for both; PEFT round trip
@pytest.mark.parametrize("scan", [False, True])
def test_merged_export_and_peft_adapter_match_our_adapted_model(base_dir, tmp_path, scan):
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    model = hf.load_pretrained(base_dir, dtype="float32", scan_layers=scan)
    base_logits = _logits(model, TOKENS)
    targets = ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")
    add_lora(model, LoraSpec(rank=3, alpha=6.0, targets=targets), seed=1)
    _randomise_adapters(model, seed=2)
    ours = _logits(model, TOKENS)
    assert np.abs(ours - base_logits).max() > 0.1  # the adapters matter

    # Merged: W + (α/r)·A·B in the plain HF checkpoint.
    hf.save_pretrained(model, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    np.testing.assert_allclose(_hf_logits(merged.eval(), TOKENS), ours, atol=2e-4, rtol=1e-4)
    assert merge_lora(model).config.lora is None

    # PEFT: the adapters (A, B, α, r) on the untouched base model.
    save_peft_adapter(model, tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert saved["r"] == 3 and saved["lora_alpha"] == 6.0
    assert sorted(saved["target_modules"]) == sorted(targets)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    np.testing.assert_allclose(_hf_logits(base.eval(), TOKENS), base_logits, atol=2e-4,
                               rtol=1e-4)
    with_adapter = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    # peft read every tensor we wrote (a name it does not expect would be dropped silently).
    lora_weights = [n for n, _ in with_adapter.named_parameters() if "lora_" in n]
    assert len(lora_weights) == 2 * len(targets) * model.config.num_layers
    np.testing.assert_allclose(_hf_logits(with_adapter, TOKENS), ours, atol=2e-4, rtol=1e-4)


def test_unknown_lora_target_is_a_config_error_naming_it():
    with pytest.raises(ConfigError) as err:
        config_from_dict({"model": {"lora": {"rank": 4, "targets": ["q_proj", "qkv_proj"]}}})
    message = str(err.value)
    assert "model.lora.targets" in message and "'qkv_proj'" in message
    for valid in LORA_TARGETS:
        assert valid in message
    with pytest.raises(ConfigError, match="model.lora.rank"):
        config_from_dict({"model": {"lora": {"rank": 0}}})
    # The config's vocabulary and default are the models package's.
    assert tuple(config_from_dict({"model": {"lora": {}}}).model.lora.targets) == DEFAULT_TARGETS
    # The models API (a LoraSpec built in code) refuses the same way.
    with pytest.raises(ValueError, match=r"unknown LoRA target\(s\) \['qkv'\]; valid targets"):
        LoraSpec(rank=2, alpha=2.0, targets=("q_proj", "qkv"))
