"""HF import/export round trips: our export loads in transformers with the same logits, and
HF -> import -> export reproduces the checkpoint's tensors byte for byte (fp32 and bf16,
single-file and sharded)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors

torch = pytest.importorskip("torch")
import transformers as tf  # noqa: E402
from flax import nnx  # noqa: E402

from jaxrl_llm.models.config import DecoderConfig  # noqa: E402
from jaxrl_llm.models.decoder import Decoder  # noqa: E402
from jaxrl_llm.weights.hf import load_pretrained, save_pretrained, state_dict  # noqa: E402

from .tiny_hf import hf_configs, hf_logits, make_hf_model, padded_batch, save_hf  # noqa: E402


def _read_safetensors(directory: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """name -> (dtype, shape, raw bytes) over every *.safetensors file of a directory."""
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safetensors.safe_open(str(path), framework="numpy") as f:
            for name in f.keys():
                array = f.get_tensor(name)
                out[name] = (array.dtype.name, array.shape, array.tobytes())
    return out


def _random_model(config: DecoderConfig, seed: int) -> Decoder:
    """A model with O(0.1) random weights (norm scales near 1) so logits are O(1); values
    come from numpy, so no per-shape JAX random compile is needed."""
    model = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    rng = np.random.RandomState(seed)
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param):
            value = 0.1 * rng.standard_normal(var.shape).astype(np.float32)
            if path[-1] == "scale" and not config.is_gemma:
                value += 1.0
            var.set_value(jnp.asarray(value, dtype=var.dtype))
    return model


@pytest.mark.parametrize(
    "config",
    [
        DecoderConfig(family="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_layers=2, num_heads=4, num_kv_heads=2, qkv_bias=True,
                      eos_token_id=2, bos_token_id=1),
        DecoderConfig(family="gemma2", vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                      tie_embeddings=True, sliding_window=4, attn_logit_softcap=5.0,
                      final_logit_softcap=3.0, query_pre_attn_scalar=24, hidden_act="gelu_tanh",
                      layer_types=("sliding_attention", "full_attention", "sliding_attention"),
                      scan_layers=True),
        DecoderConfig(family="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_layers=2, num_heads=4, num_kv_heads=2, tie_embeddings=True,
                      rope_theta=500_000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 16}),
        # YaRN over 4 positions: the 12-token rows reach 3 × past it
        DecoderConfig(family="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True,
                      max_position_embeddings=16,
                      rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                    "original_max_position_embeddings": 4}),
    ],
    ids=["qwen2", "gemma2_scanned", "llama3_tied", "qwen3_yarn"],
)
def test_export_loads_in_transformers_with_same_logits(tmp_path, config):
    model = _random_model(config, 4)
    out = save_pretrained(model, tmp_path / "export")
    assert DecoderConfig.from_hf(json.loads((out / "config.json").read_text()),
                                 scan_layers=config.scan_layers) == config
    hf_model = tf.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager")
    hf_model.eval()
    assert type(hf_model).__name__.lower().startswith(config.family)
    tokens, mask = padded_batch()
    ref = hf_logits(hf_model, tokens, mask)
    ours = np.asarray(model.logits(model(jnp.asarray(tokens), segment_ids=jnp.asarray(mask))))
    real = mask.astype(bool)
    assert np.abs(ref[real]).max() > 0.5
    np.testing.assert_allclose(ours[real], ref[real], atol=1e-4, rtol=0)
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen.get("eos_token_id") == config.eos_token_id


@pytest.mark.parametrize("name", ["gemma2", "qwen2_bias", "llama_linear_bias"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_import_export_is_byte_identical(tmp_path, name, dtype):
    hf_model = make_hf_model(hf_configs()[name]).to(getattr(torch, dtype))
    src = save_hf(hf_model, tmp_path / "hf")
    scan = name == "gemma2"
    model = load_pretrained(src, scan_layers=scan)
    assert model.config.param_dtype == dtype  # the checkpoint's own dtype
    out = save_pretrained(model, tmp_path / "ours")
    ref, got = _read_safetensors(src), _read_safetensors(out)
    assert sorted(got) == sorted(ref)
    for key, (ref_dtype, ref_shape, ref_bytes) in ref.items():
        assert got[key][:2] == (ref_dtype, ref_shape), key
        assert got[key][2] == ref_bytes, key


def test_sharded_checkpoints_both_ways(tmp_path):
    hf_model = make_hf_model(hf_configs()["qwen3_qknorm"])
    src = save_hf(hf_model, tmp_path / "hf", max_shard_size="60KB")
    assert (src / "model.safetensors.index.json").exists()
    assert len(list(src.glob("*.safetensors"))) > 1
    model = load_pretrained(src)
    out = save_pretrained(model, tmp_path / "ours", max_shard_bytes=100_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == {p.name for p in shards}
    assert index["metadata"]["total_size"] == sum(
        np.asarray(a).nbytes for a in state_dict(model).values())
    ref, got = _read_safetensors(src), _read_safetensors(out)
    assert sorted(got) == sorted(ref)
    assert all(got[k] == ref[k] for k in ref)
    reloaded = tf.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager")
    tokens, mask = padded_batch()
    np.testing.assert_allclose(hf_logits(reloaded.eval(), tokens, mask),
                               hf_logits(hf_model, tokens, mask), atol=1e-6, rtol=0)


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 256)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                      bos_token="<s>", eos_token="</s>")


def test_tokenizer_saved_and_copied(tmp_path):
    model = _random_model(DecoderConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                                        num_layers=1, num_heads=2, num_kv_heads=1,
                                        eos_token_id=2), 0)
    first = save_pretrained(model, tmp_path / "a", tokenizer=_tiny_tokenizer())
    loaded = tf.AutoTokenizer.from_pretrained(str(first))
    assert loaded("w5 w7").input_ids == [5, 7] and loaded.eos_token_id == 2
    second = save_pretrained(model, tmp_path / "b", tokenizer=first)
    assert (second / "tokenizer.json").read_bytes() == (first / "tokenizer.json").read_bytes()
    assert tf.AutoTokenizer.from_pretrained(str(second))("w9").input_ids == [9]


@pytest.mark.parametrize("name", list(hf_configs()))
def test_config_round_trips_through_hf_dict(name):
    hf = hf_configs()[name].to_dict()
    config = DecoderConfig.from_hf(hf)
    assert DecoderConfig.from_hf(config.to_hf()) == config
    # transformers reads our dict back to the same architecture numbers.
    back = tf.AutoConfig.for_model(**config.to_hf())
    assert back.num_hidden_layers == hf["num_hidden_layers"]
    assert back.rope_parameters == hf_configs()[name].rope_parameters
    assert getattr(back, "layer_types", None) in (None, hf.get("layer_types"))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma2"])
def test_random_architecture_builds_each_family(family):
    from jaxrl_llm.config import ModelConfig
    from jaxrl_llm.weights.loading import decoder_config

    section = ModelConfig(family=family, vocab_size=128, hidden_size=32, intermediate_size=64,
                          num_layers=2, num_heads=4, num_kv_heads=2,
                          sliding_window=8 if family in ("mistral", "gemma2") else None)
    config = decoder_config(section)  # source random: the section's own architecture
    assert (config.family, config.num_layers, config.head_dim) == (family, 2, 8)
    assert config.qkv_bias == (family == "qwen2") and config.qk_norm == (family == "qwen3")
    assert config.sliding_layers == {"mistral": (True, True), "gemma2": (True, False)}.get(
        family, (False, False))
    abstract = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    assert abstract.embed.shape == (128, 32)


def test_place_puts_parameters_on_a_mesh(tmp_path):
    """`place` receives each parameter with its logical axes and decides its sharding."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    src = save_hf(make_hf_model(hf_configs()["qwen2_bias"]), tmp_path / "hf")
    mesh = Mesh(np.array(jax.devices()[:2]), ("tensor",))
    seen = {}

    def place(array, axes):
        seen[axes] = array.shape
        spec = PartitionSpec(*("tensor" if a in ("mlp", "vocab") else None for a in axes))
        return jax.device_put(array, NamedSharding(mesh, spec))

    model = load_pretrained(src, scan_layers=True, place=place)
    assert seen[("layers", "embed", "mlp")] == (2, 64, 128)
    assert model.layers.mlp.up[...].sharding.spec == PartitionSpec(None, None, "tensor")
    assert model.embed[...].sharding.spec == PartitionSpec("tensor", None)
    ref = load_pretrained(src, scan_layers=True)
    np.testing.assert_array_equal(np.asarray(model.layers.mlp.up[...]),
                                  np.asarray(ref.layers.mlp.up[...]))
    # A sharded model exports the same bytes as the checkpoint it came from.
    out = save_pretrained(model, tmp_path / "ours")
    assert _read_safetensors(out) == _read_safetensors(src)
