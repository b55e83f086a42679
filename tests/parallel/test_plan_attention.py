"""`jaxrl-llm plan` compiles the splash attention kernel for a real TPU topology (libtpu), and
reports a roofline bound from the compiled FLOPs and bytes at the chip's peak."""

from __future__ import annotations

import json

import pytest
import yaml

from jaxrl_llm.cli import main
from jaxrl_llm.plan import CHIP_PEAK, libtpu_available

ARCH = dict(family="gemma2", vocab_size=256, hidden_size=256, intermediate_size=512,
            num_layers=2, num_heads=4, num_kv_heads=2, head_dim=128, sliding_window=128,
            tie_embeddings=True, scan_layers=True, remat="full",
            param_dtype="bfloat16", compute_dtype="bfloat16")


def _tree(attention: str) -> dict:
    return {
        "name": f"plan_{attention}", "model": ARCH | {"attention": attention},
        "loss": {"name": "topr", "logprob_chunk_size": 128},
        "optim": {"name": "adamw"}, "mesh": {"data": 1, "fsdp": 4, "tensor": 1},
        "train": {"batch_size": 4, "max_seq_len": 2048},
        "plan": {"platform": "tpu", "topology": "v5e:2x2"},
    }


@pytest.mark.slow
@pytest.mark.skipif(not libtpu_available(), reason="needs the `tpu` extra (PyPI libtpu)")
def test_plan_compiles_splash_for_v5e_and_bounds_the_step(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    reports = {}
    for attention in ("auto", "jnp"):
        path = tmp_path / f"{attention}.yaml"
        path.write_text(yaml.safe_dump(_tree(attention)))
        assert main(["plan", "--config", path.name, "--json", f"{attention}.json"]) == 0
        reports[attention] = json.loads((tmp_path / f"{attention}.json").read_text())
    printed = capsys.readouterr().out
    auto, jnp_ = reports["auto"], reports["jnp"]
    # "auto" on a TPU mesh is splash: Mosaic kernels (forward, dq, dkv per local/global layer
    # branch) are in the compiled step; the jnp path has none.
    assert auto["attention"] == "splash" and auto["pallas_kernels"] >= 3
    assert jnp_["attention"] == "jnp" and jnp_["pallas_kernels"] == 0
    assert "splash (" in printed and "roofline bound" in printed
    # Splash never holds [B, H, T, S] fp32 scores: fewer temporaries than the jnp path.
    assert auto["temp_bytes"] < jnp_["temp_bytes"]
    # Roofline: max(FLOPs/peak, bytes/bandwidth) from the report's own FLOPs and bytes.
    peak, bandwidth = CHIP_PEAK["v5e"]
    flops = max(auto["flops_per_device"], auto["hardware_flops"] / 4)
    want = max(flops / peak, auto["bytes_accessed_per_device"] / bandwidth)
    assert auto["roofline_seconds"] == pytest.approx(want)
    useful = auto["model_flops_6nd"] + auto["attention_flops"]
    assert auto["mfu_bound"] == pytest.approx(useful / (4 * peak * want))
    assert 0 < auto["mfu_bound"] <= 1


def test_splash_refuses_bf16_at_highest_precision_before_compiling():
    # CI once died inside Mosaic ("Bad lhs type") with JAX_DEFAULT_MATMUL_PRECISION=highest set
    # process-wide; the attention now names the setting and the fixes instead.
    import jax
    import jax.numpy as jnp

    from jaxrl_llm.core.errors import ConfigError
    from jaxrl_llm.models.attention import _splash_local

    q = jnp.zeros((1, 128, 2, 128), jnp.bfloat16)
    seg = jnp.ones((1, 128), jnp.int32)
    with jax.default_matmul_precision("highest"), pytest.raises(
            ConfigError, match="JAX_DEFAULT_MATMUL_PRECISION=highest.*model.attention=jnp"):
        _splash_local(q, q, q, seg, scale=1.0, logit_softcap=None, window=None, interpret=True)
