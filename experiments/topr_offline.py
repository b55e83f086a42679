"""TOPR (arXiv:2503.14286) Fig. 1 at toy scale: one fixed offline dataset sampled from the
initial (SFT-warmed) policy μ, many epochs over it, with naive REINFORCE, PPO (ε = 0.2), DPO,
TIS and TOPR; test pass@1 and invalid rate vs training step, mean ± SE over seeds.

Per seed: `jaxrl-llm generate` (n samples per prompt from μ, ±1 rewards) → `score` (μ and
π_ref with the trainer's numerics) → `curate` (uniform; DPO pairs for DPO), then, per loss,
the public `Trainer` for many epochs over that one dataset, probing pass@1 every few steps on
fixed test questions with a fixed sampling seed.

    python experiments/topr_offline.py --out runs/experiments/topr_offline [--smoke]
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script
from experiments import aggregate, common, redraw

CONFIG = Path(__file__).with_name("topr_offline.yaml")


def dataset(out: Path, warm: dict[str, Any], cfg: dict[str, Any], seed: int) -> Path:
    """generate → score → curate (uniform and DPO pairs) for one seed; returns its config."""
    d = out / f"data-seed{seed}"
    config = common.write_config(d / "config.yaml", common.base_config(
        common.warm_model_section(warm), seed=seed, run_dir=str(out / "runs"),
        generate={"n": cfg["n"], "max_new_tokens": cfg["max_new_tokens"],
                  "output": str(d / "records")},
        data={"num_prompts": cfg["num_prompts"], "records": str(d / "records"),
              "shuffle_seed": seed},
        train={"steps": cfg["steps"], "batch_size": cfg["batch_size"], "log_every": cfg["steps"]},
        optim={"learning_rate": cfg["learning_rate"], "schedule": "constant"},
        loss={"clip_eps": cfg["ppo_clip_eps"], "beta": cfg["dpo_beta"]}))
    if not (d / "curated-dpo" / "manifest.json").exists():
        common.jaxrl("generate", "--config", str(config))
        common.jaxrl("score", "--config", str(config))
        common.jaxrl("curate", "--config", str(config), f"data.curated={d / 'curated-uniform'}")
        common.jaxrl("curate", "--config", str(config), "loss.name=dpo", "data.curation=dpo",
              f"data.curated={d / 'curated-dpo-all'}")
        whole_batches_of_pairs(d / "curated-dpo-all", d / "curated-dpo", cfg["batch_size"] // 2)
    return config


def whole_batches_of_pairs(src: Path, dst: Path, pairs_per_batch: int) -> None:
    """A copy of the DPO-curated records keeping the first ⌊P/b⌋·b of the P pairs, so every
    epoch is whole batches. Works around the loader pairing by group id: a batch that
    straddles two epochs can hold the same pair twice, which `make_pairs` turns into 4 pairs
    and refuses ("N pairs do not fit pad_to")."""
    import dataclasses

    from jaxrl_llm.data.shards import RecordSource, write_records

    source = RecordSource(str(src))
    keep = (len(source) // 2 // pairs_per_batch) * pairs_per_batch * 2
    fields = {f.name: getattr(source.manifest, f.name) for f in dataclasses.fields(source.manifest)
              if f.name not in ("num_records", "shards", "num_groups", "num_correct",
                                "num_invalid", "created", "version")}
    write_records(str(dst), [source[i] for i in range(keep)], overwrite=True, **fields)


def composition(records_dir: Path) -> dict[str, float]:
    from jaxrl_llm.data.shards import RecordSource

    records = list(RecordSource(str(records_dir)))
    correct = np.array([r.correct for r in records], bool)
    return {"num_records": len(records), "positive_fraction": float(correct.mean())}


def run(args: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    from jaxrl_llm.config import load_config

    warm = common.warm_policy(args.cache, smoke=args.smoke)
    results: dict[str, Any] = {"config": cfg, "warm_policy": warm, "losses": {}, "datasets": {}}
    step0: dict[str, float] | None = None
    for seed in cfg["seeds"]:
        config_path = dataset(args.out, warm, cfg, seed)
        d = config_path.parent
        results["datasets"][str(seed)] = composition(d / "records")
        for loss in cfg["losses"]:
            curated = d / ("curated-dpo" if loss == "dpo" else "curated-uniform")
            run_dir = args.out / "runs" / f"{loss}-seed{seed}"
            shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: the Trainer would resume
            config = load_config(str(config_path), [
                f"loss.name={loss}", f"data.curated={curated}", f"run_dir={run_dir}"])
            probe = common.Probe(config, num_questions=cfg["eval_questions"], n=cfg["eval_n"])
            if step0 is None:  # the initial policy, once: every run starts from it
                step0 = probe(common.load_policy(warm["model"], config))
            t0 = time.perf_counter()
            rows = common.train_with_probe(config, probe, eval_every=cfg["eval_every"])
            entry = results["losses"].setdefault(loss, {"runs": {}})
            entry["runs"][str(seed)] = {"rows": [{"step": 0, **step0}, *rows],
                                        "seconds": round(time.perf_counter() - t0, 1)}
            last = rows[-1]
            print(f"[{loss} seed {seed}] step {last['step']}: pass@1 {last['pass_at_1']:.3f} "
                  f"invalid {last['invalid']:.3f} ({entry['runs'][str(seed)]['seconds']} s)",
                  flush=True)
    for entry in results["losses"].values():
        runs = [entry["runs"][str(s)]["rows"] for s in cfg["seeds"]]
        entry["steps"] = [r["step"] for r in runs[0]]
        for key in ("pass_at_1", "invalid"):
            entry[key] = aggregate.over_seeds(runs, key)
    return results


def plot(results: dict[str, Any], path: Path) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for loss, entry in results["losses"].items():
        steps = np.array(entry["steps"])
        for ax, key in zip(axes, ("pass_at_1", "invalid"), strict=True):
            m, se = np.array(entry[key]["mean"]), np.array(entry[key]["se"])
            ax.plot(steps, m, label=loss)
            ax.fill_between(steps, m - se, m + se, alpha=0.2)
    n_seeds = len(results["config"]["seeds"])
    axes[0].set(xlabel="step", ylabel="test pass@1", title=f"accuracy (mean ± SE, {n_seeds} seeds)")
    axes[1].set(xlabel="step", ylabel="invalid rate", title="invalid answers")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.suptitle("Fixed offline dataset from μ, many epochs (TOPR arXiv:2503.14286 Fig. 1)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return fig


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0], "runs/experiments/topr_offline")
    cfg = yaml.safe_load(CONFIG.read_text())["smoke" if args.smoke else "full"]
    t0 = time.perf_counter()
    results = run(args, cfg)
    results["seconds"] = round(time.perf_counter() - t0, 1)
    common.write_results(args.out, "results", results)
    redraw.draw("topr_offline", results, args.out / "topr_offline.png", args.results_dir, plot)
    print(f"wrote {args.out / 'results.json'} and topr_offline.png in {results['seconds']} s")


if __name__ == "__main__":
    main()
