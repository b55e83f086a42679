"""`offline_epochs.py --methods`: only the named methods run, and their entries are merged into
the previous results.json, whose other methods' entries are kept unchanged; a previous file
written under another protocol is refused. `--merge DIR ...` joins outputs run side by side
with disjoint methods, refusing another protocol, start or dataset, or a method twice."""

from __future__ import annotations

import copy
import json

import pytest

from experiments.offline_epochs import merge, merge_outputs, select_methods

CFG = {"seeds": [0, 1, 2], "learning_rates": [3e-5, 1e-4],
       "methods": {"topr": {"baseline": -0.3}, "ppo": {"clip_eps": 0.2}, "cispo": {},
                   "vespo": {}},
       "clip_metric": {"topr": "loss/clip_frac_neg_high", "cispo": "loss/clip_frac_high"}}
START = {"pass_at_1": 0.338}


def previous() -> dict:
    cfg = copy.deepcopy(CFG)
    del cfg["clip_metric"]["cispo"]  # a per-method setting of a rerun method may change
    return {"config": cfg, "start": START, "seconds": 100.0, "datasets": {"0": {"n": 1}},
            "methods": {"topr": {"best_lr": 1e-4}, "ppo": {"best_lr": 3e-4}},
            "skipped_methods": ["cispo", "vespo"]}


def test_select_methods():
    runnable = dict(CFG["methods"])
    assert select_methods(runnable, None, CFG) == runnable
    assert list(select_methods(runnable, ["vespo", "cispo"], CFG)) == ["cispo", "vespo"]
    with pytest.raises(SystemExit):
        select_methods(runnable, ["nope"], CFG)


def test_merge_keeps_the_other_methods():
    new = {"config": CFG, "start": START, "datasets": {"1": {"n": 2}}, "skipped_methods": [],
           "methods": {"cispo": {"best_lr": 3e-5}, "vespo": {"best_lr": 1e-4}}}
    merged = merge(previous(), new, CFG)
    assert list(merged["methods"]) == ["topr", "ppo", "cispo", "vespo"]  # the config's order
    assert merged["methods"]["topr"] == previous()["methods"]["topr"]
    assert merged["methods"]["cispo"] == {"best_lr": 3e-5}
    assert merged["skipped_methods"] == []
    assert merged["datasets"] == {"0": {"n": 1}, "1": {"n": 2}}
    assert merged["merged"] == {"kept_from_previous": ["topr", "ppo"],
                                "rerun": ["cispo", "vespo"], "previous_seconds": 100.0}
    partial = merge(previous(), {**new, "methods": {"vespo": {}}}, CFG)
    assert partial["skipped_methods"] == ["cispo"]


def test_merge_refuses_another_protocol():
    new = {"config": CFG, "start": START, "datasets": {}, "methods": {"cispo": {}}}
    for change in ({"seeds": [0]}, {"methods": {**CFG["methods"], "topr": {"baseline": 0}}}):
        old = {**previous(), "config": {**previous()["config"], **change}}
        with pytest.raises(SystemExit):
            merge(old, new, CFG)


def write_part(path, methods: dict, **change) -> object:
    path.mkdir()
    part = {"config": CFG, "start": START, "datasets": {"0": {"positive_fraction": 0.2}},
            "methods": methods, "seconds": 10.0, "cpu_seconds": 15.0, **change}
    (path / "results.json").write_text(json.dumps(part))
    return path


def test_merge_outputs_joins_disjoint_methods(tmp_path):
    a = write_part(tmp_path / "a", {"cispo": {"best_lr": 3e-5}, "topr": {"best_lr": 1e-4}})
    b = write_part(tmp_path / "b", {"vespo": {"best_lr": 1e-4}},
                   datasets={"0": {"positive_fraction": 0.2}, "1": {"positive_fraction": 0.3}})
    merged = merge_outputs([a, b], CFG)
    assert list(merged["methods"]) == ["topr", "cispo", "vespo"]  # the config's order
    assert merged["methods"]["vespo"] == {"best_lr": 1e-4}
    assert merged["skipped_methods"] == ["ppo"]
    assert merged["datasets"] == {"0": {"positive_fraction": 0.2}, "1": {"positive_fraction": 0.3}}
    assert [p["methods"] for p in merged["merged_from"]] == [["cispo", "topr"], ["vespo"]]
    assert merged["merged_from"][1]["seconds"] == 10.0


@pytest.mark.parametrize("change", [
    {"start": {"pass_at_1": 0.25}},                                   # another μ or probe
    {"datasets": {"0": {"positive_fraction": 0.21}}},                 # another dataset
    {"config": {**CFG, "seeds": [0]}},                                # another protocol
    {"config": {**CFG, "methods": {**CFG["methods"], "vespo": {"x": 1}}}},  # vespo ran otherwise
    {"methods": {"topr": {"best_lr": 3e-5}}},                         # topr twice
])
def test_merge_outputs_refuses(tmp_path, change):
    a = write_part(tmp_path / "a", {"topr": {"best_lr": 1e-4}})
    b = write_part(tmp_path / "b", **{"methods": {"vespo": {"best_lr": 1e-4}}, **change})
    with pytest.raises(SystemExit):
        merge_outputs([a, b], CFG)
