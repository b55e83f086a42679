"""PKPO (arXiv:2505.15201) Fig. 3 at toy scale: the k optimised for (k_opt ∈ {1, 2, 4, 8}) at
n = 8 samples per prompt in the iterated loop, and k annealed from 8 to 1; test pass@k for
every k ≤ 8 per iteration, mean ± SE over seeds.

Per seed and arm, one `jaxrl-llm iterate` run from the shared SFT-warmed policy π_0: each
iteration samples n = 8 completions for fresh prompts with π_{i−1} (0/1 rewards), replaces
each group's rewards by PKPO's unbiased pass@k_opt gradient weights (`data.group_transform:
pkpo`, sloo_minus_one, eq. 33; the anneal sets k per iteration with `iterate.pkpo_k`), trains
REINFORCE on them (ratio weight 1: the samples come from the current policy) and evaluates
π_i. Within a seed every arm starts from the same π_0 and its first iteration samples the
same records.

    python experiments/pkpo_iterated.py --out runs/experiments/pkpo_iterated [--smoke]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script
from experiments import common, iterated, redraw

CONFIG = Path(__file__).with_name("pkpo_iterated.yaml")


def arms(cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`k=K` for each fixed k_opt, and `anneal` (k_opt per iteration from cfg["anneal"])."""
    data = {"reward_scheme": "01", "group_transform": "pkpo", "curation": "uniform"}
    loss = {"name": "reinforce", "length_norm": True}
    out = {f"k={k}": {"loss": loss, "data": {**data, "pkpo_k": k}, "iterate": {}}
           for k in cfg["ks"]}
    out["anneal"] = {"loss": loss, "data": {**data, "pkpo_k": cfg["anneal"][0]},
                     "iterate": {"pkpo_k": cfg["anneal"]}}
    return out


def run(args: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    warm = common.warm_policy(args.cache, smoke=args.smoke)
    return {"config": cfg, "warm_policy": warm,
            **iterated.run_arms(args.out, warm, cfg, arms(cfg))}


def plot(results: dict[str, Any], path: Path) -> Any:
    return plot_pass_at_k(results, path, x_key="iteration", unit="iteration",
                          start_label="π_0", where="in the iterated loop (")


def _label(name: str, entry: dict[str, Any]) -> str:
    """An arm's legend entry, with its learning rate where it was chosen per arm."""
    return f"{name} (lr {entry['lr']:g})" if entry.get("lr") is not None else name


def plot_pass_at_k(results: dict[str, Any], path: Path, *, x_key: str, unit: str,
                   start_label: str, where: str) -> Any:
    """Pass@k vs k after the last `unit`, and pass@1 / pass@n along `results[arm][x_key]`
    (shared with `pkpo_online.py`, whose x axis is updates)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["arms"])
    first = results["arms"][names[0]]
    ks = sorted(first["pass_at_k"], key=int)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name in names:  # pass@k vs k after the last iteration / update
        entry = results["arms"][name]
        m = np.array([entry["pass_at_k"][k]["mean"][-1] for k in ks])
        se = np.array([entry["pass_at_k"][k]["se"][-1] for k in ks])
        axes[0].errorbar([int(k) for k in ks], m, yerr=se, marker="o", capsize=3,
                         label=_label(name, entry))
    m0 = np.array([first["pass_at_k"][k]["mean"][0] for k in ks])
    axes[0].plot([int(k) for k in ks], m0, "k--", label=start_label)
    axes[0].set(xlabel="k", ylabel="test pass@k", xscale="log", xticks=[int(k) for k in ks],
                xticklabels=ks, title=f"after the last {unit}")
    for ax, k in zip(axes[1:], (ks[0], ks[-1]), strict=True):  # pass@1, pass@n along the run
        for name in names:
            entry = results["arms"][name]
            ax.errorbar(entry[x_key], entry["pass_at_k"][k]["mean"],
                        yerr=entry["pass_at_k"][k]["se"], marker="o", capsize=3,
                        label=_label(name, entry))
        ax.set(xlabel=unit, ylabel=f"test pass@{k}", title=f"pass@{k} per {unit}")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[2].legend(loc="center left", bbox_to_anchor=(1.02, 0.5))
    n_seeds = len(results["config"]["seeds"])
    fig.suptitle(f"PKPO k_opt at n = {results['config']['n']} {where}"
                 f"PKPO arXiv:2505.15201 Fig. 3; mean ± SE, {n_seeds} seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return fig


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0], "runs/experiments/pkpo_iterated")
    cfg = yaml.safe_load(CONFIG.read_text())["smoke" if args.smoke else "full"]
    t0 = time.perf_counter()
    results = run(args, cfg)
    results["seconds"] = round(time.perf_counter() - t0, 1)
    common.write_results(args.out, "results", results)
    redraw.draw("pkpo_iterated", results, args.out / "pkpo_iterated.png", args.results_dir, plot)
    print(f"wrote {args.out / 'results.json'} and pkpo_iterated.png in {results['seconds']} s")


if __name__ == "__main__":
    main()
