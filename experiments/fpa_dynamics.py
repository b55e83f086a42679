"""FPA (arXiv:2509.19893) Fig. 2 / Fig. 3 / Table 2 at toy scale: Off-RL (eq. 1) vs Future
Policy Approximation (eq. 3) with λ ∈ {0, 0.5, 1, 2, 5}, and FPA on negatives only /
positives only. Tracked during training on one offline dataset: log π − log π_ref of fixed
correct and incorrect records, how often the gradient's probability (π^{1/|y|} for Off-RL,
π̂^{1/|y|} for FPA) of an incorrect record falls below 0.2, and test pass@1.

Per seed: `jaxrl-llm generate` (n samples per prompt from the warm policy μ = π_ref, ±1
rewards) → `score` (π_ref's log-probs) → for each variant the public `Trainer` with an
evaluation hook that probes test pass@1 (fixed questions, fixed sampling seed) and scores
the fixed probe records with the current parameters (`common.SequenceLogprobs`). The counts
below the threshold are the trainer's own metrics (`count_pi_below_0.2_incorrect`,
`count_pi_hat_below_0.2_incorrect`: incorrect records of each batch, summed per log row).

    python experiments/fpa_dynamics.py --out runs/experiments/fpa_dynamics [--smoke]
        [--testbed char|quickstart] [--seeds S ...]

`--testbed quickstart` runs the config's `full_quickstart` / `smoke_quickstart` section on the
quickstart's SFT policy at learning rates chosen on validation (experiments/testbed.py;
`lr_select: variant` sweeps each variant, a variant's name sweeps only that one).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script
from experiments import aggregate, common, testbed

CONFIG = Path(__file__).with_name("fpa_dynamics.yaml")
KEYS = ("pass_at_1", "invalid", "diff_correct", "diff_incorrect", "count_below")


def dataset(out: Path, warm: dict[str, Any], cfg: dict[str, Any], seed: int) -> Path:
    """generate → score for one seed; returns its config (the Trainer reads the scored
    records: Off-RL and FPA need no μ, FPA's π_ref runs in the step)."""
    d = out / f"data-seed{seed}"
    sec = testbed.sections(warm, cfg)
    lr = cfg.get("learning_rate", (cfg.get("learning_rates") or [None])[0])
    config = common.write_config(d / "config.yaml", common.base_config(
        common.warm_model_section(warm), seed=seed, run_dir=str(out / "runs"),
        generate={**sec["generate"], "n": cfg["n"], "output": str(d / "records")},
        data={**sec["data"], "num_prompts": cfg["num_prompts"], "records": str(d / "records"),
              "shuffle_seed": seed},
        train={**sec["train"], "steps": cfg["steps"], "batch_size": cfg["batch_size"],
               "log_every": cfg["eval_every"]},
        optim={"learning_rate": lr, "schedule": "constant"}))
    if not (d / "records-scored" / "manifest.json").exists():
        common.jaxrl("generate", "--config", str(config))
        common.jaxrl("score", "--config", str(config))
    return config


def probe_records(scored: Path, k: int, seed: int) -> tuple[list[Any], np.ndarray]:
    """Up to k correct and k incorrect scored records (fixed by `seed`), and their flags."""
    from jaxrl_llm.data.shards import RecordSource

    records = list(RecordSource(str(scored)))
    correct = np.array([r.correct for r in records], bool)
    rng = np.random.default_rng(seed)
    picked = []
    for flag in (True, False):
        idx = np.flatnonzero(correct == flag)
        if idx.size == 0:
            raise ValueError(f"{scored}: no {'correct' if flag else 'incorrect'} record to "
                             "probe; generate more prompts")
        picked += sorted(rng.choice(idx, min(k, idx.size), replace=False).tolist())
    return [records[i] for i in picked], correct[picked]


def composition(records_dir: Path) -> dict[str, float]:
    from jaxrl_llm.data.shards import RecordSource

    correct = [r.correct for r in RecordSource(str(records_dir))]
    return {"num_records": len(correct), "positive_fraction": float(np.mean(correct))}


def count_rows(run_dir: Path, overrides: dict[str, Any]) -> list[tuple[int, float]]:
    """(step, incorrect records below the threshold in that log window) from metrics.jsonl:
    the probability that weights an incorrect record's gradient — π̂^{1/|y|} under FPA with
    the extrapolation on negatives, else π^{1/|y|} (Off-RL, `fpa_on=positives`)."""
    hat = overrides["loss.name"] == "fpa" and overrides.get("loss.fpa_on") != "positives"
    key = "loss/count_pi_hat_below_0.2_incorrect" if hat else \
        "loss/count_pi_below_0.2_incorrect"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(int(r["step"]), float(r[key])) for r in rows if key in r]


def make_hook(probe: common.Probe, seqlp: common.SequenceLogprobs, correct: np.ndarray,
              threshold: float) -> Any:
    """model -> pass@1, invalid, mean log π − log π_ref of the correct / incorrect probe
    records, and how many incorrect probe records have π^{1/|y|} below `threshold`."""
    def hook(model: Any) -> dict[str, float]:
        diff = seqlp(model)
        norm_pi = np.exp((diff + seqlp.ref) / seqlp.lengths)  # π(y|x)^{1/|y|}
        return {**probe(model),
                "diff_correct": float(diff[correct].mean()),
                "diff_incorrect": float(diff[~correct].mean()),
                "probe_below_incorrect": float((norm_pi[~correct] < threshold).sum())}

    return hook


def run(args: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    from jaxrl_llm.config import load_config

    warm = testbed.warm_policy(args, cfg)
    results: dict[str, Any] = {"config": cfg, "warm_policy": warm, "variants": {},
                               "datasets": {}}
    step0_pass: dict[str, float] = {}
    per_seed: dict[int, dict[str, Any]] = {}

    def seed_setup(seed: int) -> dict[str, Any]:
        if seed not in per_seed:
            config_path = dataset(args.out, warm, cfg, seed)
            scored = config_path.parent / "records-scored"
            records, correct = probe_records(scored, cfg["probe_records"], seed)
            results["datasets"][str(seed)] = {
                **composition(scored), "probe_correct": int(correct.sum()),
                "probe_incorrect": int((~correct).sum())}
            config = load_config(str(config_path), [])
            warm_model = common.load_policy(warm["model"], config)
            seqlp = common.SequenceLogprobs(records, warm_model)
            # step 0, measured: ≈ 0 when the probe's forward matches the `score` pass's
            diff0 = seqlp(warm_model)
            if not step0_pass:
                probe = common.Probe(config, num_questions=cfg["eval_questions"],
                                     n=cfg["eval_n"])
                step0_pass.update(probe(warm_model))
                val = testbed.validation_probe(config, cfg)
                if val is not None:
                    results["start_validation"] = val(warm_model)
            first = {"step": 0, **step0_pass, "diff_correct": float(diff0[correct].mean()),
                     "diff_incorrect": float(diff0[~correct].mean()),
                     "probe_below_incorrect": float(
                         (np.exp(seqlp.ref[~correct] / seqlp.lengths[~correct])
                          < cfg["threshold"]).sum()), "count_below": 0.0}
            per_seed[seed] = {"config": config_path, "seqlp": seqlp, "correct": correct,
                              "first": first}
        return per_seed[seed]

    def one(name: str, seed: int, lr: float | None) -> dict[str, Any]:
        """One variant's run (or its finished earlier run's rows): {rows, seconds}."""
        s = seed_setup(seed)
        overrides = cfg["variants"][name]
        run_dir = args.out / "runs" / f"{name}{testbed.lr_tag(lr)}-seed{seed}"
        key = {"overrides": overrides, "lr": lr, "steps": cfg["steps"],
               "eval_every": cfg["eval_every"]}
        t0 = time.perf_counter()
        rows = testbed.cached_rows(run_dir, key)
        if rows is None:
            shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: the Trainer would resume
            config = load_config(str(s["config"]), [f"{k}={v}" for k, v in overrides.items()]
                                 + [f"run_dir={run_dir}", *testbed.lr_overrides(lr)])
            probe = common.Probe(config, num_questions=cfg["eval_questions"], n=cfg["eval_n"])
            hook = make_hook(probe, s["seqlp"], s["correct"], cfg["threshold"])
            val = testbed.validation_probe(config, cfg)
            calls = [0]

            def probed(model: Any) -> dict[str, float]:  # validation at the last step only
                calls[0] += 1
                row = hook(model)
                if val is not None and calls[0] * cfg["eval_every"] == cfg["steps"]:
                    row.update(val(model))
                return row

            rows = common.train_with_probe(config, probed, eval_every=cfg["eval_every"])
            counts = dict(count_rows(run_dir, overrides))
            cumulative = 0.0
            for r in rows:  # log_every = eval_every: one count row per probed step
                cumulative += counts.get(r["step"], 0.0)
                r["count_below"] = cumulative
            testbed.save_rows(run_dir, key, rows)
        out = {"rows": [s["first"], *rows], "seconds": round(time.perf_counter() - t0, 1),
               "learning_rate": lr or cfg["learning_rate"]}
        last = rows[-1]
        val_note = f" val {last['val_pass_at_1']:.3f}" if "val_pass_at_1" in last else ""
        print(f"[{name}{testbed.lr_tag(lr)} seed {seed}] step {last['step']}: pass@1 "
              f"{last['pass_at_1']:.3f} invalid {last['invalid']:.3f}{val_note} Δlogπ correct "
              f"{last['diff_correct']:+.2f} incorrect {last['diff_incorrect']:+.2f} "
              f"count<{cfg['threshold']} {last['count_below']:.0f} ({out['seconds']} s)",
              flush=True)
        return out

    # The learning rate: `lr_select: variant` sweeps each variant; a variant's name sweeps
    # that one and every variant runs at its rate; no `learning_rates` → the one rate.
    select = cfg.get("lr_select", "variant")
    chosen: dict[str, float | None] = {}
    sweeps: dict[str, Any] = {}
    for name in ([select] if select in cfg["variants"] else cfg["variants"]):
        best, by_lr = testbed.choose_lr(
            cfg, lambda lr, s, n=name: one(n, s, lr)["rows"][-1]["val_pass_at_1"])
        chosen[name] = best
        sweeps[name] = {"val_pass_at_1_by_lr": by_lr, "best_lr": best}
    results["lr_sweeps"] = sweeps
    for seed in cfg["seeds"]:
        for name, overrides in cfg["variants"].items():
            entry = results["variants"].setdefault(name, {"overrides": overrides, "runs": {}})
            entry["runs"][str(seed)] = one(name, seed, chosen.get(name, chosen.get(select)))
    for entry in results["variants"].values():
        runs = [entry["runs"][str(s)]["rows"] for s in cfg["seeds"]]
        entry["steps"] = [r["step"] for r in runs[0]]
        for key in (*KEYS, "probe_below_incorrect"):
            entry[key] = aggregate.over_seeds(runs, key)
    return results


def plot(results: dict[str, Any], path: Path) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names = list(results["variants"])
    for i, name in enumerate(names):
        entry, c = results["variants"][name], colors[i % len(colors)]
        steps = np.array(entry["steps"])
        for ax, key, ls in ((axes[0, 0], "diff_correct", "-"), (axes[0, 0], "diff_incorrect", "--"),
                            (axes[0, 1], "pass_at_1", "-"), (axes[1, 0], "count_below", "-")):
            m, se = np.array(entry[key]["mean"]), np.array(entry[key]["se"])
            ax.plot(steps, m, ls, color=c, label=name if key != "diff_incorrect" else None)
            ax.fill_between(steps, m - se, m + se, color=c, alpha=0.15)
        final = entry["pass_at_1"]
        axes[1, 1].bar(i, final["mean"][-1], yerr=final["se"][-1], color=c, capsize=3)
    n_seeds = len(results["config"]["seeds"])
    axes[0, 0].set(xlabel="step", ylabel="log π − log π_ref (sequence)",
                   title="fixed records: correct (solid), incorrect (dashed)")
    axes[0, 1].set(xlabel="step", ylabel="test pass@1", title=f"accuracy (mean ± SE, {n_seeds} seeds)")
    axes[1, 0].set(xlabel="step", ylabel="cumulative count",
                   title=f"incorrect records with π^(1/|y|) (Off-RL) / π̂^(1/|y|) (FPA) "
                         f"< {results['config']['threshold']}")
    axes[1, 1].set_xticks(range(len(names)), names, rotation=30, ha="right")
    axes[1, 1].set(ylabel="test pass@1", title="final accuracy")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    axes[0, 1].legend(fontsize=8)
    lrs = sorted({v["best_lr"] for v in results.get("lr_sweeps", {}).values() if v["best_lr"]})
    note = (", quickstart testbed, lr " + "/".join(f"{x:g}" for x in lrs)
            ) if results["config"].get("testbed") == "quickstart" else ""
    fig.suptitle(f"Off-RL vs FPA (arXiv:2509.19893 Fig. 2/3, Table 2{note})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return fig


def main() -> None:
    common.run_experiment(__doc__, "fpa_dynamics", CONFIG, run, plot, testbeds=True)


if __name__ == "__main__":
    main()
