"""Shared pieces of the iterated-loop reproductions (TOPR arXiv:2503.14286 §4.3 curation,
PKPO arXiv:2505.15201 k annealing): one `jaxrl-llm iterate` run from the shared SFT-warmed
policy (`common.warm_policy`), and the evaluations it wrote for each iteration.

`iterate` evaluates π_0 into `iter_0/eval/eval.json` and π_i into `iter_i/eval/eval.json`
with the same test questions and sampling seed (common random numbers), so every arm of one
seed is scored on the same draws.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from experiments import aggregate, common


def iterate_config(path: Path, warm: dict[str, Any], cfg: dict[str, Any], *, seed: int,
                   run_dir: Path, loss: dict[str, Any], data: dict[str, Any],
                   iterate: dict[str, Any]) -> Path:
    """An `iterate` config (the schema of `configs/iterate_*.yaml`) for one arm and seed."""
    return common.write_config(path, common.base_config(
        common.warm_model_section(warm), seed=seed, run_dir=str(run_dir), loss=loss,
        optim={"learning_rate": cfg["learning_rate"], "schedule": "constant"},
        train={"steps": cfg["steps"], "batch_size": cfg["batch_size"],
               "log_every": cfg["steps"], "checkpoint_every": cfg["steps"],
               "keep_checkpoints": 1},
        generate={"n": cfg["n"], "max_new_tokens": cfg["max_new_tokens"], "batch_size": 128,
                  "score_batch_size": 64},
        data={"num_prompts": cfg["num_prompts"], "shuffle_seed": seed, **data},
        eval={"n": cfg["eval_n"], "num_questions": cfg["eval_questions"], "batch_size": 128,
              "maj_k": [1], "bootstrap_trials": 2},
        iterate={"iterations": cfg["iterations"], "export": False, **iterate}))


def run_iterate(config_path: Path, run_dir: Path) -> None:
    """`jaxrl-llm iterate --config C`. A run_dir left by the same config continues (iterate
    skips the stages it completed, so an interrupted experiment resumes); any other is
    removed first."""
    stamp = run_dir / "experiment_config.yaml"
    text = config_path.read_text()
    if not (stamp.exists() and stamp.read_text() == text):
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        stamp.write_text(text)
    common.jaxrl("iterate", "--config", str(config_path), "--no-progress")


def evaluations(run_dir: Path, iterations: int, *, first: int = 1) -> list[dict[str, Any]]:
    """`iter_i/eval/eval.json` for i = first..iterations."""
    return [json.loads((run_dir / f"iter_{i}" / "eval" / "eval.json").read_text())
            for i in range(first, iterations + 1)]


def stages(run_dir: Path, index: int) -> dict[str, Any]:
    return json.loads((run_dir / f"iter_{index}" / "stages.json").read_text())


def row(summary: dict[str, Any]) -> dict[str, Any]:
    """The numbers kept from one eval.json: pass@1 ± SE, pass@k for every k, invalid rate."""
    return {"pass_at_1": summary["pass_at_1"]["mean"], "pass_at_1_se": summary["pass_at_1"]["se"],
            "pass_at_k": dict(summary["pass_at_k"]),
            "invalid": summary["proportions"]["invalid"]}


def run_arm(out: Path, warm: dict[str, Any], cfg: dict[str, Any], name: str, seed: int, *,
            loss: dict[str, Any], data: dict[str, Any], iterate: dict[str, Any],
            evaluate_initial: bool) -> dict[str, Any]:
    """One `iterate` run (arm `name`, seed `seed`): per-iteration evaluations, the curated
    composition and the training-sample metrics of each iteration."""
    import time

    run_dir = out / "runs" / f"{name}-seed{seed}"
    config = iterate_config(out / "configs" / f"{name}-seed{seed}.yaml", warm, cfg, seed=seed,
                            run_dir=run_dir, loss=loss, data=data,
                            iterate={**iterate, "evaluate_initial": evaluate_initial})
    t0 = time.perf_counter()
    run_iterate(config, run_dir)
    seconds = round(time.perf_counter() - t0, 1)
    iters = range(1, cfg["iterations"] + 1)
    curated = [stages(run_dir, i)["curate"] for i in iters]
    generated = [stages(run_dir, i)["generate"] for i in iters]
    return {
        "rows": [row(s) for s in evaluations(run_dir, cfg["iterations"])],
        "initial": row(evaluations(run_dir, 0, first=0)[0]) if evaluate_initial else None,
        "curated": [{k: c[k] for k in ("num_records", "positives", "negatives")} for c in curated],
        "sample_accuracy": [g["accuracy"] for g in generated],
        "seconds": seconds,
    }


def run_arms(out: Path, warm: dict[str, Any], cfg: dict[str, Any],
             arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every arm for every seed of `cfg["seeds"]`; π_0 is evaluated once per seed (by the
    first arm) and is row 0 of every arm. Mean ± SE over seeds of pass@1, invalid rate and
    pass@k for every k, per iteration."""
    results: dict[str, Any] = {"initial": {}, "arms": {a: {"runs": {}} for a in arms}}
    for seed in cfg["seeds"]:
        for j, (name, spec) in enumerate(arms.items()):
            arm = run_arm(out, warm, cfg, name, seed, evaluate_initial=j == 0, **spec)
            initial = arm.pop("initial")
            if initial is not None:  # π_0 on this seed's draws, shared by every arm
                results["initial"][str(seed)] = initial
            arm["rows"] = [results["initial"][str(seed)], *arm["rows"]]
            results["arms"][name]["runs"][str(seed)] = arm
            print(f"[{name} seed {seed}] pass@1 "
                  + " → ".join(f"{r['pass_at_1']:.3f}" for r in arm["rows"])
                  + f" ({arm['seconds']} s)", flush=True)
    for entry in results["arms"].values():
        runs = [entry["runs"][str(s)]["rows"] for s in cfg["seeds"]]
        entry["iteration"] = list(range(cfg["iterations"] + 1))
        for key in ("pass_at_1", "invalid"):
            entry[key] = aggregate.over_seeds(runs, key)
        entry["pass_at_k"] = {k: aggregate.over_seeds(runs, lambda r, k=k: r["pass_at_k"][k])
                              for k in sorted(runs[0][0]["pass_at_k"], key=int)}
    return results
