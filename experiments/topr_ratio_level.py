"""TOPR (arXiv:2503.14286) with three importance ratios on long completions: the paper's
sequence ratio π(y)/μ(y) (eq. 7), the per-token ratio π_t/μ_t (`loss.ratio_level=token`) and
the length-normalised ratio exp(ℓ/|y|), the geometric mean of the token ratios
(`loss.ratio_level=geometric`). The sequence ratio of a long completion drifts far from 1 as
π leaves μ (its log is a sum over |y| tokens), so the truncation [r]₀¹ of the negatives'
weight zeroes or saturates most of them; the normalised ratios stay near 1.

A task variant with 3–4 operations (long step-by-step answers) gets its own SFT-warmed
policy (`common.warm_policy` in `CACHE_long`). Per seed: `jaxrl-llm generate` (from that
policy μ, ±1 rewards) → `score` → for each ratio level the public `Trainer` on that one
dataset, probing test pass@1 every few steps; the clipped fractions, log-ratios and effective
sample size are the trainer's own metrics (`loss/clip_frac_*`, `loss/log_ratio_*`,
`loss/ess_fraction`, one log row per probe).

    python experiments/topr_ratio_level.py --out runs/experiments/topr_ratio_level [--smoke]
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
from experiments import aggregate, common

CONFIG = Path(__file__).with_name("topr_ratio_level.yaml")
# Trainer metrics reported per probe (TOPR kernel, `losses.policy_gradient.topr_loss`).
METRICS = ("loss/clip_frac_neg_high", "loss/clip_frac_neg_low", "loss/clip_frac_pos_high",
           "loss/clip_frac_pos_low", "loss/log_ratio_mean_neg", "loss/log_ratio_mean_pos",
           "loss/log_ratio_max", "loss/ess_fraction", "grad_norm")


def sections(cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The config sections of the long-completion task variant."""
    return {"data": {"task_options": cfg["task_options"]},
            "train": {"max_seq_len": cfg["max_seq_len"]},
            "generate": {"max_new_tokens": cfg["max_new_tokens"]}}


def dataset(out: Path, warm: dict[str, Any], cfg: dict[str, Any], seed: int) -> Path:
    """generate → score for one seed; returns its config (TOPR trains on the scored records)."""
    d = out / f"data-seed{seed}"
    s = sections(cfg)
    config = common.write_config(d / "config.yaml", common.base_config(
        common.warm_model_section(warm), seed=seed, run_dir=str(out / "runs"),
        generate={**s["generate"], "n": cfg["n"], "output": str(d / "records")},
        data={**s["data"], "num_prompts": cfg["num_prompts"], "records": str(d / "records"),
              "shuffle_seed": seed},
        train={**s["train"], "steps": cfg["steps"], "batch_size": cfg["batch_size"],
               "log_every": cfg["eval_every"]},
        optim={"learning_rate": cfg["learning_rate"], "schedule": "constant"}))
    if not (d / "records-scored" / "manifest.json").exists():
        common.jaxrl("generate", "--config", str(config))
        common.jaxrl("score", "--config", str(config))
    return config


def composition(records_dir: Path) -> dict[str, float]:
    from jaxrl_llm.data.shards import RecordSource

    records = list(RecordSource(str(records_dir)))
    return {"num_records": len(records),
            "positive_fraction": float(np.mean([r.correct for r in records])),
            "mean_completion_tokens": float(np.mean([r.completion_ids.size for r in records]))}


def logged(run_dir: Path) -> dict[int, dict[str, float]]:
    """step -> the METRICS of that log row (metrics.jsonl)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {int(r["step"]): {k: float(r[k]) for k in METRICS if k in r} for r in rows}


def run(args: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    from jaxrl_llm.config import load_config

    cache = args.cache.with_name(args.cache.name + "_long")  # not the shared 1-op policy
    warm = common.warm_policy(cache, smoke=args.smoke, sizes=cfg["warm"], **sections(cfg))
    results: dict[str, Any] = {"config": cfg, "warm_policy": warm, "levels": {},
                               "datasets": {}}
    step0: dict[str, float] | None = None
    for seed in cfg["seeds"]:
        config_path = dataset(args.out, warm, cfg, seed)
        results["datasets"][str(seed)] = composition(config_path.parent / "records-scored")
        for level in cfg["ratio_levels"]:
            run_dir = args.out / "runs" / f"{level}-seed{seed}"
            shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: the Trainer would resume
            config = load_config(str(config_path), [
                "loss.name=topr", f"loss.ratio_level={level}", f"run_dir={run_dir}"])
            probe = common.Probe(config, num_questions=cfg["eval_questions"], n=cfg["eval_n"])
            if step0 is None:  # the initial policy, once: every run starts from it
                step0 = probe(common.load_policy(warm["model"], config))
            t0 = time.perf_counter()
            rows = common.train_with_probe(config, probe, eval_every=cfg["eval_every"])
            metrics = logged(run_dir)
            rows = [{**r, **metrics.get(r["step"], {})} for r in rows]
            entry = results["levels"].setdefault(level, {"runs": {}})
            entry["runs"][str(seed)] = {"rows": [{"step": 0, **step0}, *rows],
                                        "seconds": round(time.perf_counter() - t0, 1)}
            last = rows[-1]
            print(f"[{level} seed {seed}] step {last['step']}: pass@1 {last['pass_at_1']:.3f} "
                  f"invalid {last['invalid']:.3f} neg clipped high "
                  f"{last.get('loss/clip_frac_neg_high', float('nan')):.3f} ESS fraction "
                  f"{last.get('loss/ess_fraction', float('nan')):.3f} "
                  f"({entry['runs'][str(seed)]['seconds']} s)", flush=True)
    for entry in results["levels"].values():
        runs = [entry["runs"][str(s)]["rows"] for s in cfg["seeds"]]
        entry["steps"] = [r["step"] for r in runs[0]]
        for key in ("pass_at_1", "invalid"):
            entry[key] = aggregate.over_seeds(runs, key)
        entry["trained_steps"] = entry["steps"][1:]  # the trainer's metrics start at step 1
        for key in METRICS:
            entry[key] = aggregate.over_seeds(runs, key, first=1)
    return results


def plot(results: dict[str, Any], path: Path) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("pass_at_1", "test pass@1", False), ("invalid", "invalid rate", False),
              ("loss/clip_frac_neg_high", "negatives with r > 1 (weight truncated to 1)", True),
              ("loss/ess_fraction", "ESS / units of the truncated weights", True))
    fig, axes = plt.subplots(1, 4, figsize=(18, 3.8))
    for level, entry in results["levels"].items():
        for ax, (key, label, trained) in zip(axes, panels, strict=True):
            steps = np.array(entry["trained_steps" if trained else "steps"])
            m, se = np.array(entry[key]["mean"]), np.array(entry[key]["se"])
            ax.plot(steps, m, marker="o", label=level)
            ax.fill_between(steps, m - se, m + se, alpha=0.2)
            ax.set(xlabel="step", ylabel=label)
    for ax in axes:
        ax.grid(alpha=0.3)
    n_seeds = len(results["config"]["seeds"])
    axes[0].set_title(f"accuracy (mean ± SE, {n_seeds} seeds)")
    axes[0].legend(title="loss.ratio_level")
    fig.suptitle("TOPR with sequence / token / geometric (length-normalised) ratios on long "
                 "completions")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return fig


def main() -> None:
    common.run_experiment(__doc__, "topr_ratio_level", CONFIG, run, plot)


if __name__ == "__main__":
    main()
