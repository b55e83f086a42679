"""The offline-epochs comparison on the quickstart testbed (experiments/offline_epochs.py) with
`--smoke`, as a user runs it: a subprocess from a temporary directory. Checked: the PNG and the
JSON exist, every number is finite, each method the registry has ran at every configured
learning rate and seed with one point per probed step, the chosen learning rate is the sweep's
best on validation, fractions lie in [0, 1], ESS is 1 before any update, the names the
registry lacks are the ones reported skipped, the quickstart's policy was built in its own
cache, and the figure redraws from the results copy `--results-dir` wrote. The scientific
outcome is measured in experiments/README.md, not asserted here."""

from __future__ import annotations

import json
import math

import pytest

from experiments import redraw
from jaxrl_llm.losses.registry import LOSS_SPECS
from tests.experiments.test_figures import check_drawn_from, check_seed_labels, sha256_of
from tests.experiments.test_smoke import numbers, run_smoke, smoke_config


@pytest.mark.slow
def test_offline_epochs_smoke(tmp_path):
    out = run_smoke("offline_epochs.py", tmp_path, "--results-dir", str(tmp_path / "results"))
    assert (out / "offline_epochs.png").stat().st_size > 1000
    results = json.loads((out / "results.json").read_text())
    assert all(math.isfinite(x) for x in numbers(results))
    cfg = smoke_config("offline_epochs")
    steps = [0, *range(cfg["eval_every"], cfg["steps"] + 1, cfg["eval_every"])]
    have = [m for m in cfg["methods"] if m in LOSS_SPECS]
    assert have, "the smoke config names no loss the registry has"
    assert sorted(results["methods"]) == sorted(have)
    assert results["skipped_methods"] == [m for m in cfg["methods"] if m not in LOSS_SPECS]
    start = results["start"]
    for method, entry in results["methods"].items():
        assert entry["steps"] == steps, method
        assert entry["trained_steps"] == steps[1:], method
        lrs = [f"{lr:g}" for lr in cfg["learning_rates"]]
        assert sorted(entry["val_pass_at_1_by_lr"]) == sorted(lrs)
        val = entry["val_pass_at_1_by_lr"]
        assert val[f"{entry['best_lr']:g}"] == max(val.values())
        best = entry["runs"][f"lr{entry['best_lr']:g}"]
        assert sorted(best) == sorted(str(s) for s in cfg["seeds"])
        for lr in lrs:
            assert set(entry["runs"][f"lr{lr}"]) >= {str(s) for s in cfg["select_seeds"]}
        for key in ("pass_at_1", "invalid", "dataset_ess_fraction"):
            assert len(entry[key]["mean"]) == len(steps) == len(entry[key]["se"]), (method, key)
            assert all(0.0 <= v <= 1.0 + 1e-9 for v in entry[key]["mean"]), (method, key)
        assert entry["dataset_ess_fraction"]["mean"][0] == 1.0  # π = μ before any update
        assert entry["pass_at_1"]["mean"][0] == start["pass_at_1"]
        # the trainer logs a masked/clipped fraction for these kernels, one per trained probe
        assert entry["clip_metric"] is not None, method
        clip = entry["clip_fraction"]["mean"]
        assert len(clip) == len(steps) - 1 and all(0.0 <= v <= 1.0 for v in clip), method
        assert 0.0 <= entry["final_test_pass_at_1"]["mean"] <= 1.0
    assert results["methods"]["topr"]["ess_metric"] == "loss/ess_fraction"
    # the quickstart's policy was built in its own cache, not the shared char-level one's
    warm = json.loads((out.parent / "warm_policy_quickstart_smoke" / "warm.json").read_text())
    assert warm["testbed"] == "quickstart" and warm["num_params"] > 0
    assert set(warm["splits"]) == {"validation", "test"}
    assert not (out.parent / "warm_policy_smoke" / "warm.json").exists()
    # the results the figure was drawn from, copied beside it and redrawn from the copy: the
    # drawn series are the JSON's and the legend's seed counts are each method's runs
    copy = json.loads((tmp_path / "results" / "offline_epochs.json").read_text())
    assert copy.pop("experiment") == "offline_epochs" and copy == results
    png, fig = redraw.redraw(tmp_path / "results" / "offline_epochs.json", tmp_path / "redrawn")
    assert redraw.png_text(out / "offline_epochs.png")["results_sha256"] == sha256_of(results)
    check_drawn_from(results, fig)
    check_seed_labels("offline_epochs", results, fig)
