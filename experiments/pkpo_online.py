"""PKPO (arXiv:2505.15201) Fig. 3 online on the quickstart testbed: the k optimised for
(k_opt ∈ ks) at n = 8 samples per prompt, and k annealed from 8 to 1, in the online loop;
test pass@1 … pass@8 along the run and at the end, mean ± SE over seeds.

Per seed and arm, one `jaxrl-llm online` run (`online.loop.run_online`, called in-process
with an eval hook) from the quickstart's SFT-warmed policy μ: each round samples n = 8
completions of fresh prompts with the current weights (0/1 rewards), replaces each group's
rewards by PKPO's unbiased pass@k_opt gradient weights (`data.group_transform: pkpo`,
sloo_minus_one, eq. 33; the anneal sets k per round with `online.pkpo_k`) and takes one
REINFORCE update on them (staleness 0: on-policy). Within a seed every arm samples the same
prompts and its first round draws the same records. With `lr_sweep` each arm runs every rate on
one seed and keeps the one with the best validation pass@k at the k it optimises last (the
anneal: 1), on validation questions (problem seed 1), not the test ones. Claim 5
(`pkpo_iterated.py`) is the same comparison in the iterated loop (4 iterations of 32 steps on
the char-level policy).

    python experiments/pkpo_online.py --out runs/experiments/pkpo_online [--smoke]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script
from experiments import aggregate, common, pkpo_iterated, staleness

CONFIG = Path(__file__).with_name("pkpo_online.yaml")


def arms(cfg: dict[str, Any]) -> dict[str, list[int]]:
    """Arm name → k_opt per round (`online.pkpo_k`; its last value repeats)."""
    out = {f"k={k}": [k] for k in cfg["ks"]}
    half = cfg["updates"] // 2
    out["anneal"] = [cfg["anneal"][0]] * half + [cfg["anneal"][1]]
    return out


def objective_k(schedule: list[int]) -> int:
    """The pass@k an arm optimises by the end of its run (the anneal: its last k), on which its
    learning rate is chosen."""
    return schedule[-1]


def run(args: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    sweep = cfg.get("lr_sweep")
    if (sweep is None) == (cfg.get("learning_rate") is None):  # before the warm policy's SFT
        raise SystemExit(f"{CONFIG.name}: set exactly one of `learning_rate` (one rate for every "
                         "arm) and `lr_sweep` (each arm's best on validation)")
    warm = common.warm_policy_quickstart(args.cache, smoke=args.smoke)
    schedules = arms(cfg)
    run_cfg = {**cfg, "reward_scheme": "01", "pass_k": [1, cfg["n"]],
               "methods": {arm: {"loss": "reinforce", "lr": cfg.get("learning_rate"),
                                 "keys": {"length_norm": True}} for arm in schedules}}
    results: dict[str, Any] = {"config": cfg, "warm_policy": warm, "arms": {},
                               "schedules": {a: s[:1] + s[-1:] for a, s in schedules.items()}}
    probes: dict[str, Any] = {}

    def one(arm: str, seed: int, lr: float, validate: bool) -> tuple[list[dict], float]:
        schedule = schedules[arm]
        config = staleness.online_config(
            args.out, warm, run_cfg, arm, 0, seed, lr=lr, name=f"{arm}-lr{lr:g}-seed{seed}",
            extra={"data": {"group_transform": "pkpo", "pkpo_k": schedule[0]},
                   "online": {"pkpo_k": schedule}})
        if not probes:
            probes["test"] = common.PassAtKProbe(config, num_questions=cfg["eval_questions"],
                                                 n=cfg["eval_n"])
            mu = common.load_policy(warm["model"], config)
            results["start"] = probes["test"](mu)
            if sweep:
                probes["validation"] = common.PassAtKProbe(
                    config, num_questions=sweep["val_questions"], n=cfg["eval_n"],
                    split="validation", problem_seed=common.VALIDATION_SEED)
                results["start_validation"] = probes["validation"](mu)
        t0 = time.perf_counter()
        rows, _ = staleness.run_online_probed(
            config, probes["test"], cfg["eval_every"],
            final_probe=probes.get("validation") if validate else None)
        seconds = round(time.perf_counter() - t0, 1)
        last, top = rows[-1], f"pass_at_{cfg['eval_n']}"
        val = (f", validation pass@{objective_k(schedule)} "
               f"{last[f'val_pass_at_{objective_k(schedule)}']:.3f}" if validate else "")
        print(f"[{arm} lr {lr:g} seed {seed}] {last['updates']} updates: pass@1 "
              f"{last['pass_at_1']:.3f} pass@{cfg['eval_n']} {last[top]:.3f}{val} ({seconds} s)",
              flush=True)
        return [{"updates": 0, **results["start"]}, *rows], seconds

    results["lr_sweep"] = {}
    for arm, schedule in schedules.items():
        runs: dict[str, list[dict[str, float]]] = {}
        seconds: dict[str, float] = {}
        lr = cfg.get("learning_rate")
        if sweep:  # each rate on sweep.seed; the best validation pass@k_objective wins
            key = f"val_pass_at_{objective_k(schedule)}"
            swept = {r: one(arm, sweep["seed"], r, True) for r in sweep["learning_rates"]}
            scores = {r: rows[-1][key] for r, (rows, _) in swept.items()}
            lr = max(scores, key=lambda r: (scores[r], -r))  # ties: the smaller rate
            results["lr_sweep"][arm] = {"objective": key[4:], "chosen": lr,
                                        "validation": {f"{r:g}": v for r, v in scores.items()}}
            print(f"[{arm}] validation {key[4:]}: "
                  + ", ".join(f"{r:g} {v:.3f}" for r, v in scores.items()) + f" -> {lr:g}",
                  flush=True)
        for seed in cfg["seeds"]:
            if sweep and seed == sweep["seed"]:
                rows, secs = swept[lr]  # the sweep's own run at the chosen rate
            else:
                rows, secs = one(arm, seed, lr, False)
            runs[str(seed)], seconds[str(seed)] = rows, secs
        results["arms"][arm] = {**summarise(runs, seconds, cfg["eval_n"]), "lr": lr}
    return results


def summarise(runs: dict[str, list[dict[str, float]]], seconds: dict[str, float],
              n: int) -> dict[str, Any]:
    by_seed = list(runs.values())
    out: dict[str, Any] = {"updates": [r["updates"] for r in by_seed[0]], "runs": runs,
                           "seconds": seconds, "pass_at_k": {}}
    for k in range(1, n + 1):
        out["pass_at_k"][str(k)] = aggregate.over_seeds(by_seed, f"pass_at_{k}")
    out["invalid"] = aggregate.over_seeds(by_seed, "invalid")
    return out


def plot(results: dict[str, Any], path: Path) -> Any:
    return pkpo_iterated.plot_pass_at_k(results, path, x_key="updates", unit="update",
                                        start_label="μ (start)",
                                        where="online (quickstart testbed; ")


def main() -> None:
    common.run_experiment(__doc__, "pkpo_online", CONFIG, run, plot,
                          cache_name="warm_policy_quickstart")


if __name__ == "__main__":
    main()
