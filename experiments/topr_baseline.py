"""TOPR (arXiv:2503.14286) Fig. 5/6 at toy scale: test accuracy vs the effective positive
fraction p̃ (eq. 12), swept through the baseline c, for TOPR and TIS on datasets with 10% and
50% positives; mean ± SE over seeds.

Per seed: `jaxrl-llm generate` (a pool of samples from the warm policy μ, ±1 rewards) →
`score` → `curate data.curation=10p` and `=50p` (fixed size). For each dataset, each target
p̃ gets its baseline c = `baseline_for_fraction(p, p̃)` (the inverse of eq. 12), and each
(loss, c) trains the warm policy with the public `Trainer` (`loss.baseline=c`), probing test
pass@1 at the end on fixed questions with a fixed sampling seed. The p̃ the trainer logged
(`loss/effective_pos_fraction`, the batch's share of |R − c| on positives) is reported beside
the target.

    python experiments/topr_baseline.py --out runs/experiments/topr_baseline [--smoke]
        [--testbed char|quickstart] [--seeds S ...]

`--testbed quickstart` runs the config's `full_quickstart` / `smoke_quickstart` section on the
quickstart's SFT policy, each loss at its validation-chosen learning rate (experiments/
testbed.py; `lr_select: loss` sweeps one reference arm per loss, `arm` every arm).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script
from experiments import aggregate, common, testbed

CONFIG = Path(__file__).with_name("topr_baseline.yaml")


def pool(out: Path, warm: dict[str, Any], cfg: dict[str, Any], seed: int) -> Path:
    """generate → score → curate 10p / 50p for one seed; returns the seed's config path."""
    d = out / f"data-seed{seed}"
    sec = testbed.sections(warm, cfg)
    lr = cfg.get("learning_rate", (cfg.get("learning_rates") or [None])[0])
    config = common.write_config(d / "config.yaml", common.base_config(
        common.warm_model_section(warm), seed=seed, run_dir=str(out / "runs"),
        generate={**sec["generate"], "n": cfg["n"], "output": str(d / "records")},
        data={**sec["data"], "num_prompts": cfg["num_prompts"], "records": str(d / "records"),
              "shuffle_seed": seed, "num_records": cfg["num_records"]},
        train={**sec["train"], "steps": cfg["steps"], "batch_size": cfg["batch_size"],
               "log_every": cfg["steps"]},
        optim={"learning_rate": lr, "schedule": "constant"}))
    if not (d / "records-scored" / "manifest.json").exists():
        common.jaxrl("generate", "--config", str(config))
        common.jaxrl("score", "--config", str(config))
    for fraction in cfg["fractions"]:
        name = curation_name(fraction)
        if not (d / f"curated-{name}" / "manifest.json").exists():
            common.jaxrl("curate", "--config", str(config), f"data.curation={name}",
                         f"data.curated={d / f'curated-{name}'}")
    return config


def curation_name(fraction: float) -> str:
    return f"{round(fraction * 100)}p"


def positive_fraction(records_dir: Path) -> float:
    from jaxrl_llm.data.shards import RecordSource

    return float(np.mean([r.correct for r in RecordSource(str(records_dir))]))


def baseline_for(p: float, target: float) -> float:
    """c with p̃(p, c) = target (TOPR eq. 12 inverted), within [−1, 1]."""
    from jaxrl_llm.losses.advantages import baseline_for_fraction

    return float(np.clip(baseline_for_fraction(p, target), -1.0, 1.0))


def logged_mean(run_dir: Path, key: str) -> float:
    """Mean of `key` over the rows of the run's metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return float(np.mean([r[key] for r in rows if key in r]))


def finished(run_dir: Path, steps: int, baseline: float,
             lr: float | None = None) -> dict[str, float] | None:
    """The final probe of a completed earlier run with this baseline (and learning rate; its
    metrics.jsonl reached `steps` with an evaluation), so an interrupted sweep continues;
    else None."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    last = rows[-1] if rows else {}
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    if last.get("step") != steps or "eval/pass_at_1" not in last \
            or config["loss"]["baseline"] != baseline \
            or (lr is not None and config["optim"]["learning_rate"] != lr):
        return None
    return {"step": steps, **{k[len("eval/"):]: float(v) for k, v in last.items()
                              if k.startswith("eval/")}}


def run(args: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    from jaxrl_llm.config import load_config
    from jaxrl_llm.losses.advantages import effective_positive_fraction

    warm = testbed.warm_policy(args, cfg)
    seeds = sorted({*cfg["seeds"], *cfg.get("select_seeds", [])})
    configs = {seed: pool(args.out, warm, cfg, seed) for seed in seeds}
    results: dict[str, Any] = {"config": cfg, "warm_policy": warm, "datasets": {}}
    start: dict[str, float] = {}
    info: dict[tuple[str, int], dict[str, Any]] = {}
    for fraction in cfg["fractions"]:
        name = curation_name(fraction)
        for seed in seeds:
            p = positive_fraction(configs[seed].parent / f"curated-{name}")
            info[name, seed] = {"positive_fraction": p,
                                "baselines": [baseline_for(p, t) for t in cfg["targets"]]}

    def one(name: str, loss: str, ti: int, seed: int, lr: float | None) -> dict[str, Any]:
        """One training run (or its finished earlier run), probed at its last step."""
        target, c = cfg["targets"][ti], info[name, seed]["baselines"][ti]
        run_dir = args.out / "runs" / f"{name}-t{target:g}-{loss}{testbed.lr_tag(lr)}-seed{seed}"
        curated = configs[seed].parent / f"curated-{name}"
        config = load_config(str(configs[seed]), [
            f"loss.name={loss}", f"loss.baseline={c!r}", f"run_dir={run_dir}",
            f"data.curated={curated}", *testbed.lr_overrides(lr)])
        test = common.Probe(config, num_questions=cfg["eval_questions"], n=cfg["eval_n"])
        val = testbed.validation_probe(config, cfg)

        def probe(model: Any) -> dict[str, float]:
            return {**test(model), **(val(model) if val is not None else {})}

        if not start:  # the initial policy, once
            start.update(probe(common.load_policy(warm["model"], config)))
        t0 = time.perf_counter()
        final = finished(run_dir, cfg["steps"], c, lr)
        if final is None:  # not run yet (or interrupted): a fresh run
            shutil.rmtree(run_dir, ignore_errors=True)  # the Trainer would resume
            final = common.train_with_probe(config, probe, eval_every=cfg["steps"])[-1]
        row = {**final, "baseline": c, "learning_rate": lr or cfg["learning_rate"],
               "p_tilde_eq12": float(effective_positive_fraction(
                   info[name, seed]["positive_fraction"], c)),
               "p_tilde_logged": logged_mean(run_dir, "loss/effective_pos_fraction"),
               "seconds": round(time.perf_counter() - t0, 1)}
        val_note = f" val {row['val_pass_at_1']:.3f}" if "val_pass_at_1" in row else ""
        print(f"[{name} p̃={target:g} c={c:+.3f} {loss}{testbed.lr_tag(lr)} seed {seed}] pass@1 "
              f"{row['pass_at_1']:.3f} invalid {row['invalid']:.3f}{val_note} logged p̃ "
              f"{row['p_tilde_logged']:.3f} ({row['seconds']} s)", flush=True)
        return row

    # The learning rate: per loss at the reference arm (`lr_select: loss`) or per arm
    # (`lr_select: arm`); no `learning_rates` → the section's one rate for every arm.
    chosen: dict[tuple[str, str, int], float | None] = {}
    sweeps: dict[str, Any] = {}
    for loss in cfg["losses"]:
        if cfg.get("lr_select", "loss") == "loss":
            ref = cfg.get("lr_reference", {"fraction": cfg["fractions"][0],
                                           "target": cfg["targets"][0]})
            ref_name = curation_name(ref["fraction"])
            ref_ti = cfg["targets"].index(ref["target"])
            best, by_lr = testbed.choose_lr(
                cfg, lambda lr, s, n=ref_name, lo=loss, i=ref_ti: one(n, lo, i, s, lr)[
                    "val_pass_at_1"])
            sweeps[loss] = {"arm": f"{ref_name} p̃={cfg['targets'][ref_ti]:g}",
                            "val_pass_at_1_by_lr": by_lr, "best_lr": best}
            for fraction in cfg["fractions"]:
                for ti in range(len(cfg["targets"])):
                    chosen[curation_name(fraction), loss, ti] = best
        else:
            for fraction in cfg["fractions"]:
                name = curation_name(fraction)
                for ti, target in enumerate(cfg["targets"]):
                    best, by_lr = testbed.choose_lr(
                        cfg, lambda lr, s, n=name, lo=loss, i=ti: one(n, lo, i, s, lr)[
                            "val_pass_at_1"])
                    chosen[name, loss, ti] = best
                    sweeps[f"{name} p̃={target:g} {loss}"] = {"val_pass_at_1_by_lr": by_lr,
                                                              "best_lr": best}
    results["lr_sweeps"] = sweeps
    for fraction in cfg["fractions"]:
        name = curation_name(fraction)
        entry: dict[str, Any] = {"targets": cfg["targets"], "losses": {}, "seeds": {
            str(seed): info[name, seed] for seed in cfg["seeds"]}}
        # Loop order (loss, target, seed): runs differing only in the seed share one compiled
        # train step (the baseline is part of the step's config).
        for loss in cfg["losses"]:
            for ti in range(len(cfg["targets"])):
                for seed in cfg["seeds"]:
                    row = one(name, loss, ti, seed, chosen[name, loss, ti])
                    entry["losses"].setdefault(loss, {}).setdefault(str(seed), []).append(row)
        for loss, by_seed in entry["losses"].items():
            per_seed = [by_seed[str(s)] for s in cfg["seeds"]]
            entry["losses"][loss] = {"runs": by_seed, **{
                key: aggregate.over_seeds(per_seed, key)
                for key in ("pass_at_1", "invalid", "p_tilde_logged")}}
        results["datasets"][name] = entry
    results["step0"] = start
    return results


def plot(results: dict[str, Any], path: Path) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["datasets"])
    fig, axes = plt.subplots(2, len(names), figsize=(max(5.2 * len(names), 8.0), 6.4),
                             squeeze=False)
    n_seeds = len(results["config"]["seeds"])
    per_arm = results["config"].get("lr_select") == "arm"
    for col, name in enumerate(names):
        entry = results["datasets"][name]
        x = np.array(entry["targets"])
        for loss, s in entry["losses"].items():
            for row, key in enumerate(("pass_at_1", "invalid")):
                m, se = np.array(s[key]["mean"]), np.array(s[key]["se"])
                line = axes[row, col].errorbar(x, m, yerr=se, marker="o", capsize=3, label=loss)
            if per_arm:  # each point's own validation-chosen rate, beside it
                first_seed = next(iter(s["runs"].values()))
                for xi, mi, run in zip(x, s["pass_at_1"]["mean"], first_seed):
                    axes[0, col].annotate(f"{run['learning_rate']:g}", (xi, mi), fontsize=7,
                                          color=line[0].get_color(), xytext=(4, 4),
                                          textcoords="offset points")
        for row, key in enumerate(("pass_at_1", "invalid")):
            ax = axes[row, col]
            ax.axhline(results["step0"][key], color="gray", ls=":", label="initial policy")
            ax.set_xscale("log")
            ax.grid(alpha=0.3)
            ax.set(xlabel="effective positive fraction p̃ (eq. 12)",
                   ylabel="test pass@1" if key == "pass_at_1" else "invalid rate")
        axes[0, col].set_title(f"{name} dataset (mean ± SE, {n_seeds} seeds)")
    axes[0, -1].legend()
    lrs = {k: v["best_lr"] for k, v in results.get("lr_sweeps", {}).items() if v["best_lr"]}
    note = ("\nquickstart testbed, " + (
        "each arm's lr chosen on validation (labels)" if per_arm else
        "lr " + ", ".join(f"{k} {v:g}" for k, v in lrs.items()))
    ) if results["config"].get("testbed") == "quickstart" else ""
    fig.suptitle(f"Accuracy vs effective positive fraction (TOPR arXiv:2503.14286 Fig. 5/6){note}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return fig


def main() -> None:
    common.run_experiment(__doc__, "topr_baseline", CONFIG, run, plot, testbeds=True)


if __name__ == "__main__":
    main()
