"""`jaxrl-llm plan` compiles the library's own sampler (issue 54): for an online config it also
compiles the continuous sampler's decode and prefill programs in the decode layout the sampler
derives, for the sampler's own devices (`online.sampler_devices`), and reports per-chip memory
for each side. The per-chip KV bytes are checked against the cache size computed from the
architecture and the sampler's sizes, divided by the slot groups × tensor."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from jaxrl_llm.plan import libtpu_available

ARCH = dict(source="random", vocab_size=256, hidden_size=64, intermediate_size=128,
            num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, tie_embeddings=True,
            max_position_embeddings=256, param_dtype="float32", compute_dtype="bfloat16")


def config(plan: dict, **online) -> dict:
    return {"name": "plan_sampler", "model": ARCH, "loss": {"name": "topr"},
            "optim": {"name": "adamw"}, "mesh": {"data": -1, "fsdp": 1, "tensor": 1},
            "train": {"batch_size": 8, "max_seq_len": 96},
            "generate": {"n": 4, "batch_size": 8, "max_new_tokens": 64, "prefill_chunk": 32},
            "data": {"task": "arithmetic"}, "plan": plan,
            "online": {"rounds": 2, "prompts_per_round": 2, **online}}


def run_plan(tmp_path, tree: dict, *extra: str) -> dict:
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(tree))
    done = subprocess.run([sys.executable, "-m", "jaxrl_llm.cli", "plan", "--config", "c.yaml",
                           "--json", "out/plan.json", *extra], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "sampler (the continuous sampler's own decode and prefill programs)" in done.stdout
    if "sampler_devices" in str(tree["online"]):
        assert "(8 tpu devices: 4 train, 4 sample)" in done.stdout
    return json.loads((tmp_path / "out/plan.json").read_text())


def kv_bytes(slots: int, gen: int, rows: int, width: int, itemsize: int = 2) -> int:
    """Keys + values of every layer: the slots' generated cache and the prompt rows (store +
    staging), bfloat16 (the compute dtype)."""
    per_token = 2 * ARCH["num_layers"] * ARCH["num_kv_heads"] * ARCH["head_dim"] * itemsize
    return per_token * (slots * gen + rows * width)


@pytest.mark.skipif(not libtpu_available(), reason="needs the `tpu` extra (PyPI libtpu)")
def test_plan_compiles_the_sampler_for_its_own_chips_of_a_v5e_topology(tmp_path):
    """v5e:2x4, 8 chips: 4 sample (online.sampler_devices), 4 train; then decode_data ×
    decode_tensor = 2 × 2 on the sampler's 4 chips."""
    report = run_plan(tmp_path, config({"platform": "tpu", "topology": "v5e:2x4"},
                                       sampler_devices=4, pipeline="deterministic",
                                       staleness=1))
    assert report["num_devices"] == 4 and report["sampler_split"]  # the trainer's
    assert report["mesh"]["data"] == 4
    s = report["sampler"]
    assert (s["devices"], s["groups"], s["tensor"]) == (4, 4, 1)
    assert s["slots"] == 32 and s["max_new_tokens"] == 64 and s["prompt_width"] == 32
    total = kv_bytes(32, 64, s["prompt_rows"] + s["staging_rows"], s["prompt_width"])
    assert s["kv_bytes_per_chip"] == total // 4
    # weights in the sampling dtype (bf16) although the trainer keeps float32 masters
    assert s["weight_bytes_per_chip"] < 2 * 4 * 200_000 // 2
    assert s["decode"]["temp"] > 0 and s["chip_memory_bytes"] == 16 * 2**30

    tp = run_plan(tmp_path, config({"platform": "tpu", "topology": "v5e:2x4"},
                                   sampler_devices=4, pipeline="deterministic", staleness=1),
                  "generate.decode_data=2", "generate.decode_tensor=2")["sampler"]
    assert (tp["groups"], tp["tensor"]) == (2, 2)
    # heads split over tensor, slots over data (fewer groups: other per-group store rows)
    rows = tp["prompt_rows"] + tp["staging_rows"]
    assert tp["kv_bytes_per_chip"] == kv_bytes(32, 64, rows, tp["prompt_width"]) // 4


def test_plan_refuses_a_decode_layout_larger_than_the_sampler_chips(tmp_path):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config(
        {"platform": "cpu", "num_devices": 4})))
    done = subprocess.run([sys.executable, "-m", "jaxrl_llm.cli", "plan", "--config", "c.yaml",
                           "generate.decode_data=4", "generate.decode_tensor=2"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    assert "generate.decode_data=4 × generate.decode_tensor=2 = 8 devices, more than the 4" in (
        done.stdout + done.stderr)
