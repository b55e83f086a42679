"""The iterated-loop experiment scripts (TOPR arXiv:2503.14286 §4.3 curation, PKPO
arXiv:2505.15201 k_opt) with `--smoke`, as a user runs them: a subprocess from a temporary
directory, sharing one smoke warm policy (`--cache`). Checked: the PNG and the JSON exist,
every number is finite, every arm has one row per iteration (plus π_0) for every seed, the
composition each curation promises, and pass@k for every k ≤ eval n. The scientific outcome
is measured in experiments/README.md, not asserted here."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.xla_flags import ONE_DEVICE

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("warm_policy_smoke")


def run_smoke(script: str, cwd: Path, cache: Path) -> tuple[Path, dict]:
    out = cwd / "out" / Path(script).stem
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = ONE_DEVICE  # one CPU device, as on a user's machine
    proc = subprocess.run(
        [sys.executable, str(EXPERIMENTS / script), "--smoke", "--out", "out/" + out.name,
         "--cache", str(cache)],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{script}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert (out / f"{out.name}.png").stat().st_size > 1000
    results = json.loads((out / "results.json").read_text())
    assert all(math.isfinite(x) for x in numbers(results))
    return out, results


def numbers(obj) -> list[float]:
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in numbers(v)]
    if isinstance(obj, list):
        return [x for v in obj for x in numbers(v)]
    return [float(obj)] if isinstance(obj, int | float) and not isinstance(obj, bool) else []


def smoke_config(name: str) -> dict:
    return yaml.safe_load((EXPERIMENTS / f"{name}.yaml").read_text())["smoke"]


def check_arms(results: dict, cfg: dict, names: list[str]) -> None:
    assert list(results["arms"]) == names
    seeds = [str(s) for s in cfg["seeds"]]
    assert sorted(results["initial"]) == sorted(seeds)
    iterations = list(range(cfg["iterations"] + 1))
    ks = [str(k) for k in range(1, cfg["eval_n"] + 1)]
    for name, entry in results["arms"].items():
        assert entry["iteration"] == iterations, name
        assert sorted(entry["runs"]) == sorted(seeds), name
        for key in ("pass_at_1", "invalid"):
            assert len(entry[key]["mean"]) == len(iterations) == len(entry[key]["se"])
            assert all(0.0 <= v <= 1.0 for v in entry[key]["mean"]), (name, key)
        assert sorted(entry["pass_at_k"], key=int) == ks, name
        for seed in seeds:
            run = entry["runs"][seed]
            # row 0 is π_0, evaluated once per seed and shared by every arm
            assert run["rows"][0] == results["initial"][seed]
            assert len(run["rows"]) == len(iterations) and len(run["curated"]) == len(iterations) - 1
            for r in run["rows"]:  # pass@k is non-decreasing in k and pass@1 is its k = 1
                curve = [r["pass_at_k"][k] for k in ks]
                assert all(b >= a - 1e-9 for a, b in zip(curve, curve[1:]))
                assert curve[0] == pytest.approx(r["pass_at_1"])


@pytest.mark.slow
def test_topr_curation_smoke(tmp_path, cache):
    _, results = run_smoke("topr_curation.py", tmp_path, cache)
    cfg = smoke_config("topr_curation")
    check_arms(results, cfg, cfg["curations"])
    for seed, run in results["arms"]["positives"]["runs"].items():
        assert all(c["negatives"] == 0 and c["positives"] > 0 for c in run["curated"]), seed
    for name in ("uniform", "anna_karenina"):  # the iteration budget
        for run in results["arms"][name]["runs"].values():
            assert all(c["num_records"] == cfg["num_records"] for c in run["curated"]), name
    # Anna Karenina keeps at most one positive per prompt
    for run in results["arms"]["anna_karenina"]["runs"].values():
        assert all(c["positives"] <= cfg["num_prompts"] for c in run["curated"])


@pytest.mark.slow
def test_pkpo_iterated_smoke(tmp_path, cache):
    _, results = run_smoke("pkpo_iterated.py", tmp_path, cache)
    cfg = smoke_config("pkpo_iterated")
    check_arms(results, cfg, [*(f"k={k}" for k in cfg["ks"]), "anneal"])
    # the anneal's k_opt per iteration, as `iterate` wrote it into each curated manifest
    run_dir = tmp_path / "out" / "pkpo_iterated" / "runs" / f"anneal-seed{cfg['seeds'][0]}"
    used = [json.loads((run_dir / f"iter_{i}" / "curated" / "manifest.json").read_text())
            ["extra"]["curation"]["pkpo_k"] for i in range(1, cfg["iterations"] + 1)]
    assert used == cfg["anneal"][:cfg["iterations"]]
