"""The online experiments on the quickstart testbed (experiments/staleness.py,
experiments/pkpo_online.py and experiments/testbed_bar.py) with `--smoke`, as a user runs them:
a subprocess from a temporary directory. Checked: the PNG and the JSON exist, every number is
finite, every configured (method, s, seed) ran with one probe per `eval_every` updates ending at
the last update, the first point is the start (the same for every run), the count of updates
trained on the initial policy's samples is s + 1, TOPR's logged fractions lie in [0, 1], the
on-policy run's log π − log μ stays ~0 while the stale run's does not, and pass@k is monotone in
k. The scientific outcome is measured in experiments/README.md, not asserted here."""

from __future__ import annotations

import json
import math

import pytest

from tests.experiments.test_smoke import numbers, run_smoke, smoke_config


@pytest.mark.slow
def test_staleness_smoke(tmp_path):
    out = run_smoke("staleness.py", tmp_path)
    assert (out / "staleness.png").stat().st_size > 1000
    results = json.loads((out / "results.json").read_text())
    assert all(math.isfinite(x) for x in numbers(results))
    cfg = smoke_config("staleness")
    probes = [0, *range(cfg["eval_every"], cfg["updates"] + 1, cfg["eval_every"])]
    assert sorted(results["methods"]) == sorted(cfg["methods"])
    for method, by_s in results["methods"].items():
        assert sorted(by_s, key=int) == [str(s) for s in cfg["staleness"]]
        for s, entry in by_s.items():
            assert entry["updates"] == probes, (method, s)
            assert sorted(entry["runs"]) == [str(x) for x in cfg["seeds"]]
            assert entry["pass_at_1"]["mean"][0] == results["start"]["pass_at_1"]
            assert entry["updates_on_initial_policy_samples"] == min(int(s) + 1, cfg["updates"])
            assert 0.0 <= entry["final_pass_at_1"]["mean"] <= 1.0
            keys = {"topr": ("loss/ess_fraction", "loss/clip_frac_neg_high"),
                    "m2po": ("loss/masked_frac",)}[method]
            for key in keys:
                assert len(entry[key]["mean"]) == len(probes) - 1, (method, s, key)
                assert all(0.0 <= v <= 1.0 + 1e-6 for v in entry[key]["mean"]), (method, s, key)
            assert entry["lr"] == results["lr_sweep"][method]["chosen"]
        # on-policy (s = 0, one update per round): π = μ at every update; stale: not after θ0
        on, stale = by_s["0"]["loss/log_ratio_max"]["mean"], by_s[str(max(cfg["staleness"]))]
        assert all(abs(v) < 1e-4 for v in on), on
        if method == "topr":  # (GRPO-advantage losses do not move on a group of equal rewards)
            assert abs(stale["loss/log_ratio_max"]["mean"][-1]) > 1e-4  # max log π − log μ: ±
    # the lr sweep: m2po (no fixed lr) ran every rate at s = 0 and took the best on validation
    sweep = results["lr_sweep"]["m2po"]
    rates = [f"{lr:g}" for lr in cfg["lr_sweep"]["learning_rates"]]
    assert sorted(sweep["validation_pass_at_1"]) == sorted(rates)
    best = max(sweep["validation_pass_at_1"].values())
    assert sweep["validation_pass_at_1"][f"{sweep['chosen']:g}"] == best
    assert results["lr_sweep"]["topr"]["chosen"] == cfg["methods"]["topr"]["lr"]  # fixed: not swept
    cells = sorted(p.stem for p in (out / "cells").glob("*.json"))
    assert len(cells) == results["cells"]["finished"] == results["cells"]["planned"]
    assert len(cells) == len(rates) + len(cfg["staleness"]) * 2 - 1  # the sweep's best run reused


@pytest.mark.slow
def test_pkpo_online_smoke(tmp_path):
    out = run_smoke("pkpo_online.py", tmp_path)
    assert (out / "pkpo_online.png").stat().st_size > 1000
    results = json.loads((out / "results.json").read_text())
    assert all(math.isfinite(x) for x in numbers(results))
    cfg = smoke_config("pkpo_online")
    assert sorted(results["arms"]) == sorted([*(f"k={k}" for k in cfg["ks"]), "anneal"])
    assert results["schedules"]["anneal"] == cfg["anneal"]
    probes = [0, *range(cfg["eval_every"], cfg["updates"] + 1, cfg["eval_every"])]
    for arm, entry in results["arms"].items():
        assert entry["updates"] == probes, arm
        assert sorted(entry["pass_at_k"], key=int) == [str(k) for k in range(1, cfg["eval_n"] + 1)]
        for i in range(len(probes)):
            curve = [entry["pass_at_k"][str(k)]["mean"][i] for k in range(1, cfg["eval_n"] + 1)]
            assert all(0.0 <= a <= b + 1e-9 <= 1.0 + 1e-9 for a, b in zip(curve, curve[1:])), arm
        assert entry["pass_at_k"]["1"]["mean"][0] == results["start"]["pass_at_1"]
    # every arm's lr is the best of its sweep on validation pass@k at its last k (anneal: 1)
    rates = cfg["lr_sweep"]["learning_rates"]
    for arm, entry in results["lr_sweep"].items():
        k = 1 if arm == "anneal" else int(arm.split("=")[1])
        assert entry["objective"] == f"pass_at_{k}"
        scores = {float(r): v for r, v in entry["validation"].items()}
        assert sorted(scores) == sorted(rates)
        assert scores[entry["chosen"]] == max(scores.values())
        assert results["arms"][arm]["lr"] == entry["chosen"]
    assert set(results["lr_sweep"]) == set(results["arms"])
    assert 0.0 <= results["start_validation"]["pass_at_1"] <= 1.0


@pytest.mark.slow
def test_testbed_bar_smoke(tmp_path):
    """experiments/testbed_bar.py: every method × seed ran to the last update; each run's and
    μ's per-question pass rates average to its reported pass@1; the change and both SEs equal
    a direct recomputation from the stored per-question rates (statistics.stdev)."""
    import statistics

    out = run_smoke("testbed_bar.py", tmp_path)
    assert (out / "testbed_bar.png").stat().st_size > 1000
    results = json.loads((out / "results.json").read_text())
    assert all(math.isfinite(x) for x in numbers(results))
    cfg = smoke_config("testbed_bar")
    start = results["start"]
    assert len(start["per_question"]) == cfg["eval_questions"]
    assert 0 < sum(start["per_question"]) < len(start["per_question"])  # the checks below bite
    assert statistics.fmean(start["per_question"]) == pytest.approx(start["pass_at_1"])
    assert sorted(results["methods"]) == sorted(cfg["methods"])
    for method, entry in results["methods"].items():
        assert sorted(entry["runs"]) == [str(s) for s in cfg["seeds"]]
        finals = []
        for run in entry["runs"].values():
            assert run["updates"] == cfg["updates"]
            assert statistics.fmean(run["per_question"]) == pytest.approx(run["pass_at_1"])
            assert all(0.0 <= v <= 1.0 for v in run["per_question"])
            finals.append(run["per_question"])
        by_seed = [statistics.fmean(f) - start["pass_at_1"] for f in finals]
        d = [statistics.fmean(col) - s for col, s in zip(zip(*finals), start["per_question"])]
        assert entry["change"] == pytest.approx(statistics.fmean(d))
        assert entry["per_seed_change"] == pytest.approx(by_seed)
        assert entry["se_seeds"] == pytest.approx(statistics.stdev(by_seed) / len(by_seed) ** 0.5)
        assert entry["se_questions_paired"] == pytest.approx(statistics.stdev(d) / len(d) ** 0.5)
        assert entry["lr"] == cfg["methods"][method]["lr"]


@pytest.mark.slow
def test_free_running_smoke(tmp_path):
    """experiments/free_running.py: every (loss, arm, seed) ran its updates, probed at each
    `eval_every` on a clock that only moves forward; the serial run trains every sample at lag
    0, a free run none beyond its max_staleness, and every run's samples add up (trained =
    updates × batch, received ≥ trained + dropped); the summary's final pass@1 is the mean of
    the per-seed values (recomputed here)."""
    import statistics

    out = run_smoke("free_running.py", tmp_path)
    assert (out / "free_running.png").stat().st_size > 1000
    results = json.loads((out / "results.json").read_text())
    assert all(math.isfinite(x) for x in numbers(results))
    cfg = smoke_config("free_running")
    batch = cfg["prompts_per_round"] * cfg["n"] // cfg["updates_per_round"]
    probes = list(range(cfg["eval_every"], cfg["updates"] + 1, cfg["eval_every"]))
    assert results["config"]["seeds"] == cfg["seeds"]
    assert sorted(results["methods"]) == sorted(cfg["methods"])
    for method, arms in results["methods"].items():
        assert list(arms) == ["serial", *(f"free-{s}" for s in cfg["max_staleness"])]
        for arm, entry in arms.items():
            assert entry["updates"] == [0, *probes], (method, arm)
            assert entry["pass_at_1"]["mean"][0] == results["start"]["pass_at_1"]
            assert sorted(entry["runs"]) == [str(s) for s in cfg["seeds"]]
            finals = []
            for run in entry["runs"].values():
                rows = run["rows"]
                assert [r["updates"] for r in rows] == probes
                for key in ("wall_s", "cpu_s"):
                    clock = [0.0, *(r[key] for r in rows), run["end"][key]]
                    assert all(a < b for a, b in zip(clock, clock[1:])), (method, arm, key)
                samples = run["samples"]
                assert samples["trained"] == cfg["updates"] * batch
                assert samples["received"] >= samples["trained"] + samples["dropped"]
                assert sum(run["lag_hist"].values()) == samples["trained"]
                bound = 0 if arm == "serial" else int(arm.split("-")[1])
                assert max(int(lag) for lag in run["lag_hist"]) <= bound, (method, arm)
                if arm == "serial":
                    assert samples["dropped"] == 0
                finals.append(rows[-1]["pass_at_1"])
            assert entry["final_pass_at_1"]["mean"] == pytest.approx(statistics.fmean(finals))


@pytest.mark.slow
def test_free_running_control_smoke(tmp_path):
    """experiments/free_running_control.py: every (loss, arm, seed) trained its updates with
    one optimizer step each and the configured constant rate, probed at the same optimizer
    steps in every arm. What each arm trains, checked against its definition from the
    records of every update: serial and serial-b train round u at update u with lag 0, serial-b
    on other draws from its first update on (another sampling stream); lag-s trains the serial
    run's rounds with lag min(u, s), its first update on the very draws the serial run trained
    (θ0, the same prompts and sampling seed); free-s within its bound. The summary's paired
    differences are the per-seed arm − serial values (recomputed here)."""
    import statistics

    out = run_smoke("free_running_control.py", tmp_path)
    assert (out / "free_running_control.png").stat().st_size > 1000
    results = json.loads((out / "results.json").read_text())
    assert all(math.isfinite(x) for x in numbers(results))
    cfg = smoke_config("free_running_control")
    updates, lr = cfg["updates"], cfg["methods"]["topr"]["lr"]
    probes = list(range(cfg["eval_every"], updates + 1, cfg["eval_every"]))
    for method, arms in results["methods"].items():
        assert list(arms) == cfg["arms"]
        for arm, entry in arms.items():
            assert entry["updates"] == [0, *probes] == entry["optimizer_steps"], (method, arm)
            assert entry["pass_at_1"]["mean"][0] == results["start"]["pass_at_1"]
            for seed in cfg["seeds"]:
                record = json.loads((out / "records" / f"{method}-{arm}-seed{seed}.json")
                                    .read_text())
                serial = json.loads((out / "records" / f"{method}-serial-seed{seed}.json")
                                    .read_text())
                ups, ref = record["updates"], serial["updates"]
                assert [u["step"] for u in ups] == list(range(1, updates + 1)), (arm, seed)
                assert all(u["learning_rate"] == pytest.approx(lr) for u in ups)
                assert [p["step"] for p in record["probes"]] == probes
                rounds, lags = [u["round"] for u in ups], [u["lag"] for u in ups]
                kind, _, s = arm.partition("-")
                if arm in ("serial", "serial-b"):
                    assert rounds == list(range(updates)) and set(lags) == {0}
                if arm == "serial-b":
                    assert ups[0]["digest"] != ref[0]["digest"]
                if kind == "lag":
                    assert rounds == list(range(updates))
                    assert lags == [min(u, int(s)) for u in range(updates)]
                    assert ups[0]["digest"] == ref[0]["digest"]
                if kind == "free":
                    assert max(lags) <= int(s) and len(set(rounds)) == updates
            diffs = [[a["pass_at_1"] - b["pass_at_1"] for a, b in zip(
                entry["runs"][str(s)]["rows"], arms["serial"]["runs"][str(s)]["rows"])]
                for s in cfg["seeds"]]
            assert entry["pass_at_1_minus_serial"]["mean"] == pytest.approx(
                [statistics.fmean(col) for col in zip(*diffs)])
        assert arms["lag-2"]["same_rounds_as_serial"] and arms["serial-b"]["same_rounds_as_serial"]
