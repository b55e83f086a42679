"""experiments/moe_routing_replay.py with `--smoke`, as a user runs it: a subprocess from a
temporary directory. Checked: the PNG and the JSON exist, every number is finite, every
configured (loss, staleness, replay, seed) ran its updates (one row per update in its cell),
and on-policy (s = 0, float32) the trainer routes every sampled token as the sampler did and
π equals μ. The scientific outcome
is measured in experiments/README.md and docs/moe.md, not asserted here."""

from __future__ import annotations

import json
import math

import pytest

from tests.experiments.test_smoke import numbers, run_smoke, smoke_config


@pytest.mark.slow
def test_moe_routing_replay_smoke(tmp_path):
    out = run_smoke("moe_routing_replay.py", tmp_path)
    assert (out / "moe_routing_replay.png").stat().st_size > 1000
    results = json.loads((out / "results.json").read_text())
    assert all(math.isfinite(x) for x in numbers(results))
    cfg = smoke_config("moe_routing_replay")
    arms = {f"{loss}/s{s}/{replay}" for loss in cfg["losses"] for s in cfg["staleness"]
            for replay in ("off", "sampler")}
    assert set(results["arms"]) == arms
    assert results["not_run"] == []
    # at s > 0 the first update trains lag-0 samples, routed alike with and without replay: the
    # same update, so both arms score update 1's batch under the same weights
    paired = results["paired_first_lag"]
    assert set(paired) == {f"{loss}/s{s}/seed{seed}" for loss in cfg["losses"]
                           for s in cfg["staleness"] if s > 0 for seed in cfg["seeds"]}
    assert all(entry["same_routing"] for entry in paired.values()), paired
    for arm, entry in results["arms"].items():
        assert entry["seeds"] == cfg["seeds"], arm
        assert 0.0 <= entry["pass_at_1"]["mean"] <= 1.0
        if "/s0/" in arm:  # sampled by these very weights: the same experts, π = μ
            assert entry["experts_differ"]["mean"] == 0.0, (arm, entry)
            assert entry["log_ratio_abs"]["mean"] < 1e-4, (arm, entry)
    for cell in results["cells"]:
        path = (out / "cells" / f"{cell['loss']}-s{cell['staleness']}-{cell['replay']}"
                f"-seed{cell['seed']}.json")
        rows = json.loads(path.read_text())["rows"]
        assert len(rows) == cfg["updates"], path
        # update u trains a batch min(u, s) updates old: the first is the warm policy's own
        assert rows[0]["experts_differ"] == 0.0 and rows[0]["log_ratio_abs"] < 1e-4, path
