"""`staleness.py --merge`: the runs of several invocations' results.json (e.g. part of the grid
on one machine, the rest on another) are summarised together — per (method, s) the seeds of
every part, mean ± SE of the final pass@1 recomputed here by hand — and outputs whose start
differs (another device's numerics or other probe questions) are refused."""

from __future__ import annotations

import json
import math

import pytest

from experiments.staleness import merge

START = {"pass_at_1": 0.32, "pass_at_1_se": 0.04, "invalid": 0.01}
CFG = {"staleness": [0, 256], "updates": 8, "methods": {"topr": {}, "m2po": {}}}


def part(tmp_path, name, finals, device, start=START):
    """results.json of one invocation: method → s → seed → final pass@1 (probes at 4 and 8)."""
    methods = {}
    for method, by_s in finals.items():
        for s, by_seed in by_s.items():
            runs = {str(seed): [{"updates": 0, **start},
                                {"updates": 4, "pass_at_1": 0.3, "invalid": 0.0},
                                {"updates": 8, "pass_at_1": v, "invalid": 0.0}]
                    for seed, v in by_seed.items()}
            methods.setdefault(method, {})[str(s)] = {
                "runs": runs, "lr": 3e-5, "seconds": {str(x): 1.0 for x in by_seed}}
    d = tmp_path / name
    d.mkdir()
    (d / "results.json").write_text(json.dumps(
        {"start": start, "methods": methods, "device": device,
         "lr_sweep": {"topr": {"chosen": 3e-5}}}))
    return d


def test_parts_merge_per_method_and_staleness(tmp_path):
    a = part(tmp_path, "a", {"topr": {0: {0: 0.38}, 256: {0: 0.36}}}, "NVIDIA H200")
    b = part(tmp_path, "b", {"topr": {256: {1: 0.40, 2: 0.41}}, "m2po": {0: {1: 0.30}}}, "cpu")
    merged = merge([a, b], CFG)
    stale = merged["methods"]["topr"]["256"]
    values = [0.36, 0.40, 0.41]
    mean = sum(values) / 3
    se = math.sqrt(sum((v - mean) ** 2 for v in values) / 2 / 3)
    assert stale["seeds"] == 3 and sorted(stale["runs"]) == ["0", "1", "2"]
    assert stale["final_pass_at_1"]["mean"] == pytest.approx(mean)
    assert stale["final_pass_at_1"]["se"] == pytest.approx(se)
    assert stale["final_minus_start"]["mean"] == pytest.approx(mean - 0.32)
    assert merged["methods"]["topr"]["0"]["seeds"] == 1
    assert list(merged["methods"]["m2po"]) == ["0"]  # s = 256 of m2po ran nowhere: absent
    assert merged["device"] == {"topr-s0-seed0": "NVIDIA H200", "topr-s256-seed0": "NVIDIA H200",
                                "topr-s256-seed1": "cpu", "topr-s256-seed2": "cpu",
                                "m2po-s0-seed1": "cpu"}
    assert merged["cells"] == {"runs": 5}


def test_parts_with_another_start_are_refused(tmp_path):
    a = part(tmp_path, "a", {"topr": {0: {0: 0.38}}}, "cpu")
    b = part(tmp_path, "b", {"topr": {0: {1: 0.38}}}, "gpu", start={**START, "pass_at_1": 0.31})
    with pytest.raises(SystemExit, match="start .* differs"):
        merge([a, b], CFG)


def test_grid_selection_and_fixed_rates():
    from types import SimpleNamespace

    from experiments.staleness import select

    cfg = {"seeds": [0, 1, 2], "staleness": [0, 4, 256],
           "methods": {"topr": {"keys": {"baseline": -0.3}}, "m2po": {}, "grpo": {}}}
    args = SimpleNamespace(methods=["topr", "m2po"], staleness=[0, 256], seeds=[1, 2],
                           lr=["topr=3e-5"])
    cut = select(cfg, args)
    assert cut["methods"] == {"topr": {"keys": {"baseline": -0.3}, "lr": 3e-5}, "m2po": {}}
    assert cut["staleness"] == [0, 256] and cut["seeds"] == [1, 2]
    for bad, match in ((dict(lr=["topr:3e-5"]), "expected METHOD=LR"),
                       (dict(methods=["cispo"]), "--methods"),
                       (dict(lr=["cispo=1e-4"]), "--lr"), (dict(seeds=[7]), "--seeds")):
        with pytest.raises(SystemExit, match=match):
            select(cfg, SimpleNamespace(**{**vars(args), **bad}))


def test_lr_sweeps_of_every_part_are_kept():
    """Outputs that swept different methods keep each method's sweep; an output whose rate for
    a method was fixed by --lr (no validation) does not replace that method's sweep."""
    from experiments.staleness import merged_sweeps

    swept_topr = {"validation_pass_at_1": {"3e-05": 0.30, "0.0001": 0.33}, "chosen": 1e-4}
    swept_dppo = {"validation_pass_at_1": {"3e-05": 0.39, "0.0001": 0.37}, "chosen": 3e-5}
    fixed_dppo = {"validation_pass_at_1": {}, "test_pass_at_1": {}, "chosen": 3e-5}
    parts = [{"lr_sweep": {"topr": swept_topr}}, {"lr_sweep": {"dppo": fixed_dppo}},
             {"lr_sweep": {"dppo": swept_dppo}}, {}]
    assert merged_sweeps(parts) == {"topr": swept_topr, "dppo": swept_dppo}
    assert merged_sweeps(parts[:2]) == {"topr": swept_topr, "dppo": fixed_dppo}
