"""Each experiment script with `--smoke`, as a user runs it: a subprocess from a temporary
directory. Checked: the PNG and the JSON exist, every number in the JSON is finite, and the
curves have one point per configured step/θ/k. The scientific outcome is measured in
experiments/README.md, not asserted here."""

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


def run_smoke(script: str, cwd: Path, *extra: str) -> Path:
    out = cwd / "out" / Path(script).stem
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = ONE_DEVICE  # one CPU device, as on a user's machine
    proc = subprocess.run([sys.executable, str(EXPERIMENTS / script), "--smoke", "--out", str(out),
                           *extra],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{script}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return out


def numbers(obj) -> list[float]:
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in numbers(v)]
    if isinstance(obj, list):
        return [x for v in obj for x in numbers(v)]
    return [float(obj)] if isinstance(obj, int | float) and not isinstance(obj, bool) else []


def smoke_config(name: str, section: str = "smoke") -> dict:
    return yaml.safe_load((EXPERIMENTS / f"{name}.yaml").read_text())[section]


def test_pkpo_variance_smoke(tmp_path):
    out = run_smoke("pkpo_variance.py", tmp_path)
    assert (out / "pkpo_variance.png").stat().st_size > 1000
    results = json.loads((out / "results.json").read_text())
    assert all(math.isfinite(x) for x in numbers(results))
    cfg = smoke_config("pkpo_variance")
    by_theta, by_k = results["by_theta"], results["by_k"]
    assert len(by_theta["theta"]) == cfg["num_thetas"]
    for name in ("s", "sloo", "sloo_minus_one"):
        assert len(by_theta[name]["variance"]) == cfg["num_thetas"]
        assert all(v >= 0 for v in by_theta[name]["variance"])
        # sloo needs k ≤ n − 1; the others take every k
        expected_k = [k for k in cfg["ks"] if name != "sloo" or k <= cfg["n"] - 1]
        assert by_k[name]["k"] == expected_k


@pytest.mark.slow
def test_topr_offline_smoke(tmp_path):
    out = run_smoke("topr_offline.py", tmp_path)
    assert (out / "topr_offline.png").stat().st_size > 1000
    results = json.loads((out / "results.json").read_text())
    assert all(math.isfinite(x) for x in numbers(results))
    cfg = smoke_config("topr_offline")
    steps = [0, *range(cfg["eval_every"], cfg["steps"] + 1, cfg["eval_every"])]
    assert sorted(results["losses"]) == sorted(cfg["losses"])
    for loss, entry in results["losses"].items():
        assert entry["steps"] == steps, loss
        for key in ("pass_at_1", "invalid"):
            assert len(entry[key]["mean"]) == len(steps) == len(entry[key]["se"])
            assert all(0.0 <= v <= 1.0 for v in entry[key]["mean"]), (loss, key)
        assert sorted(entry["runs"]) == sorted(str(s) for s in cfg["seeds"])
    # the shared warm policy was built once, in the cache beside the output directory
    assert (out.parent / "warm_policy_smoke" / "warm.json").exists()
