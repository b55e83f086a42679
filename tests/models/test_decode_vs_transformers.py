"""The sampler's decode path (KV cache in its transposed layouts, one buffer per layer, q/k/v
and gate/up fused into one matmul each, layers unrolled even for a scanned model, or under
the layer scan on one stacked cache with `decode_layers="scanned"`) against transformers'
PyTorch forward.

For each family feature the fused projections must carry (q/k/v biases, Qwen3 q/k norms,
YaRN's scaled cos/sin, Gemma 2's soft-caps and sliding window, Mistral's window), with unrolled
and scanned layers,
every step's logits of greedy sampling (2 left-padded prompts × n = 2) must equal the logits
transformers computes by one full forward of prompt + completion. LoRA layers keep their
unfused projections; their sampled logits are checked against our own cache-free forward.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("torch")

import dataclasses

from jaxrl_llm.models.config import DecoderConfig
from jaxrl_llm.models.decoder import Decoder
from jaxrl_llm.models.layers import fuse_projections
from jaxrl_llm.models.lora import LoraSpec
from jaxrl_llm.sampling.build import decode_weights_bytes
from jaxrl_llm.sampling.continuous import ContinuousSampler
from jaxrl_llm.sampling.sampler import Sampler, SamplingParams
from jaxrl_llm.weights.hf import load_pretrained

from .tiny_hf import hf_configs, hf_logits, make_hf_model, save_hf

PROMPTS = [[17, 5, 200, 31, 9, 77], [4, 150, 62]]
NEW = 5
ATOL = 1e-4


def _greedy(model, n: int = 2, batching: str = "static"):
    # continuous: 3 slots for 2 prompts × n samples, so slots are refilled mid-run
    sampler = Sampler(model, pad_token_id=0, batch_size=2, prompt_buckets=(8,)) \
        if batching == "static" else ContinuousSampler(model, slots=3, prompt_buckets=(8,))
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, n=n)
    return sampler.generate(PROMPTS, params, jax.random.key(0), return_logits=True)


def _expected_step_logits(full_logits_of, out) -> list[np.ndarray]:
    """Per sample row: the reference logits at the positions predicting completion tokens."""
    rows = []
    for row in range(len(out.tokens)):
        prompt = PROMPTS[out.prompt_index[row]]
        sequence = np.asarray([prompt + out.tokens[row].tolist()], np.int32)
        logits = full_logits_of(sequence)[0]
        rows.append(logits[len(prompt) - 1: len(prompt) - 1 + NEW])
    return rows


@pytest.mark.parametrize("name,scan", [
    ("qwen3_qknorm", True),
    pytest.param("qwen3_yarn", False, marks=pytest.mark.slow),  # YaRN: also test_rope_yarn.py
    pytest.param("llama_linear_bias", False, marks=pytest.mark.slow),
    pytest.param("qwen2_bias", True, marks=pytest.mark.slow),
    pytest.param("gemma2", False, marks=pytest.mark.slow),
    pytest.param("gemma2", True, marks=pytest.mark.slow),
    pytest.param("mistral_window", True, marks=pytest.mark.slow),
])
def test_sampled_logits_equal_transformers_full_forward(tmp_path, name, scan):
    torch_model = make_hf_model(hf_configs()[name])
    model = load_pretrained(save_hf(torch_model, tmp_path / name), scan_layers=scan)
    for batching in ("static", "continuous"):
        out = _greedy(model, batching=batching)
        reference = _expected_step_logits(
            lambda seq: hf_logits(torch_model, seq, np.ones_like(seq)), out)
        assert np.abs(reference[0]).max() > 0.5  # not trivially small
        for row, expected in enumerate(reference):
            np.testing.assert_allclose(out.logits[row], expected, atol=ATOL, rtol=0)
            # greedy: each token is the argmax of the reference logits of its step
            np.testing.assert_array_equal(out.tokens[row], expected.argmax(-1))
    # the layout the docstring promises on CPU (decode_layers=auto): one cache buffer and one
    # (fused) parameter tree per layer, scanned model or not, so that no decode step copies a
    # layer's slice of a stack
    cache = model.init_cache(2, 8)
    assert isinstance(cache.k, tuple) and len(cache.k) == model.config.num_layers
    assert cache.max_len == 8
    layer_params = model.decode_layer_params()
    assert isinstance(layer_params, list) and len(layer_params) == model.config.num_layers
    assert layer_params[0]["attn"]["qkv"].ndim == 3  # [d, Hq + 2·Hkv, D]: no layer axis


@pytest.mark.parametrize("name", ["qwen3_qknorm", pytest.param("gemma2", marks=pytest.mark.slow)])
def test_stacked_decode_of_a_scanned_model_equals_transformers(tmp_path, name):
    # model.decode_layers=scanned (auto's choice on TPU): the layers decode under their scan
    # on one stacked cache, read and written at the layer index; gemma2 mixes sliding and
    # global layers, so the per-layer mask is selected inside the scan
    torch_model = make_hf_model(hf_configs()[name])
    model = load_pretrained(save_hf(torch_model, tmp_path / name), scan_layers=True,
                            decode_layers="scanned")
    cache = model.init_cache(2, 8)
    assert cache.k.shape == (model.config.num_layers, 2, model.config.num_kv_heads,
                             model.config.head_dim, 8)
    assert model.decode_layer_params()["attn"]["qkv"].ndim == 4  # [L, d, Hq + 2·Hkv, D]
    for batching in ("static", "continuous"):
        out = _greedy(model, batching=batching)
        reference = _expected_step_logits(
            lambda seq: hf_logits(torch_model, seq, np.ones_like(seq)), out)
        for row, expected in enumerate(reference):
            np.testing.assert_allclose(out.logits[row], expected, atol=ATOL, rtol=0)
            np.testing.assert_array_equal(out.tokens[row], expected.argmax(-1))


def test_decode_layers_scanned_needs_a_scanned_model():
    with pytest.raises(Exception, match="decode_layers='scanned' needs scan_layers=True"):
        DecoderConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_layers=2,
                      num_heads=4, num_kv_heads=2, decode_layers="scanned")
    from jaxrl_llm.config.model import ModelConfig
    with pytest.raises(ValueError, match="model.decode_layers=scanned .* model.scan_layers=true"):
        ModelConfig(source="random", scan_layers=False, decode_layers="scanned")
    assert ModelConfig(source="smollm2").decode_layers == "auto"


def test_fused_projections_are_concatenations_and_lora_layers_stay_unfused():
    config = DecoderConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_layers=2,
                           num_heads=4, num_kv_heads=2, scan_layers=True)
    p = nnx.to_pure_dict(nnx.state(Decoder(config, rngs=nnx.Rngs(0)).layers, nnx.Param))
    fused = fuse_projections(p)
    q, k, v = (np.asarray(p["attn"][w]) for w in "qkv")
    np.testing.assert_array_equal(fused["attn"]["qkv"][:, :, :4], q)
    np.testing.assert_array_equal(fused["attn"]["qkv"][:, :, 4:6], k)
    np.testing.assert_array_equal(fused["attn"]["qkv"][:, :, 6:], v)
    np.testing.assert_array_equal(fused["mlp"]["gate_up"][..., :24], p["mlp"]["gate"])
    np.testing.assert_array_equal(fused["mlp"]["gate_up"][..., 24:], p["mlp"]["up"])
    assert not {"q", "k", "v"} & set(fused["attn"]) and not {"gate", "up"} & set(fused["mlp"])

    lora = dataclasses.replace(config, lora=LoraSpec(rank=2, alpha=2.0))
    p = nnx.to_pure_dict(nnx.state(Decoder(lora, rngs=nnx.Rngs(0)).layers, nnx.Param))
    assert fuse_projections(p) is p


@pytest.mark.parametrize("scan", [True, False])
def test_memory_check_counts_the_decode_copy_of_the_layer_weights(scan):
    # the sampler's memory check adds what `decode_layer_params` allocates: for a scanned
    # model a copy of every layer weight, for an unrolled one the fused projections
    config = DecoderConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_layers=3,
                           num_heads=4, num_kv_heads=2, scan_layers=scan)
    model = Decoder(config, rngs=nnx.Rngs(0))
    copy = model.decode_layer_params()
    copied = sum(x.nbytes for x in jax.tree.leaves(copy))
    d, f, hd = 16, 24, 4  # q/k/v/o: d × heads × head_dim; gate/up/down: d × f; two norms
    layer_bytes = 4 * 3 * (d * (4 + 2 + 2) * hd + d * 4 * hd + 3 * d * f + 2 * d)
    assert decode_weights_bytes(model) == layer_bytes
    fused = 4 * 3 * (d * 8 * hd + 2 * d * f)
    assert copied == layer_bytes  # every layer weight, as a new or a shared buffer
    new = sum(x.nbytes for x in jax.tree.leaves(copy)
              if not any(x is y for y in jax.tree.leaves(nnx.state(model.layers, nnx.Param))))
    assert new == (layer_bytes if scan else fused) <= decode_weights_bytes(model)


@pytest.mark.slow  # ~15 s: keeps the default run under ten minutes
def test_lora_model_samples_the_logits_of_its_full_forward():
    spec = LoraSpec(rank=2, alpha=4.0)
    config = DecoderConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_layers=2,
                           num_heads=4, num_kv_heads=2, lora=spec)
    graphdef, state = nnx.split(Decoder(config, rngs=nnx.Rngs(0)))
    # Nonzero B factors and spread-out weights, so the adapters change the logits.
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(3), len(leaves))
    leaves = [x + 0.5 * jax.random.normal(key, x.shape, x.dtype) if x.ndim >= 2 else x
              for x, key in zip(leaves, keys)]
    model = nnx.merge(graphdef, jax.tree.unflatten(tree, leaves))
    out = _greedy(model)
    forward = jax.jit(lambda tokens: model.logits(model(tokens)))
    for row, expected in enumerate(_expected_step_logits(
            lambda seq: np.asarray(forward(seq)), out)):
        np.testing.assert_allclose(out.logits[row], expected, atol=1e-4, rtol=1e-5)
