"""The offline-dataset experiments (TOPR Fig. 5/6 baseline sweep, FPA training dynamics, TOPR
ratio levels) with `--smoke`, as a user runs them: a subprocess from a temporary directory.
Checked: the PNG and the JSON exist, every number is finite, each curve has one point per
configured step / target, and quantities with a known range lie in it (p̃ ∈ [0, 1] and equal
to TOPR eq. 12 at the baseline used; counts ≥ 0). The scientific outcome is measured in
experiments/README.md, not asserted here."""

from __future__ import annotations

import json
import math

import pytest

from tests.experiments.test_smoke import numbers, run_smoke, smoke_config

TESTBEDS = ["char", "quickstart"]  # experiments/testbed.py


@pytest.fixture(scope="module")
def quickstart_cache(tmp_path_factory):
    """One smoke quickstart policy for this module's quickstart runs (the first builds it)."""
    return tmp_path_factory.mktemp("quickstart") / "warm_policy_quickstart_smoke_sft"


def run_testbed(script: str, tmp_path, testbed: str, cache):
    """The script's smoke run on `testbed`, and its smoke section's config."""
    extra = ("--testbed", "quickstart", "--cache", str(cache)) if testbed == "quickstart" \
        else ()
    out = run_smoke(script, tmp_path, *extra)
    section = "smoke_quickstart" if testbed == "quickstart" else "smoke"
    return out, smoke_config(script.removesuffix(".py"), section)


def check_testbed(out, results: dict, cfg: dict, testbed: str) -> None:
    """The char policy came from its default cache, the quickstart one from the module's
    (`--cache`); a quickstart run chose each swept arm's learning rate as the best
    validation pass@1 of the configured rates."""
    assert (out.parent / "warm_policy_smoke" / "warm.json").exists() == (testbed == "char")
    if testbed == "quickstart":
        assert results["warm_policy"]["sft_overrides"] == cfg["smoke_sft"]
        assert results["warm_policy"]["testbed"] == "quickstart"
        assert results["lr_sweeps"]
        for sweep in results["lr_sweeps"].values():
            val = sweep["val_pass_at_1_by_lr"]
            assert sorted(val) == sorted(f"{lr:g}" for lr in cfg["learning_rates"])
            assert val[f"{sweep['best_lr']:g}"] == max(val.values())


def read(out, name: str, testbed: str = "char") -> dict:
    png = out / (f"{name}_quickstart.png" if testbed == "quickstart" else f"{name}.png")
    assert png.stat().st_size > 1000
    results = json.loads((out / "results.json").read_text())
    assert all(math.isfinite(x) for x in numbers(results))
    return results


def eq12(p: float, c: float) -> float:
    """TOPR eq. 12, transcribed: p̃ = p(1 − c) / (p(1 − c) + (1 − p)(1 + c))."""
    return p * (1 - c) / (p * (1 - c) + (1 - p) * (1 + c))


@pytest.mark.slow
@pytest.mark.parametrize("testbed", TESTBEDS)
def test_topr_baseline_smoke(tmp_path, testbed, quickstart_cache):
    out, cfg = run_testbed("topr_baseline.py", tmp_path, testbed, quickstart_cache)
    results = read(out, "topr_baseline", testbed)
    check_testbed(out, results, cfg, testbed)
    assert sorted(results["datasets"]) == sorted(f"{round(f * 100)}p" for f in cfg["fractions"])
    for name, entry in results["datasets"].items():
        for info in entry["seeds"].values():
            # the curated fraction is the asked one, to the nearest record
            target = int(name[:-1]) / 100
            assert abs(info["positive_fraction"] - target) <= 0.5 / cfg["num_records"] + 1e-9
            assert len(info["baselines"]) == len(cfg["targets"])
            for t, c in zip(cfg["targets"], info["baselines"], strict=True):
                assert -1.0 <= c <= 1.0
                assert eq12(info["positive_fraction"], c) == pytest.approx(t, abs=1e-4)
        assert sorted(entry["losses"]) == sorted(cfg["losses"])
        for loss, summary in entry["losses"].items():
            for key in ("pass_at_1", "invalid", "p_tilde_logged"):
                assert len(summary[key]["mean"]) == len(cfg["targets"]), (name, loss, key)
                assert all(0.0 <= v <= 1.0 for v in summary[key]["mean"]), (name, loss, key)
            for rows in summary["runs"].values():
                for t, row in zip(cfg["targets"], rows, strict=True):
                    if cfg.get("lr_select") == "arm":  # each arm trained at its own choice
                        sweep = results["lr_sweeps"][f"{name} p̃={t:g} {loss}"]
                        assert row["learning_rate"] == sweep["best_lr"]
                    # every record of a batch has the dataset's reward mix; the logged p̃ is
                    # eq. 12 of the batch's own positive fraction, so it is near the target
                    # only on average; p̃ = 1 (c = −1, negatives weightless) is exact
                    if t == 1.0:
                        assert row["p_tilde_logged"] == pytest.approx(1.0)
                    assert row["p_tilde_eq12"] == pytest.approx(t, abs=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("testbed", TESTBEDS)
def test_fpa_dynamics_smoke(tmp_path, testbed, quickstart_cache):
    out, cfg = run_testbed("fpa_dynamics.py", tmp_path, testbed, quickstart_cache)
    results = read(out, "fpa_dynamics", testbed)
    check_testbed(out, results, cfg, testbed)
    steps = [0, *range(cfg["eval_every"], cfg["steps"] + 1, cfg["eval_every"])]
    assert sorted(results["variants"]) == sorted(cfg["variants"])
    for name, entry in results["variants"].items():
        assert entry["steps"] == steps, name
        for key in ("pass_at_1", "invalid", "diff_correct", "diff_incorrect", "count_below",
                    "probe_below_incorrect"):
            assert len(entry[key]["mean"]) == len(steps), (name, key)
        # before the first update π = π_ref: the probe's forward reproduces the log-probs
        # `jaxrl-llm score` wrote (a different code path: jitted batch vs the score command)
        assert abs(entry["diff_correct"]["mean"][0]) < 1e-3
        assert abs(entry["diff_incorrect"]["mean"][0]) < 1e-3
        counts = entry["count_below"]["mean"]
        assert all(b >= a >= 0 for a, b in zip(counts, counts[1:])), name  # cumulative
        for seed, run in entry["runs"].items():
            n_incorrect = results["datasets"][seed]["probe_incorrect"]
            assert all(0 <= r["probe_below_incorrect"] <= n_incorrect for r in run["rows"])


@pytest.mark.slow
def test_topr_ratio_level_smoke(tmp_path):
    out = run_smoke("topr_ratio_level.py", tmp_path)
    results = read(out, "topr_ratio_level")
    cfg = smoke_config("topr_ratio_level")
    steps = [0, *range(cfg["eval_every"], cfg["steps"] + 1, cfg["eval_every"])]
    assert sorted(results["levels"]) == sorted(cfg["ratio_levels"])
    for level, entry in results["levels"].items():
        assert entry["steps"] == steps, level
        assert entry["trained_steps"] == steps[1:]
        for key in ("loss/clip_frac_neg_high", "loss/ess_fraction"):
            assert len(entry[key]["mean"]) == len(steps) - 1
            assert all(0.0 <= v <= 1.0 + 1e-6 for v in entry[key]["mean"]), (level, key)
    # the long-task policy was built in its own cache, not the shared one-operation policy's
    assert (out.parent / "warm_policy_smoke_long" / "warm.json").exists()
    assert not (out.parent / "warm_policy_smoke" / "warm.json").exists()
