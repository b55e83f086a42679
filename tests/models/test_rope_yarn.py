"""YaRN RoPE scaling (YaRN arXiv:2309.00071) against transformers' PyTorch implementation.

The inverse frequencies and attention factor against `ROPE_INIT_FUNCTIONS["yarn"]` (Qwen3-8B's
own numbers among them); a tiny random Qwen3 and Qwen2 with YaRN over 16 original positions,
run on 64-token rows, saved by transformers and loaded by our converter: the same logits at
every position, including the 48 past `original_max_position_embeddings`; `model.rope_scaling`
turning YaRN on for a checkpoint whose config.json has none; and bad values refused.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")

from jaxrl_llm.config import ModelConfig, config_from_dict
from jaxrl_llm.core.errors import ConfigError
from jaxrl_llm.models.config import DecoderConfig, UnsupportedConfigError
from jaxrl_llm.models.layers import rope_attention_scale, rope_inv_freq
from jaxrl_llm.weights.hf import load_pretrained
from jaxrl_llm.weights.loading import load_model

from .tiny_hf import COMMON, hf_logits, make_hf_model, save_hf

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
T = 64  # 4 × 16: every position past 16 is outside the original context


def _tf_config(family: str, rope: dict, *, head_dim: int = 16, theta: float = 10_000.0,
               max_len: int = T):
    import transformers as tf

    cls = {"qwen3": tf.Qwen3Config, "qwen2": tf.Qwen2Config}[family]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(**{**COMMON, "num_hidden_layers": 2, "max_position_embeddings": max_len},
                   head_dim=head_dim, rope_parameters={"rope_theta": theta, **rope})


@pytest.mark.parametrize("head_dim,theta,rope", [
    (128, 1e6, {"factor": 4.0, "original_max_position_embeddings": 32768}),  # Qwen3-8B
    (16, 1e4, {"factor": 4.0, "original_max_position_embeddings": 16}),
    (64, 1e4, {"factor": 8.0, "original_max_position_embeddings": 2048, "beta_fast": 16,
               "beta_slow": 2, "truncate": False}),
    (64, 5e5, {"factor": 16.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
               "mscale_all_dim": 0.707}),
    (64, 5e5, {"factor": 2.0, "original_max_position_embeddings": 4096,
               "attention_factor": 1.3}),
], ids=["qwen3_8b", "tiny", "betas_untruncated", "deepseek_mscale", "attention_factor"])
def test_inv_freq_and_attention_factor_match_transformers(head_dim, theta, rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = _tf_config("qwen3", {"rope_type": "yarn", **rope}, head_dim=head_dim, theta=theta,
                    max_len=round(rope["factor"] * rope["original_max_position_embeddings"]))
    ref_inv, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, None)
    ours = DecoderConfig.from_hf(hf.to_dict())
    inv = rope_inv_freq(ours)
    assert inv.dtype == np.float32 and inv.shape == (head_dim // 2,)
    np.testing.assert_allclose(inv, ref_inv.numpy(), rtol=2e-7, atol=0)
    assert rope_attention_scale(ours) == pytest.approx(ref_factor, rel=1e-12)


def test_qwen3_8b_frequencies_by_hand():
    """Qwen3-8B (θ = 10⁶, d = 128, L = 32,768, s = 4) from the paper's definitions: pair i
    turns r_i = L·θ^(-2i/d)/(2π) times over L; r_i > 32 kept, r_i < 1 divided by s, a linear
    ramp over i in between (bounds rounded outwards); attention factor 0.1·ln 4 + 1."""
    d, theta, length, s = 128, 1e6, 32768, 4.0
    config = DecoderConfig(family="qwen3", hidden_size=4096, num_heads=32, num_kv_heads=8,
                           head_dim=d, rope_theta=theta, max_position_embeddings=131072,
                           rope_scaling={"rope_type": "yarn", "factor": s,
                                         "original_max_position_embeddings": length})
    base = np.array([theta ** (-2 * i / d) for i in range(d // 2)])
    rotations = length * base / (2 * math.pi)
    # the ramp's ends: the dimension index where rotations = 32 and = 1
    low = math.floor(d * math.log(length / (32 * 2 * math.pi)) / (2 * math.log(theta)))
    high = math.ceil(d * math.log(length / (1 * 2 * math.pi)) / (2 * math.log(theta)))
    assert (low, high) == (23, 40)  # pairs 0-23 kept, 40-63 interpolated
    ramp = np.clip((np.arange(d // 2) - low) / (high - low), 0, 1)
    expected = base / s * ramp + base * (1 - ramp)
    inv = rope_inv_freq(config)
    np.testing.assert_allclose(inv, expected, rtol=3e-6)
    assert (inv[rotations > 32] == pytest.approx(base[rotations > 32], rel=3e-6))
    assert (inv[rotations < 1] == pytest.approx(base[rotations < 1] / s, rel=3e-6))
    assert rope_attention_scale(config) == pytest.approx(0.1 * math.log(4) + 1)  # 1.1386


@pytest.fixture(scope="module")
def yarn_models(tmp_path_factory):
    """family -> (torch model with YaRN, its saved directory)."""
    out = {}
    for family in ("qwen3", "qwen2"):
        model = make_hf_model(_tf_config(family, YARN), seed=3)
        out[family] = (model, save_hf(model, tmp_path_factory.mktemp(f"{family}_yarn")))
    return out


def _rows(seed: int = 0, batch: int = 2) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.random.RandomState(seed).randint(3, COMMON["vocab_size"], (batch, T))
    return tokens.astype(np.int32), np.ones((batch, T), np.int32)


def _logits(model, tokens, mask) -> np.ndarray:
    hidden = model(jnp.asarray(tokens), segment_ids=jnp.asarray(mask))
    return np.asarray(model.logits(hidden))


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_logits_past_the_original_context_match_transformers(yarn_models, family):
    torch_model, path = yarn_models[family]
    tokens, mask = _rows()
    ref = hf_logits(torch_model, tokens, mask)
    model = load_pretrained(path)
    assert model.config.rope_scaling["rope_type"] == "yarn"
    ours = _logits(model, tokens, mask)
    assert np.abs(ref[:, 16:]).max() > 0.5  # logits are not trivially small
    np.testing.assert_allclose(ours[:, 16:], ref[:, 16:], atol=1e-5, rtol=0)
    np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=0)
    # The check can fail: without the scaling, or without its attention factor, the logits
    # past position 16 move by far more than the tolerance.
    plain = load_pretrained(path, rope_scaling=None)
    assert np.abs(_logits(plain, tokens, mask)[:, 16:] - ref[:, 16:]).max() > 1e-2
    unscaled = load_pretrained(path, rope_scaling={**YARN, "attention_factor": 1.0})
    assert np.abs(_logits(unscaled, tokens, mask)[:, 16:] - ref[:, 16:]).max() > 1e-2


def _with_config(path: Path, out: Path, drop: str, **changes) -> Path:
    """A copy of the checkpoint `path` whose config.json lacks `drop` and has `changes`."""
    out.mkdir()
    for f in path.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((path / "config.json").read_text())
    config.pop(drop, None)
    (out / "config.json").write_text(json.dumps({**config, **changes}))
    return out


def test_legacy_type_spelling_in_config_json(yarn_models, tmp_path):
    """A transformers 4.x config.json: `rope_scaling: {"type": "yarn", ...}`, no
    rope_parameters; `original_max_position_embeddings` absent defaults, as in transformers,
    to max_position_embeddings."""
    torch_model, path = yarn_models["qwen2"]
    legacy = _with_config(path, tmp_path / "legacy", "rope_parameters", rope_theta=10_000.0,
                          max_position_embeddings=16,
                          rope_scaling={"type": "yarn", "factor": 4.0})
    model = load_pretrained(legacy)
    assert dict(model.config.rope_scaling) == {**YARN, "rope_type": "yarn"}
    tokens, mask = _rows(seed=1)
    np.testing.assert_allclose(_logits(model, tokens, mask), hf_logits(torch_model, tokens, mask),
                               atol=1e-5, rtol=0)


def test_model_rope_scaling_turns_yarn_on_for_a_plain_checkpoint(yarn_models, tmp_path):
    """Qwen3's model card way: the checkpoint's config.json has no scaling and a 40-position
    context; `model.rope_scaling` sets YaRN and the 4 × 16 = 64 positions it extends to."""
    torch_model, path = yarn_models["qwen3"]
    plain = _with_config(path, tmp_path / "plain", "rope_scaling", max_position_embeddings=40,
                         rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    section = ModelConfig(source="hf", path=str(plain), param_dtype="float32",
                          compute_dtype="float32", scan_layers=False, remat="none",
                          rope_scaling={"type": "yarn", "factor": 4.0,
                                        "original_max_position_embeddings": 16})
    model = load_model(section).model
    assert model.config.max_position_embeddings == 64
    tokens, mask = _rows(seed=2)
    np.testing.assert_allclose(_logits(model, tokens, mask), hf_logits(torch_model, tokens, mask),
                               atol=1e-5, rtol=0)
    assert load_pretrained(plain).config.rope_scaling is None  # the file alone: no YaRN


@pytest.mark.parametrize("scaling,named", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_type='dynamic'"),
    ({"rope_type": "yarn", "factor": 4.0}, "'original_max_position_embeddings'"),
    ({"rope_type": "yarn", "original_max_position_embeddings": 16}, "'factor'"),
    ({"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 16},
     "factor >= 1"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
      "beta_fast": "fast"}, "beta_fast='fast'"),
])
def test_bad_rope_scaling_refused_at_config_load(scaling, named):
    with pytest.raises(ConfigError, match="model.rope_scaling") as err:
        config_from_dict({"model": {"rope_scaling": scaling}}, source="c.yaml")
    assert named in str(err.value)
    with pytest.raises(UnsupportedConfigError, match=named.replace("(", r"\(")):
        DecoderConfig(rope_scaling=scaling)
