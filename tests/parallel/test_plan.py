"""`jaxrl-llm plan`: compile a small Decoder's train step on abstract inputs and check the
report against the parameter count computed from the architecture."""

from __future__ import annotations

import json

import pytest
import yaml

from jaxrl_llm.cli import main
from jaxrl_llm.config import config_from_dict
from jaxrl_llm.plan import GIB, libtpu_available, make_plan

ARCH = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, tie_embeddings=True, scan_layers=False)
TOKENS = 8 * 16


def expected_params(a=ARCH) -> int:
    """Llama-style decoder: embedding + per layer (q, k, v, o, gate, up, down, 2 norms) + norm."""
    d, f, h, kv, hd = (a["hidden_size"], a["intermediate_size"], a["num_heads"],
                       a["num_kv_heads"], a["head_dim"])
    per_layer = d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * f + 2 * d
    return a["vocab_size"] * d + a["num_layers"] * per_layer + d


def expected_state_bytes(shards: int, a=ARCH) -> float:
    norms = (2 * a["num_layers"] + 1) * a["hidden_size"]
    return 12 * (expected_params() - norms) / shards + 12 * norms


def tree(mesh: dict, plan: dict) -> dict:
    return {
        "name": "plan_test", "model": ARCH,
        "loss": {"name": "topr", "logprob_chunk_size": 128},
        "optim": {"name": "adamw"}, "mesh": mesh,
        "train": {"batch_size": 8, "max_seq_len": 16}, "plan": plan,
    }


def test_plan_on_fake_cpu_devices_matches_parameter_count():
    config = config_from_dict(tree({"data": 1, "fsdp": 8, "tensor": 1},
                                   {"platform": "cpu", "num_devices": 8}))
    report = make_plan(config)
    n = expected_params()
    assert report.num_params == n
    assert report.num_devices == 8 and report.platform == "cpu"
    # fp32 master params + AdamW mu and nu = 12 bytes per parameter, split 8 ways by FSDP,
    # except the RMSNorm scales ("norm" is replicated) and the step counters.
    assert report.state_bytes_per_device == pytest.approx(expected_state_bytes(8), abs=64)
    # Arguments are the state plus this device's rows of the batch.
    assert report.state_bytes_per_device <= report.argument_bytes
    assert report.argument_bytes <= report.state_bytes_per_device + 64 * 1024
    # The donated state is reused for the new state.
    assert report.alias_bytes >= 0.9 * report.state_bytes_per_device
    # A training step does ≥ forward + backward ≈ 6·N·tokens of matmul work in total.
    total = report.flops_per_device * report.num_devices
    assert 0.8 * report.model_flops_6nd < total < 4 * report.model_flops_6nd
    assert report.largest[0].path == "params.embed"
    assert report.largest[0].spec == "P(None, 'fsdp')"


@pytest.mark.skipif(not libtpu_available(), reason="needs the `tpu` extra (PyPI libtpu)")
def test_plan_cli_compiles_for_a_v5e_2x2_topology(tmp_path, capsys):
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(tree({"data": 1, "fsdp": 4, "tensor": 1},
                                        {"platform": "tpu", "topology": "v5e:2x2"})))
    out_json = tmp_path / "report.json"
    assert main(["plan", "--config", str(path), "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "v5e:2x2 (4 tpu devices)" in printed and "fits" in printed
    report = json.loads(out_json.read_text())
    n = expected_params()
    assert report["num_params"] == n
    assert report["platform"] == "tpu" and report["num_devices"] == 4
    assert report["chip_memory_bytes"] == 16 * GIB and report["fits"] is True
    assert report["state_bytes_per_device"] == pytest.approx(expected_state_bytes(4), abs=64)
    assert report["argument_bytes"] >= report["state_bytes_per_device"]
