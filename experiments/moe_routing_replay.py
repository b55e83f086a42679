"""Routing replay on a small mixture of experts (R3, arXiv:2510.11370; docs/moe.md): TOPR and
GRPO with and without `model.routing_replay: sampler`, at staleness 0 and 4, on the quickstart
testbed with `model.family: qwen3_moe`.

The policy: the quickstart's (4 layers, 128 wide, its BPE tokenizer and arithmetic task) with
every MLP a Qwen3-MoE layer (`moe` in the config: 8 experts, top-2), SFT-warmed on gold
solutions by the quickstart's own stage, once (`common.warm_policy_quickstart`).

Per (loss, staleness s, replay, seed): rounds of the public API's loop. Each round samples
`n` completions of `prompts_per_round` fresh prompts with the current weights
(`Policy.rollout`: the sampler records each token's experts in both arms) and queues them;
the batch that leaves the queue is one `Policy.step`, its μ the sampler's own log-probs
(T = 1, untruncated). As in experiments/staleness.py (M2PO arXiv:2510.01161's set-up),
update u trains on samples drawn by the policy of update u − s: the queue first fills with s
rounds, so the first s + 1 updates train on the warm policy's samples. Before each update,
on that batch (averaged over the updates whose batch is exactly s updates old):
- the π/μ spread: the standard deviation over model tokens of log π − log μ, π the current
  policy as the update computes it (`Policy.score`: replayed or not, as configured), and the
  mean |log π − log μ|;
- the fraction of completion tokens whose experts the current policy routes elsewhere than
  the sampler did in at least one layer (`train.router_disagreement`; what replay corrects).
After the last update: test pass@1 on fixed questions with a fixed sampling seed (`Probe`).
Within a seed every run samples the same prompts, and its first round draws the same records.

    python experiments/moe_routing_replay.py --out runs/experiments/moe_routing_replay
        [--smoke] [--cache DIR] [--seeds S ...] [--staleness S ...] [--deadline-min M]

Cells run stalest first, a seed's four arms together; each finished cell is written to
OUT/cells/ and reused by a later invocation under the same protocol. `--deadline-min`
starts no cell after M minutes and summarises the finished ones (`not_run` lists the rest).
"""

from __future__ import annotations

import collections
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script
from experiments import common

CONFIG = Path(__file__).with_name("moe_routing_replay.yaml")
REPLAY = ("off", "sampler")


def experiment_tree(warm: dict[str, Any], cfg: dict[str, Any], loss: str, replay: str,
                    seed: int, run_dir: Path) -> dict[str, Any]:
    sections = common.quickstart_sections(warm)
    spec = cfg["losses"][loss]
    batch = cfg["prompts_per_round"] * cfg["n"]
    return common.base_config(
        {**common.warm_model_section(warm), "routing_replay": replay}, seed=seed,
        run_dir=str(run_dir), loss={"name": loss, **spec.get("keys", {})},
        optim={"learning_rate": cfg["learning_rate"], "schedule": "constant", "clip_norm": 1.0},
        train={**sections["train"], "batch_size": batch},
        generate={**sections["generate"], "n": cfg["n"], "temperature": 1.0, "batch_size": batch},
        data={**sections["data"], "num_prompts": cfg["num_prompts"]})


def batch_measures(policy: Any, batch: list[Any], length: int) -> dict[str, float]:
    """π/μ spread and router disagreement of `batch` under the current policy (docstring)."""
    from jaxrl_llm.train.router_disagreement import RouterDisagreement, model_routing

    logp = policy.score(batch, temperature=1.0)
    diff = np.concatenate([(lp - r.behavior_logprobs)[r.model_tokens()]
                           for lp, r in zip(logp, batch, strict=True)])
    own = model_routing(policy.model, [(r.prompt_ids, r.completion_ids) for r in batch], length)
    differ = RouterDisagreement(policy.model.config.num_layers)
    for r, again in zip(batch, own, strict=True):
        differ.add(r.routing, again)
    d = differ.to_json()
    return {"log_ratio_std": float(np.std(diff)), "log_ratio_abs": float(np.mean(np.abs(diff))),
            "experts_differ": d["any_layer"], "experts_differ_per_layer": d["mean"]}


MEASURES = ("log_ratio_std", "log_ratio_abs", "experts_differ", "experts_differ_per_layer")


def lagged_means(rows: list[dict[str, float]], staleness: int) -> dict[str, float]:
    """The batch measures averaged over the updates whose batch is exactly `staleness`
    updates old: update u trains on round u's samples, drawn min(u, s) updates earlier."""
    full = rows[staleness:]
    return {k: float(np.mean([r[k] for r in full])) for k in MEASURES}


def cell_protocol(cfg: dict[str, Any], loss: str) -> dict[str, Any]:
    """What a finished cell must have run under to be reused (not the lists of arms)."""
    keys = ("moe", "learning_rate", "updates", "prompts_per_round", "n", "num_prompts",
            "eval_questions", "eval_n")
    return {"loss": cfg["losses"][loss], **{k: cfg[k] for k in keys}}


def cell_done(out: Path, cfg: dict[str, Any], loss: str, staleness: int, replay: str,
              seed: int) -> bool:
    path = out / "cells" / f"{loss}-s{staleness}-{replay}-seed{seed}.json"
    return path.exists() and json.loads(path.read_text()).get("protocol") == \
        cell_protocol(cfg, loss)


def run_cell(out: Path, warm: dict[str, Any], cfg: dict[str, Any], probe: Any, loss: str,
             staleness: int, replay: str, seed: int) -> dict[str, Any]:
    """One run (module docstring); written to OUT/cells/NAME.json, reused when it exists."""
    from jaxrl_llm.api import load_policy

    name = f"{loss}-s{staleness}-{replay}-seed{seed}"
    path = out / "cells" / f"{name}.json"
    protocol = cell_protocol(cfg, loss)
    if path.exists():
        cell = json.loads(path.read_text())
        if cell.get("protocol") == protocol:
            return {**cell, **lagged_means(cell["rows"], staleness)}
        print(f"[{name}] {path} ran under another protocol: running it again", flush=True)
    t0 = time.perf_counter()
    tree = experiment_tree(warm, cfg, loss, replay, seed, out / "runs" / name)
    policy = load_policy(config=tree)
    policy.record_routing = True  # recorded in both arms (to count disagreement), replayed in one
    p, updates = cfg["prompts_per_round"], cfg["updates"]
    problems = policy.task.load(split="train", num=(updates + staleness) * p, seed=seed)
    queue: collections.deque = collections.deque()
    rows = []
    for round_ in range(updates + staleness):
        queue.append(policy.rollout(problems[round_ * p:(round_ + 1) * p],
                                    seed=seed * 100_003 + round_))
        if len(queue) <= staleness:
            continue
        batch = queue.popleft()  # sampled `staleness` updates ago
        row = batch_measures(policy, batch, tree["train"]["max_seq_len"])
        metrics = policy.step([r.replace(mu_logprobs=r.behavior_logprobs) for r in batch])
        rows.append({**row, "train_loss": metrics["loss"], "reward": float(np.mean(
            [r.reward for r in batch])), "correct": float(np.mean([r.correct for r in batch]))})
    final = probe(policy.model)
    result = {"loss": loss, "staleness": staleness, "replay": replay, "seed": seed,
              "protocol": protocol, "final": final, **lagged_means(rows, staleness),
              "rows": rows, "seconds": round(time.perf_counter() - t0, 1)}
    path.parent.mkdir(parents=True, exist_ok=True)
    common.write_results(path.parent, name, result)
    print(f"[{name}] pass@1 {final['pass_at_1']:.3f}, π/μ std {result['log_ratio_std']:.2e}, "
          f"experts differ {result['experts_differ']:.3f} ({result['seconds']} s)", flush=True)
    return result


def summarise(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (loss, staleness, replay): mean ± SE over seeds of pass@1 and the batch measures."""
    keys = MEASURES
    groups: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for c in cells:
        groups[f"{c['loss']}/s{c['staleness']}/{c['replay']}"].append(c)
    out = {}
    for arm, runs in sorted(groups.items()):
        def stat(values: list[float]) -> dict[str, float]:
            v = np.asarray(values, np.float64)
            se = float(v.std(ddof=1) / np.sqrt(v.size)) if v.size > 1 else 0.0
            return {"mean": float(v.mean()), "se": se}
        out[arm] = {"seeds": sorted(r["seed"] for r in runs),
                    "pass_at_1": stat([r["final"]["pass_at_1"] for r in runs]),
                    **{k: stat([r[k] for r in runs]) for k in keys}}
    return out


def paired_first_lag(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Replay's own effect on π, paired: at s > 0 the first update trains the warm policy's own
    samples, on which the two arms route alike (0 tokens differ), so it is the same update in
    both and update 1 scores the same batch, 1 update old, under the same weights — replayed
    in one arm, freely routed in the other. Per (loss, s, seed) with both arms: their row 1
    (`same_routing`: the current router disagrees with the records on the same tokens in
    both, the check that the weights are the same)."""
    by = {(c["loss"], c["staleness"], c["replay"], c["seed"]): c for c in cells}
    out = {}
    for (loss, s, replay, seed), off in sorted(by.items()):
        on = by.get((loss, s, "sampler", seed))
        if replay != "off" or s == 0 or on is None:
            continue
        a, b = off["rows"][1], on["rows"][1]
        out[f"{loss}/s{s}/seed{seed}"] = {
            "experts_differ": a["experts_differ"],
            "same_routing": a["experts_differ"] == b["experts_differ"]
            and a["experts_differ_per_layer"] == b["experts_differ_per_layer"],
            **{k: {"off": a[k], "sampler": b[k]} for k in ("log_ratio_std", "log_ratio_abs")}}
    return out


def run(args: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    if args.staleness:
        unknown = sorted(set(args.staleness) - set(cfg["staleness"]))
        if unknown:
            raise SystemExit(f"--staleness {unknown}: not in {CONFIG.name}'s "
                             f"staleness {cfg['staleness']}")
        cfg["staleness"] = [s for s in cfg["staleness"] if s in args.staleness]
    moe = [f"model.{k}={v}" for k, v in cfg["moe"].items()]
    warm = common.warm_policy_quickstart(args.cache, smoke=args.smoke, overrides=moe)
    if warm.get("sft_overrides", [])[:len(moe)] != moe:  # built for another architecture
        raise SystemExit(f"{args.cache}/warm.json: built with {warm.get('sft_overrides')}, "
                         f"not {CONFIG.name}'s moe {moe}: pass another --cache")
    from jaxrl_llm.config import config_from_dict
    from jaxrl_llm.policy.opener import open_model

    config = config_from_dict(experiment_tree(warm, cfg, "topr", "off", 0,
                                              args.out / "runs" / "probe"))
    probe = common.Probe(config, num_questions=cfg["eval_questions"], n=cfg["eval_n"])
    start_path = args.out / "start.json"  # the warm policy's pass@1 on the probe, once
    start = json.loads(start_path.read_text()) if start_path.exists() else None
    if start is None or start.get("protocol") != cell_protocol(cfg, next(iter(cfg["losses"]))):
        start = {**probe(open_model(warm["model"], config).model),
                 "protocol": cell_protocol(cfg, next(iter(cfg["losses"])))}
        common.write_results(args.out, "start", start)
    start = {k: v for k, v in start.items() if k != "protocol"}
    # the stalest arms first (where replay should matter most), a seed's four arms together
    order = [(loss, s, replay, seed) for s in sorted(cfg["staleness"], reverse=True)
             for seed in cfg["seeds"] for loss in cfg["losses"] for replay in REPLAY]
    deadline = time.time() + (args.deadline_min * 60 if args.deadline_min is not None
                              else float("inf"))
    cells, not_run = [], []
    for loss, s, replay, seed in order:
        if time.time() < deadline or cell_done(args.out, cfg, loss, s, replay, seed):
            cells.append(run_cell(args.out, warm, cfg, probe, loss, s, replay, seed))
        else:
            not_run.append(f"{loss}/s{s}/{replay}/seed{seed}")
    if not cells:
        raise SystemExit("--deadline-min: no cell finished")
    return {"config": cfg, "warm_policy": warm,
            "start": start, "arms": summarise(cells), "not_run": not_run,
            "paired_first_lag": paired_first_lag(cells),
            "cells": [{k: v for k, v in c.items() if k != "rows"} for c in cells]}


def seeds_text(arms: dict[str, Any], group: str) -> str:
    """'seeds 0,1,2' when both replay arms of `group` ran the same seeds, else each arm's."""
    seeds = {r: ",".join(map(str, arms[f"{group}/{r}"]["seeds"])) for r in REPLAY
             if f"{group}/{r}" in arms}
    if len(set(seeds.values())) == 1:
        return f"seeds {next(iter(seeds.values()))}"
    return "; ".join(f"{r}: seeds {v}" for r, v in seeds.items())


def plot(results: dict[str, Any], png: Path) -> Any:
    """Three panels (pass@1, π/μ spread, tokens whose experts differ); in each, a tick per
    (loss, staleness) and one error-bar series per replay setting, mean ± SE over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = results["arms"]
    groups = sorted({a.rsplit("/", 1)[0] for a in arms},
                    key=lambda g: (g.split("/")[0], int(g.split("/s")[1])))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (("pass_at_1", "test pass@1 after the last update"),
              ("log_ratio_std", "std of log π − log μ over the batch's tokens"),
              ("experts_differ", "tokens the current router routes elsewhere than μ's"))
    for ax, (key, title) in zip(axes, panels, strict=True):
        for offset, (replay, color) in zip((-0.1, 0.1), (("off", "tab:blue"),
                                                          ("sampler", "tab:orange")),
                                           strict=True):
            x = [i + offset for i, g in enumerate(groups) if f"{g}/{replay}" in arms]
            entries = [arms[f"{g}/{replay}"][key] for g in groups if f"{g}/{replay}" in arms]
            if entries:
                ax.errorbar(x, [e["mean"] for e in entries], yerr=[e["se"] for e in entries],
                            fmt="o", capsize=4, color=color, label=f"routing_replay: {replay}")
        ax.set_xticks(range(len(groups)), [g.replace("/s", ", staleness ") + "\n" +
                                           seeds_text(arms, g) for g in groups], fontsize=8)
        ax.set_xlim(-0.5, len(groups) - 0.5)
        ax.set_title(title, fontsize=10)
    if "start" in results:
        axes[0].axhline(results["start"]["pass_at_1"], color="gray", ls="--", lw=1,
                        label="the warm policy")
    axes[0].legend(fontsize=8)
    fig.suptitle("Qwen3-MoE (8 experts, top-2) on the quickstart testbed: routing replay off / "
                 "sampler, mean ± SE over each arm's seeds (under its tick); π/μ and experts "
                 "over the updates whose batch is s updates old", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return fig


def arguments(parser: Any) -> None:
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="run only these of the section's seeds (finished cells are reused)")
    parser.add_argument("--staleness", type=int, nargs="+", default=None,
                        help="run only these of the section's staleness values")
    parser.add_argument("--deadline-min", type=float, default=None,
                        help="start no cell after M minutes; summarise the finished ones "
                             "(the cells not run are listed in results.json's not_run)")


def main() -> None:
    common.run_experiment(__doc__, "moe_routing_replay", CONFIG, run, plot,
                          cache_name="warm_policy_quickstart_moe", extra=arguments)


if __name__ == "__main__":
    main()
