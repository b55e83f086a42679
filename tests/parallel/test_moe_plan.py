"""`jaxrl-llm plan` for mixtures of experts: a small MoE step compiled by the real TPU compiler
(libtpu) for a v5e:2x2 with its experts on the expert axis, and the shipped Qwen3-30B-A3B
config (configs/topr_gsm8k_qwen3_30b_a3b_v5e256.yaml): its architecture is Qwen3-30B-A3B's
(parameter counts by hand from the model card's shapes), and (slow: ~7 minutes on 2 cores)
it compiles for v5e-256 and fits a 16 GiB chip with each chip holding 16 of 128 experts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from flax import nnx

from jaxrl_llm.cli import main
from jaxrl_llm.config import load_config
from jaxrl_llm.models.decoder import Decoder
from jaxrl_llm.plan import GIB, inactive_expert_params, libtpu_available, make_plan
from jaxrl_llm.train.state import count_params
from jaxrl_llm.weights.loading import decoder_config

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "topr_gsm8k_qwen3_30b_a3b_v5e256.yaml"
needs_libtpu = pytest.mark.skipif(not libtpu_available(),
                                  reason="needs the `tpu` extra (PyPI libtpu)")

# Qwen3-30B-A3B by hand: embeddings and lm_head (vocab × d), final norm, and per layer
# q/o (d × 32 × 128), k/v (d × 4 × 128), q/k norms (128), two norms (d), the router (d × E)
# and E SwiGLU experts (3 × d × 768).
D, V, L, E, K, F = 2048, 151936, 48, 128, 8, 768
PER_LAYER = 2 * D * 32 * 128 + 2 * D * 4 * 128 + 2 * 128 + 2 * D + D * E + E * 3 * D * F
TOTAL = 2 * V * D + D + L * PER_LAYER
ACTIVE = TOTAL - L * (E - K) * 3 * D * F


def test_shipped_config_is_qwen3_30b_a3b():
    config = load_config(CONFIG)
    decoder = decoder_config(config.model)  # /mnt/models/... is not here: the section's keys
    assert (decoder.family, decoder.num_layers, decoder.num_experts,
            decoder.num_experts_per_tok, decoder.moe_intermediate_size) == ("qwen3_moe", L, E,
                                                                            K, F)
    assert decoder.qk_norm and decoder.norm_topk_prob and not decoder.tie_embeddings
    assert decoder.num_experts % config.mesh.expert == 0
    abstract = nnx.eval_shape(lambda: Decoder(decoder, rngs=nnx.Rngs(0)))
    assert count_params(nnx.state(abstract, nnx.Param)) == TOTAL == 30_532_122_624
    assert TOTAL - inactive_expert_params(decoder) == ACTIVE == 3_353_032_704


def _small(tmp_path: Path) -> Path:
    tree = {
        "name": "moe_plan_test",
        "model": dict(family="qwen3_moe", vocab_size=256, hidden_size=128, intermediate_size=256,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=128, scan_layers=True,
                      remat="full", tie_embeddings=False),
        "loss": {"name": "topr", "logprob_chunk_size": 128}, "optim": {"name": "adamw"},
        "mesh": {"data": 1, "fsdp": 2, "expert": 2, "tensor": 1},
        "train": {"batch_size": 8, "max_seq_len": 128},
        "plan": {"platform": "tpu", "topology": "v5e:2x2"},
    }
    path = tmp_path / "moe_plan.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


@needs_libtpu
def test_plan_compiles_a_small_moe_for_v5e_with_an_expert_axis(tmp_path, capsys):
    out_json = tmp_path / "report.json"
    assert main(["plan", "--config", str(_small(tmp_path)), "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "v5e:2x2 (4 tpu devices)" in printed and "active per token" in printed
    report = json.loads(out_json.read_text())
    per_layer = (4 * 128 * 32 * 2 + 2 * 128 * 2 * 32 + 2 * 32 + 2 * 128 + 128 * 8
                 + 8 * 3 * 128 * 128)
    total = 2 * 256 * 128 + 128 + 2 * per_layer
    assert report["platform"] == "tpu" and report["num_params"] == total
    assert report["active_params"] == total - 2 * 6 * 3 * 128 * 128
    assert report["mesh"] == {"data": 1, "fsdp": 2, "expert": 2, "tensor": 1}
    gate = next(a for a in report["largest"] if a["path"] == "params.layers.mlp.gate")
    assert gate["spec"] == "P(None, 'expert', 'fsdp', None)"
    assert gate["device_bytes"] == gate["global_bytes"] // 4  # 4 of 8 experts, half of d
    assert report["fits"] is True


@pytest.mark.slow
@needs_libtpu
def test_qwen3_30b_a3b_compiles_for_v5e_256_and_fits():
    report = make_plan(load_config(CONFIG))
    assert report.platform == "tpu" and report.num_devices == 256
    assert report.mesh == {"data": 1, "fsdp": 32, "expert": 8, "tensor": 1}
    assert report.num_params == TOTAL and report.active_params == ACTIVE
    gate = next(a for a in report.largest if a.path == "params.layers.mlp.gate")
    # float32 masters, 16 of 128 experts per chip and 1/32 of d: 48·16·64·768·4 bytes
    assert gate.spec == "P(None, 'expert', 'fsdp', None)"
    assert gate.device_bytes == L * (E // 8) * (D // 32) * F * 4
    assert report.fits and report.peak_bytes < 16 * GIB
    assert report.attention == "splash"
