"""The GPU benchmark scripts, run as a user runs them (a subprocess from a temp directory),
in their CPU-sized forms: so that the day a GPU is there they run unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.mark.slow  # two child processes, each importing jax or torch
def test_gpu_train_step_smoke_runs_both_frameworks_with_micro_batches(tmp_path: Path) -> None:
    out = _run(tmp_path, str(ROOT / "benchmarks" / "gpu_train_step.py"), "--smoke",
               "--micro-batches", "2")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    for fw in ("jax", "torch"):
        assert row[fw]["micro_batches"] == 2, row
        assert row[fw]["tokens_per_s"] > 0 and len(row[fw]["times_s"]) == 1
    assert row["jax_over_torch"] == pytest.approx(
        row["jax"]["tokens_per_s"] / row["torch"]["tokens_per_s"])


@pytest.mark.slow  # two child processes, each compiling or running three workloads
def test_gpu_sampler_smoke_runs_every_workload_in_both_frameworks(tmp_path: Path) -> None:
    _run(tmp_path, str(ROOT / "benchmarks" / "gpu_sampler.py"), "--smoke", "--out", "s.json")
    result = json.loads((tmp_path / "s.json").read_text())
    per = result["shapes"]["tiny"]
    for fw in ("jax", "torch"):
        rows = per[fw]["rows"]
        # greedy: 16 prompts, exactly 128 tokens each; eos_n8: 2 prompts × 8; longtail: 8 × 4
        assert rows["greedy"]["sequences"] == 16 and rows["greedy"]["mean_length"] == 128
        assert rows["eos_n8"]["sequences"] == 16 and rows["longtail"]["sequences"] == 32
        for name, max_new in (("eos_n8", 256), ("longtail", 512)):
            row = rows[name]  # the stop set ends sequences early (mean ≈ 64 / 96 tokens)
            assert 1 <= row["mean_length"] < max_new and row["max_length"] <= max_new, row
            assert row["tokens"] == pytest.approx(row["sequences"] * row["mean_length"])
    for name, ratio in per["ratio"].items():
        assert ratio == pytest.approx(per["jax"]["rows"][name]["tokens_per_s"]
                                      / per["torch"]["rows"][name]["tokens_per_s"])


@pytest.mark.slow  # a 135M-parameter random model, saved and loaded by both frameworks
def test_generate_with_random_weights_agrees_with_transformers_greedy(tmp_path: Path) -> None:
    """`--weights random`: both frameworks load the one checkpoint transformers saved, so in
    float32 our greedy tokens are transformers' (an independent check of the loader and
    sampler, besides the timing), with the default dynamic cache and with the static one."""
    _run(tmp_path, str(ROOT / "benchmarks" / "generate.py"), "--weights", "random",
         "--batch-sizes", "2", "--new-tokens", "6", "--runs", "1", "--out", "gen.json")
    result = json.loads((tmp_path / "gen.json").read_text())
    (row,) = result["rows"]
    assert row["batch"] == 2 and row["new_tokens"] == 6 and row["prompt_tokens"] == 40
    assert row["greedy_token_agreement_row0"] == 1.0
    assert row["greedy_token_agreement_row0_static"] == 1.0
    assert len(row["torch_static_runs"]) == 1 and row["torch_static_seconds"] > 0
    assert "random weights" in result["benchmark"]
    table = (tmp_path / "gen.md").read_text()
    assert "static cache" in table and table.count("×") == 2, table


def test_generate_refuses_eos_with_random_weights(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "generate.py"),
                          "--weights", "random", "--eos"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=600,
                         env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 2 and "--eos" in out.stderr and "random" in out.stderr


@pytest.mark.slow
def test_online_vs_iterate_smoke_times_both_commands(tmp_path: Path) -> None:
    out = _run(tmp_path, str(ROOT / "benchmarks" / "online_vs_iterate.py"), "--smoke",
               "--out", "ovi.json")
    result = json.loads((tmp_path / "ovi.json").read_text())
    assert result == json.loads(out.stdout.strip().splitlines()[-1])
    wall = result["wall_seconds"]
    assert wall["iterate"] > 0 and wall["online"] > 0
    assert result["online_speedup"] == pytest.approx(wall["iterate"] / wall["online"], abs=0.01)
    # both did the work: 2 updates online; iterate ran every stage of both iterations
    assert result["online_phase_seconds"]["updates"] == 2
    assert {"generate", "score", "train"} <= set(result["iterate_stage_seconds"])


@pytest.mark.slow  # four child processes, each importing jax
def test_weight_sync_smoke_checks_every_path_and_labels_the_8b_extrapolation(tmp_path: Path) -> None:
    _run(tmp_path, str(ROOT / "benchmarks" / "weight_sync.py"), "--smoke", "--out", "ws.json")
    result = json.loads((tmp_path / "ws.json").read_text())
    (row,) = result["rows"]
    for path in ("in_memory", "orbax", "safetensors", "exchange"):
        assert row[path]["equal"] is True, path  # the sampler got the trainer's bytes
        assert row[path]["sync_median_s"] > 0
    for path in ("orbax", "safetensors", "exchange"):  # a storage sync: one save, one load
        assert row[path]["sync_median_s"] == pytest.approx(
            row[path]["save_median_s"] + row[path]["load_median_s"])
    qwen, big = result["extrapolated"]
    assert qwen["model"] == "qwen25_15b" and big["model"] == "llama3_8b"
    # Llama-3-8B by hand: untied embedding + head, 32 × (q, o 4096²; k, v 4096 × 1024; three
    # MLP matrices 4096 × 14336; two norms), the final norm
    layer = 2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert big["params"] == 2 * 128256 * 4096 + 32 * layer + 4096 == 8_030_261_248
    assert big["bytes"] == 2 * big["params"] and big["extrapolated_from"] == "tiny"
    assert "EXTRAPOLATION" in result["note"] and "(extrapolated)" in big["label"]
    rate = row["bytes"] / row["orbax"]["sync_median_s"]
    assert big["orbax"]["sync_median_s"] == pytest.approx(big["bytes"] / rate)
    assert "(extrapolated)" in (tmp_path / "ws.md").read_text()


@pytest.mark.slow  # a child process compiling the continuous sampler's programs for 6 arms
def test_multi_turn_sampling_smoke_equal_tokens_and_fed_observations(tmp_path: Path) -> None:
    """The multi-turn benchmark in its tiny form: single-turn samples hold exactly the budget;
    every episode's tokens are its model turns plus one observation per turn but the last
    (so model tokens = tokens − obs × (turns − 1) per episode); episodes do not depend on the
    environment's latency; ratios are the rows' own tokens/s over single-turn's."""
    _run(tmp_path, str(ROOT / "benchmarks" / "multi_turn_sampling.py"), "--smoke",
         "--out", "mt.json")
    result = json.loads((tmp_path / "mt.json").read_text())
    meta, rows = result["meta"], {r["arm"]: r for r in result["rows"]}
    sequences = meta["prompts"] * meta["n"]
    assert set(rows) == {"single", "multi_m8_lat0ms", "multi_m8_lat10ms", "single_handoff",
                         "multi_m8_lat0ms_handoff", "multi_m8_lat10ms_handoff"}
    for name in ("single", "single_handoff"):
        assert rows[name]["tokens"] == rows[name]["model_tokens"] == sequences * meta["new"]
        assert rows[name]["turns_per_episode"] == 1.0 and rows[name]["over_single"] == 1.0
    multi = [r for r in rows.values() if r["mean_turn_tokens"] is not None]
    first = multi[0]
    for r in multi:  # the same episodes whatever the latency (the hand-off's other cache
        # windows may round a draw differently: up to float rounding, sampling/continuous.py)
        same = next(f for f in multi if f["handoff"] == r["handoff"])
        assert (r["tokens"], r["model_tokens"], r["turns_per_episode"]) == (
            same["tokens"], same["model_tokens"], same["turns_per_episode"])
        single = rows["single_handoff" if r["handoff"] else "single"]
        assert r["per_step_over_single"] == pytest.approx(
            r["tokens"] / r["decode_steps"] / (single["tokens"] / single["decode_steps"]))
        assert r["over_single"] == pytest.approx(r["tokens_per_s"] / single["tokens_per_s"])
        assert 0.0 <= r["idle_slot_share"] <= r["steps_with_idle_share"] <= 1.0
    assert first["turns_per_episode"] > 2  # m = 8 in 48 positions: several turns each
    observations = round(sequences * (first["turns_per_episode"] - 1))
    assert first["tokens"] - first["model_tokens"] == meta["obs"] * observations
    assert first["tokens"] <= sequences * meta["new"]
    table = (tmp_path / "mt.md").read_text()
    assert all(f"| {name} |" in table for name in rows), table
    # --reuse redoes the rows and the table from the raw runs alone
    _run(tmp_path, str(ROOT / "benchmarks" / "multi_turn_sampling.py"), "--reuse", "mt.json",
         "--out", "again.json")
    assert json.loads((tmp_path / "again.json").read_text())["rows"] == result["rows"]
    assert (tmp_path / "again.md").read_text() == table
