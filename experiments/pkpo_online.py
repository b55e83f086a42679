"""PKPO (arXiv:2505.15201) Fig. 3 online on the quickstart testbed: the k optimised for
(k_opt ∈ ks) at n = 8 samples per prompt, and k annealed from 8 to 1, in the online loop;
test pass@1 … pass@8 along the run and at the end, mean ± SE over seeds.

Per seed and arm, one `jaxrl-llm online` run (`online.loop.run_online`, called in-process
with an eval hook) from the quickstart's SFT-warmed policy μ: each round samples n = 8
completions of fresh prompts with the current weights (0/1 rewards), replaces each group's
rewards by PKPO's unbiased pass@k_opt gradient weights (`data.group_transform: pkpo`,
sloo_minus_one, eq. 33; the anneal sets k per round with `online.pkpo_k`) and takes one
REINFORCE update on them (staleness 0: on-policy). Within a seed every arm samples the same
prompts and its first round draws the same records. Claim 5 (`pkpo_iterated.py`) is the same
comparison in the iterated loop (4 iterations of 32 steps on the char-level policy).

    python experiments/pkpo_online.py --out runs/experiments/pkpo_online [--smoke]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script
from experiments import common, pkpo_iterated, staleness

CONFIG = Path(__file__).with_name("pkpo_online.yaml")


def arms(cfg: dict[str, Any]) -> dict[str, list[int]]:
    """Arm name → k_opt per round (`online.pkpo_k`; its last value repeats)."""
    out = {f"k={k}": [k] for k in cfg["ks"]}
    half = cfg["updates"] // 2
    out["anneal"] = [cfg["anneal"][0]] * half + [cfg["anneal"][1]]
    return out


def run(args: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    warm = common.warm_policy_quickstart(args.cache, smoke=args.smoke)
    schedules = arms(cfg)
    run_cfg = {**cfg, "reward_scheme": "01", "pass_k": [1, cfg["n"]],
               "methods": {arm: {"loss": "reinforce", "lr": cfg["learning_rate"],
                                 "keys": {"length_norm": True}} for arm in schedules}}
    results: dict[str, Any] = {"config": cfg, "warm_policy": warm, "arms": {},
                               "schedules": {a: s[:1] + s[-1:] for a, s in schedules.items()}}
    probe = None
    start: dict[str, float] = {}
    for arm, schedule in schedules.items():
        runs: dict[str, list[dict[str, float]]] = {}
        seconds: dict[str, float] = {}
        for seed in cfg["seeds"]:
            config = staleness.online_config(
                args.out, warm, run_cfg, arm, 0, seed,
                extra={"data": {"group_transform": "pkpo", "pkpo_k": schedule[0]},
                       "online": {"pkpo_k": schedule}})
            if probe is None:
                probe = common.PassAtKProbe(config, num_questions=cfg["eval_questions"],
                                            n=cfg["eval_n"])
                start = probe(common.load_policy(warm["model"], config))
                results["start"] = start
            t0 = time.perf_counter()
            rows, _ = staleness.run_online_probed(config, probe, cfg["eval_every"])
            seconds[str(seed)] = round(time.perf_counter() - t0, 1)
            runs[str(seed)] = [{"updates": 0, **start}, *rows]
            last = rows[-1]
            top = last[f"pass_at_{cfg['eval_n']}"]
            print(f"[{arm} seed {seed}] {last['updates']} updates: pass@1 "
                  f"{last['pass_at_1']:.3f} pass@{cfg['eval_n']} {top:.3f} "
                  f"({seconds[str(seed)]} s)", flush=True)
        results["arms"][arm] = summarise(runs, seconds, cfg["eval_n"])
    return results


def summarise(runs: dict[str, list[dict[str, float]]], seconds: dict[str, float],
              n: int) -> dict[str, Any]:
    by_seed = list(runs.values())
    out: dict[str, Any] = {"updates": [r["updates"] for r in by_seed[0]], "runs": runs,
                           "seconds": seconds, "pass_at_k": {}}
    for k in range(1, n + 1):
        mean, se = common.mean_se([[r[f"pass_at_{k}"] for r in rows] for rows in by_seed])
        out["pass_at_k"][str(k)] = {"mean": mean.tolist(), "se": se.tolist()}
    mean, se = common.mean_se([[r["invalid"] for r in rows] for rows in by_seed])
    out["invalid"] = {"mean": mean.tolist(), "se": se.tolist()}
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    pkpo_iterated.plot_pass_at_k(results, path, x_key="updates", unit="update",
                                 start_label="μ (start)", where="online (quickstart testbed; ")


def main() -> None:
    common.run_experiment(__doc__, "pkpo_online", CONFIG, run, plot,
                          cache_name="warm_policy_quickstart")


if __name__ == "__main__":
    main()
