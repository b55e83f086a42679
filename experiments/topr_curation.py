"""TOPR (arXiv:2503.14286) §4.3 at toy scale: dataset curation in the iterated loop —
uniform vs positives-only vs Anna Karenina sampling over a few iterations; test pass@1 per
iteration, mean ± SE over seeds.

Per seed and curation, one `jaxrl-llm iterate` run from the shared SFT-warmed policy π_0:
each iteration samples n completions for fresh prompts with π_{i−1} (±1 rewards), scores μ =
π_{i−1}, curates (`data.curation` = uniform | positives | anna_karenina, the same iteration
budget `data.num_records` for uniform and Anna Karenina; positives-only keeps every positive),
trains TOPR for a fixed number of steps and evaluates π_i on fixed test questions. Within a
seed every arm starts from the same π_0 and its first iteration samples the same records.

    python experiments/topr_curation.py --out runs/experiments/topr_curation [--smoke]
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

CONFIG = Path(__file__).with_name("topr_curation.yaml")


def run(args: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    warm = common.warm_policy(args.cache, smoke=args.smoke)
    arms = {curation: {"loss": {"name": "topr", "baseline": cfg["baseline"]},
                       # positives-only keeps every positive; the others fill the budget
                       "data": {"curation": curation, **({} if curation == "positives"
                                                         else {"num_records": cfg["num_records"]})},
                       "iterate": {}}
            for curation in cfg["curations"]}
    return {"config": cfg, "warm_policy": warm, **iterated.run_arms(args.out, warm, cfg, arms)}


def plot(results: dict[str, Any], path: Path) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for curation, entry in results["arms"].items():
        x = np.array(entry["iteration"])
        for ax, key in zip(axes, ("pass_at_1", "invalid"), strict=True):
            m, se = np.array(entry[key]["mean"]), np.array(entry[key]["se"])
            ax.errorbar(x, m, yerr=se, marker="o", capsize=3, label=curation)
    n_seeds = len(results["config"]["seeds"])
    axes[0].set(xlabel="iteration", ylabel="test pass@1",
                title=f"accuracy (mean ± SE, {n_seeds} seeds)")
    axes[1].set(xlabel="iteration", ylabel="invalid rate", title="invalid answers")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.set_xticks(results["arms"][next(iter(results["arms"]))]["iteration"])
    axes[1].legend(loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.suptitle("Dataset curation in the iterated loop (TOPR arXiv:2503.14286 §4.3)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return fig


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0], "runs/experiments/topr_curation")
    cfg = yaml.safe_load(CONFIG.read_text())["smoke" if args.smoke else "full"]
    t0 = time.perf_counter()
    results = run(args, cfg)
    results["seconds"] = round(time.perf_counter() - t0, 1)
    common.write_results(args.out, "results", results)
    redraw.draw("topr_curation", results, args.out / "topr_curation.png", args.results_dir, plot)
    print(f"wrote {args.out / 'results.json'} and topr_curation.png in {results['seconds']} s")


if __name__ == "__main__":
    main()
