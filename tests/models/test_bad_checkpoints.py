"""Bad Hugging Face checkpoints fail loudly, naming the field or tensor and the file; a model
is only returned once every tensor has been checked (never half-loaded)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

pytest.importorskip("torch")

from jaxrl_llm.models.config import DecoderConfig, UnsupportedConfigError
from jaxrl_llm.weights.hf import (
    CheckpointError,
    load_pretrained,
    model_from_state_dict,
)

from .tiny_hf import hf_configs, make_hf_model, save_hf


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory) -> Path:
    return save_hf(make_hf_model(hf_configs()["qwen2_bias"]), tmp_path_factory.mktemp("good"))


def _copy(good: Path, dst: Path, *, config=None, tensors=None) -> Path:
    dst.mkdir()
    hf_config = json.loads((good / "config.json").read_text())
    if config:
        config(hf_config)
    (dst / "config.json").write_text(json.dumps(hf_config))
    weights = safetensors.numpy.load_file(str(good / "model.safetensors"))
    if tensors:
        tensors(weights)
    safetensors.numpy.save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_good_checkpoint_loads(good_dir):
    assert load_pretrained(good_dir).config.family == "qwen2"


def test_unsupported_model_type(good_dir, tmp_path):
    def edit(c):
        c["model_type"] = "gpt2"
        c["architectures"] = ["GPT2LMHeadModel"]

    bad = _copy(good_dir, tmp_path / "d", config=edit)
    with pytest.raises(UnsupportedConfigError, match=r"config\.json.*model_type='gpt2'"):
        load_pretrained(bad)


def test_unsupported_architecture_head(good_dir, tmp_path):
    bad = _copy(good_dir, tmp_path / "d",
                config=lambda c: c.update(architectures=["Qwen2ForSequenceClassification"]))
    with pytest.raises(UnsupportedConfigError, match="Qwen2ForSequenceClassification"):
        load_pretrained(bad)


def test_missing_tensor(good_dir, tmp_path):
    bad = _copy(good_dir, tmp_path / "d",
                tensors=lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=re.escape("model.layers.1.mlp.up_proj.weight")):
        load_pretrained(bad)


def test_unexpected_tensor(good_dir, tmp_path):
    def add(t):
        t["model.layers.0.self_attn.extra.weight"] = np.zeros((2, 2), np.float32)

    bad = _copy(good_dir, tmp_path / "d", tensors=add)
    with pytest.raises(CheckpointError,
                       match=r"model\.safetensors: unexpected tensor.*self_attn\.extra\.weight"):
        load_pretrained(bad)


def test_shape_mismatch_names_tensor_and_file(good_dir, tmp_path):
    bad = _copy(good_dir, tmp_path / "d", config=lambda c: c.update(intermediate_size=96))
    with pytest.raises(CheckpointError,
                       match=r"model\.safetensors: tensor model\.layers\.0\.mlp\.gate_proj\.weight"
                             r" has shape \[128, 64\], config\.json implies \[96, 64\]"):
        load_pretrained(bad)


def test_unknown_rope_type(good_dir, tmp_path):
    def edit(c):
        c["rope_parameters"] = {"rope_type": "longrope", "factor": 4.0, "rope_theta": 10000.0}

    bad = _copy(good_dir, tmp_path / "d", config=edit)
    with pytest.raises(UnsupportedConfigError, match="rope_type='longrope'"):
        load_pretrained(bad)
    with pytest.raises(UnsupportedConfigError, match="rope_type='dynamic'"):
        DecoderConfig(rope_scaling={"rope_type": "dynamic", "factor": 2.0})


@pytest.mark.parametrize(
    "field,value",
    [("use_sliding_window", True), ("hidden_act", "gelu"),
     ("quantization_config", {"quant_method": "gptq"}), ("rope_interleaved", True),
     ("partial_rotary_factor", 0.5)],
)
def test_unsupported_config_fields(good_dir, tmp_path, field, value):
    bad = _copy(good_dir, tmp_path / "d", config=lambda c: c.update({field: value}))
    with pytest.raises(UnsupportedConfigError, match=field):
        load_pretrained(bad)


def test_llama_mlp_bias_rejected():
    hf = hf_configs()["llama3_tied"].to_dict()
    hf["mlp_bias"] = True
    with pytest.raises(UnsupportedConfigError, match="mlp_bias=True"):
        model_from_state_dict(hf, {})


def test_tied_lm_head_that_differs(good_dir, tmp_path):
    def edit(c):
        c["tie_word_embeddings"] = True

    def tensors(t):
        t["lm_head.weight"] = t["lm_head.weight"] + 1.0

    bad = _copy(good_dir, tmp_path / "d", config=edit, tensors=tensors)
    with pytest.raises(CheckpointError, match="lm_head.weight differs"):
        load_pretrained(bad)


def test_index_names_missing_shard(good_dir, tmp_path):
    bad = _copy(good_dir, tmp_path / "d")
    (bad / "model.safetensors").rename(bad / "model-00001-of-00002.safetensors")
    names = safetensors.numpy.load_file(str(bad / "model-00001-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names}
    weight_map["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (bad / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load_pretrained(bad)


def test_pickle_checkpoint_is_not_read(good_dir, tmp_path):
    bad = tmp_path / "d"
    bad.mkdir()
    (bad / "config.json").write_text((good_dir / "config.json").read_text())
    (bad / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(CheckpointError, match="no \\*.safetensors weights"):
        load_pretrained(bad)
