"""The testbed's bar: does on-policy RL improve the quickstart's SFT-warmed policy μ by ≥ 2 SE
of test pass@1, with the SE over test questions (paired), not only over seeds?

Per method (TOPR, GRPO) and seed: the s = 0 run of claim 9 (`jaxrl-llm online`'s loop,
`online.loop.run_online`, called in-process as experiments/staleness.py does; same config,
sizes and the validation-chosen rate), scored after its last update on `eval_questions` test
questions × `eval_n` samples (problem seed 0, fixed sampling seed) — the same draws μ is
scored on (common random numbers). Reported: the change in test pass@1 from μ with two SEs.
Over seeds: the SE of the per-seed changes. Over questions, paired: per question q,
d_q = (mean over seeds of the trained policies' pass rate on q) − (μ's pass rate on q), and
SE = sd(d) / √Q; it counts how the gain would vary with another draw of test questions and
samples, which the seed SE (every seed scored on the same questions) does not.

    python experiments/testbed_bar.py --out runs/experiments/testbed_bar [--smoke]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script
from experiments import aggregate, common, staleness

CONFIG = Path(__file__).with_name("testbed_bar.yaml")


class QuestionProbe(common.Probe):
    """`Probe` that also keeps each question's pass rate (`self.per_question`, [Q])."""

    per_question: np.ndarray
    progress = False

    def __call__(self, model: Any) -> dict[str, float]:
        summary, graded = self.evaluate(model)
        self.per_question = np.asarray(graded.correct, dtype=np.float64).mean(axis=1)
        return self.row(summary)


def paired_change(per_seed: list[np.ndarray], start: np.ndarray) -> dict[str, float]:
    """The change in pass@1 from the start, with its SE over seeds and its paired SE over
    questions (module docstring); `per_seed`: each seed's [Q] pass rates."""
    finals = np.stack(per_seed)                      # [seeds, Q]
    by_seed = finals.mean(axis=1) - start.mean()
    d = finals.mean(axis=0) - start                  # [Q]
    seed_se = aggregate.mean_and_se(by_seed)["se"]
    question_se = aggregate.mean_and_se(d)["se"]
    change = float(d.mean())
    return {"change": change, "se_seeds": seed_se, "se_questions_paired": question_se,
            # None where the SE is 0 (e.g. the smoke policy, which answers nothing right)
            "z_seeds": change / seed_se if seed_se > 0 else None,
            "z_questions_paired": change / question_se if question_se > 0 else None,
            "per_seed_change": by_seed.tolist()}


def run(args: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    # smoke: `smoke_sft` (the common smoke policy answers nothing right: every SE would be 0)
    warm = common.warm_policy_quickstart(args.cache, smoke=args.smoke,
                                         smoke_overrides=cfg.get("smoke_sft"))
    first = next(iter(cfg["methods"]))
    config = staleness.online_config(args.out, warm, cfg, first, 0, 0, name="start")
    probe = QuestionProbe(config, num_questions=cfg["eval_questions"], n=cfg["eval_n"])
    start = probe(common.load_policy(warm["model"], config))
    start_q = probe.per_question
    print(f"[μ] test pass@1 {start['pass_at_1']:.3f} on {start_q.size} questions × "
          f"{cfg['eval_n']}", flush=True)
    results: dict[str, Any] = {"config": cfg, "warm_policy": warm,
                               "start": {**start, "per_question": start_q.tolist()},
                               "methods": {}}
    for method in cfg["methods"]:
        runs, per_seed = {}, []
        for seed in cfg["seeds"]:
            run_cfg = staleness.online_config(args.out, warm, cfg, method, 0, seed)
            t0 = time.perf_counter()
            rows, _ = staleness.run_online_probed(run_cfg, probe, cfg["updates"])
            per_seed.append(probe.per_question)
            runs[str(seed)] = {**rows[-1], "per_question": probe.per_question.tolist(),
                               "seconds": round(time.perf_counter() - t0, 1)}
            print(f"[{method} seed {seed}] {rows[-1]['updates']} updates: test pass@1 "
                  f"{rows[-1]['pass_at_1']:.3f} ({runs[str(seed)]['seconds']} s)", flush=True)
        change = paired_change(per_seed, start_q)
        results["methods"][method] = {"lr": cfg["methods"][method]["lr"], "runs": runs, **change}
        print(f"[{method}] change {change['change']:+.3f} ± {change['se_seeds']:.3f} over seeds, "
              f"± {change['se_questions_paired']:.3f} over questions (paired)", flush=True)
    return results


def plot(results: dict[str, Any], path: Path) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(results["methods"])
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    x = np.arange(len(methods))
    for offset, (key, label) in enumerate((("se_seeds", "± 2 SE over seeds"),
                                           ("se_questions_paired",
                                            "± 2 SE over questions (paired)"))):
        m = [results["methods"][k]["change"] for k in methods]
        se = [2 * results["methods"][k][key] for k in methods]
        ax.errorbar(x + (offset - 0.5) * 0.15, m, yerr=se, fmt="o", capsize=4, label=label)
    for i, k in enumerate(methods):
        ax.scatter([i] * len(results["methods"][k]["per_seed_change"]),
                   results["methods"][k]["per_seed_change"], color="gray", s=12, zorder=3,
                   label="per seed" if i == 0 else None)
    ax.axhline(0, color="gray", ls=":")
    ax.set_xticks(x, [f"{k} (lr {results['methods'][k]['lr']:g})" for k in methods])
    ax.set(ylabel="test pass@1 − μ's", xlim=(-0.6, len(methods) - 0.4),
           title=f"On-policy RL from the quickstart policy (μ {results['start']['pass_at_1']:.3f}, "
                 f"{len(results['start']['per_question'])} test questions)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return fig


def main() -> None:
    common.run_experiment(__doc__, "testbed_bar", CONFIG, run, plot,
                          cache_name="warm_policy_quickstart",
                          smoke_cache_name="warm_policy_quickstart_smoke_sft")


if __name__ == "__main__":
    main()
