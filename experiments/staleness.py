"""Staleness sweep in the online loop on the quickstart testbed (the set-up of M2PO
arXiv:2510.01161: update u trains on samples drawn by the policy of update u − s), for TOPR,
M2PO, CISPO, GRPO, IcePop and the async-RL objectives (DPPO, TRM, OAPL, VCPO, AsymRE) at
s ∈ staleness.

Per method, staleness s and seed: one `jaxrl-llm online` run (`online.loop.run_online`, the
command's own function, called in-process with an eval hook) from the quickstart's SFT-warmed
policy μ. Each round samples `generate.n` completions of `prompts_per_round` fresh prompts
with the current weights (±1 rewards), the batch joins the staleness queue, and the batch
that leaves it is one optimizer update; `updates` updates in all, so with s > 0 the first
s + 1 updates train on samples of the initial policy (the queue fills with s rounds of μ's
samples before the first update). Probed every `eval_every` updates: test pass@1 and
invalid rate on fixed test questions with a fixed sampling seed (common random numbers);
logged by the loop: the loss's ESS / masked / clipped fraction and log π − log μ, averaged
over the rounds between probes. Within a seed every (method, s) run samples the same
prompts and its first round draws the same records. A method without a fixed `lr` first runs
the config's `lr_sweep` (each rate at one s and seed) and keeps the rate with the best
validation pass@1 after the last update. Each run is one "cell" written to OUT/cells/ as it
finishes; `--workers N` runs N cells at once in their own processes, and `--deadline-min`
summarises the cells finished by then (a (method, s) pair then has fewer seeds).

    python experiments/staleness.py --out runs/experiments/staleness [--smoke]
        [--workers N] [--deadline-min M]
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

CONFIG = Path(__file__).with_name("staleness.yaml")
LOGGED = ("ess", "clip", "mask", "log_ratio", "truncated")


def online_config(out: Path, warm: dict[str, Any], cfg: dict[str, Any], method: str,
                  staleness: int, seed: int, extra: dict[str, Any] | None = None, *,
                  lr: float | None = None, name: str | None = None) -> Any:
    """The `jaxrl-llm online` config of one run (written beside its run directory)."""
    from jaxrl_llm.config import load_config
    from jaxrl_llm.online.config import OnlineConfig

    spec = cfg["methods"][method]
    run_dir = out / "runs" / (name or f"{method}-s{staleness}-seed{seed}")
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: the loop would resume
    sections = common.quickstart_sections(warm)
    extra = extra or {}
    tree = common.base_config(
        common.warm_model_section(warm), seed=seed, run_dir=str(run_dir),
        loss={"name": spec.get("loss", method), **spec.get("keys", {})},
        optim={"learning_rate": spec["lr"] if lr is None else lr, "schedule": "constant"},
        train={**sections["train"], "log_every": 1, "batch_size": cfg["prompts_per_round"]
               * cfg["n"] // cfg.get("updates_per_round", 1)},
        generate={**sections["generate"], "n": cfg["n"],
                  "batch_size": cfg["prompts_per_round"] * cfg["n"]},
        data={**sections["data"], "num_prompts": cfg["num_prompts"],
              "reward_scheme": cfg.get("reward_scheme", "pm1"), **extra.get("data", {})},
        online={"rounds": cfg["updates"] // cfg.get("updates_per_round", 1), "prompts_per_round": cfg["prompts_per_round"],
                "updates_per_round": cfg.get("updates_per_round", 1), "staleness": staleness,
                "checkpoint_every": 10**9, "pass_k": cfg.get("pass_k", [1]),
                **extra.get("online", {})})
    path = common.write_config(out / "configs" / f"{run_dir.name}.yaml", tree)
    return load_config(str(path), [], schema=OnlineConfig)


def run_online_probed(config: Any, probe: Any, eval_every: int,
                      final_probe: Any = None) -> tuple[list[dict], list[dict]]:
    """One online run with `probe(model)` every `eval_every` updates (and `final_probe(model)`,
    as `val_*` keys, at the last update); (probe rows with the window-mean of the logged loss
    metrics, every round's metrics row)."""
    from jaxrl_llm.online.loop import run_online

    rows: list[dict[str, float]] = []
    total = config.online.rounds * config.online.updates_per_round

    def hook(updates: int, policy: Any) -> dict[str, float]:
        row = probe(policy.model)
        if final_probe is not None and updates == total:
            row = {**row, **{f"val_{k}": v for k, v in final_probe(policy.model).items()}}
        rows.append({"updates": updates, **row})
        return row

    result = run_online(config, progress=False, eval_hook=hook, eval_every=eval_every)
    if result.updates != total or rows[-1]["updates"] != total:
        raise RuntimeError(f"{config.run_dir}: {result.updates} updates, not {total}")
    metrics = [json.loads(line) for line in
               (Path(config.run_dir) / "metrics.jsonl").read_text().splitlines() if line]
    lo = 0
    for row in rows:  # the loss metrics averaged over the updates since the previous probe
        window = [m for m in metrics if lo < m.get("updates", 0) <= row["updates"]
                  and m.get("round_updates", 0) > 0]
        keys = {k for m in window for k, v in m.items() if k.startswith("loss/")
                and isinstance(v, int | float) and any(t in k for t in LOGGED)}
        for k in sorted(keys):
            row[k] = float(np.mean([m[k] for m in window if k in m]))
        lo = row["updates"]
    return rows, metrics


# ---- cells: one (method, lr, s, seed) run each, run in this process or in a worker pool ----

_PROBES: dict[str, Any] = {}  # per process: the probes compile their sampler once


def probes_for(config: Any, cfg: dict[str, Any]) -> tuple[Any, Any]:
    """(test probe, validation probe) of this process, built on first use."""
    if not _PROBES:
        _PROBES["test"] = common.Probe(config, num_questions=cfg["eval_questions"], n=cfg["eval_n"])
        sweep = cfg.get("lr_sweep") or {}
        _PROBES["validation"] = common.Probe(
            config, num_questions=sweep.get("val_questions", cfg["eval_questions"]),
            n=sweep.get("val_n", cfg["eval_n"]), split="validation",
            problem_seed=common.VALIDATION_SEED)
    return _PROBES["test"], _PROBES["validation"]


def cell_name(c: dict[str, Any]) -> str:
    lr = f"-lr{c['lr']:g}" if c["sweep"] else ""
    return f"{c['method']}{lr}-s{c['s']}-seed{c['seed']}"


def run_cell(cell: dict[str, Any]) -> dict[str, Any]:
    """One run; its result is also written to OUT/cells/NAME.json (a cut pool keeps it)."""
    out, cfg = Path(cell["out"]), cell["cfg"]
    config = online_config(out, cell["warm"], cfg, cell["method"], cell["s"], cell["seed"],
                           lr=cell["lr"], name=cell_name(cell))
    test, validation = probes_for(config, cfg)
    t0 = time.perf_counter()
    rows, _ = run_online_probed(config, test, cfg["eval_every"],
                                final_probe=validation if cell["sweep"] else None)
    result = {**{k: v for k, v in cell.items() if k not in ("cfg", "warm", "out")},
              "rows": rows, "seconds": round(time.perf_counter() - t0, 1)}
    (out / "cells").mkdir(parents=True, exist_ok=True)
    common.write_results(out / "cells", cell_name(cell), result)
    last = rows[-1]
    print(f"[{cell_name(cell)} lr {cell['lr']:g}] {last['updates']} updates: test pass@1 "
          f"{last['pass_at_1']:.3f} invalid {last['invalid']:.3f} ({result['seconds']} s)",
          flush=True)
    return result


def execute(cells: list[dict[str, Any]], workers: int, deadline: float) -> list[dict[str, Any]]:
    """Run `cells` (in order) on `workers` processes until time.time() ≥ deadline; the
    finished cells' results (a cell still running at the deadline is dropped)."""
    if workers <= 1:
        done = []
        for cell in cells:
            if time.time() >= deadline:
                break
            done.append(run_cell(cell))
        return done
    import multiprocessing

    # spawn: a forked child would inherit JAX's initialised runtime and its threads
    pool = multiprocessing.get_context("spawn").Pool(workers)
    done = []
    try:
        it = pool.imap_unordered(run_cell, cells)
        for _ in cells:
            left = None if deadline == float("inf") else max(deadline - time.time(), 0.001)
            done.append(it.next(timeout=left))
    except multiprocessing.TimeoutError:
        print(f"deadline: {len(done)} of {len(cells)} cells finished", flush=True)
    finally:
        pool.terminate()
        pool.join()
    return done


def chosen_lrs(cfg: dict[str, Any], sweep_results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per method: validation pass@1 at the last update for each swept lr, and the best one
    (`cfg.methods[m].lr` where the config fixes it, or no sweep is configured)."""
    out: dict[str, Any] = {}
    for method, spec in cfg["methods"].items():
        by_lr = {r["lr"]: r["rows"][-1] for r in sweep_results if r["method"] == method}
        entry: dict[str, Any] = {
            "validation_pass_at_1": {f"{lr:g}": row["val_pass_at_1"] for lr, row in by_lr.items()},
            "test_pass_at_1": {f"{lr:g}": row["pass_at_1"] for lr, row in by_lr.items()}}
        if "lr" in spec:
            entry["chosen"] = spec["lr"]
        elif len(by_lr) == len(cfg["lr_sweep"]["learning_rates"]):
            entry["chosen"] = max(by_lr, key=lambda lr: by_lr[lr]["val_pass_at_1"])
        out[method] = entry
    return out


def run(args: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    import jax

    from jaxrl_llm.losses.registry import LOSS_SPECS

    if args.merge:
        return merge(args.merge, cfg)

    warm = common.warm_policy_quickstart(args.cache, smoke=args.smoke)
    cfg = select(cfg, args)
    missing = [m for m in cfg["methods"] if cfg["methods"][m].get("loss", m) not in LOSS_SPECS]
    if missing:
        raise SystemExit(f"losses not in the registry: {missing}")
    unswept = [m for m, spec in cfg["methods"].items() if "lr" not in spec]
    if unswept and not cfg.get("lr_sweep"):
        raise SystemExit(f"methods {unswept} have no lr and the config has no lr_sweep")
    workers = args.workers or cfg.get("workers", 1)
    deadline = time.time() + (args.deadline_min * 60 if args.deadline_min else float("inf"))
    base = {"out": str(args.out), "cfg": cfg, "warm": warm}
    config = online_config(args.out, warm, cfg, next(iter(cfg["methods"])), 0, 0, lr=1e-4,
                           name="start")  # for the probes only: its lr is never used
    test, validation = probes_for(config, cfg)
    mu = common.load_policy(warm["model"], config)
    start = test(mu)
    results: dict[str, Any] = {"config": cfg, "warm_policy": warm, "start": start,
                               "workers": workers, "device": jax.devices()[0].device_kind,
                               "methods": {}}
    sweep = cfg.get("lr_sweep") or {}
    sweep_cells = [{**base, "method": m, "lr": lr, "s": sweep["staleness"],
                    "seed": sweep["seed"], "sweep": True}
                   for m in unswept for lr in sweep["learning_rates"]]
    if sweep_cells:
        results["start_validation"] = validation(mu)
    swept = execute(sweep_cells, workers, deadline)
    results["lr_sweep"] = chosen_lrs(cfg, swept)
    lrs = {m: e["chosen"] for m, e in results["lr_sweep"].items() if "chosen" in e}
    reused = {(r["method"], r["s"], r["seed"]): r for r in swept if lrs.get(r["method"]) == r["lr"]}
    # seed-major: every (method, s) cell gets its first seed before any gets its second
    cells = [{**base, "method": m, "lr": lrs[m], "s": s, "seed": seed, "sweep": False}
             for seed in sorted({x for s in cfg["staleness"] for x in seeds_of(cfg, s)})
             for m in cfg["methods"] if m in lrs for s in cfg["staleness"]
             if seed in seeds_of(cfg, s) and (m, s, seed) not in reused]
    planned = len(sweep_cells) + len(cells)
    finished = [*reused.values(), *execute(cells, workers, deadline)]
    results["methods"] = summarise_cells(cfg, finished, start)
    results["cells"] = {"planned": planned, "finished": len(swept) + len(finished) - len(reused)}
    return results


def select(cfg: dict[str, Any], args: Any) -> dict[str, Any]:
    """`cfg` cut to `--methods/--staleness/--seeds`, with `--lr METHOD=LR` fixing rates."""
    fixed: dict[str, float] = {}
    for item in args.lr:
        method, _, value = item.partition("=")
        try:
            fixed[method] = float(value)
        except ValueError:
            raise SystemExit(f"--lr {item}: expected METHOD=LR, e.g. topr=3e-5") from None
    for flag, asked, known in (("--methods", args.methods, cfg["methods"]),
                               ("--lr", list(fixed), cfg["methods"]),
                               ("--staleness", args.staleness, cfg["staleness"]),
                               ("--seeds", args.seeds, cfg["seeds"])):
        unknown = [x for x in asked or [] if x not in known]
        if unknown:
            raise SystemExit(f"{flag} {unknown}: not in the config's {list(known)}")
    keep = (lambda x, asked: asked is None or x in asked)
    return {**cfg,
            "methods": {m: {**spec, **({"lr": fixed[m]} if m in fixed else {})}
                        for m, spec in cfg["methods"].items() if keep(m, args.methods)},
            "staleness": [x for x in cfg["staleness"] if keep(x, args.staleness)],
            "seeds": [x for x in cfg["seeds"] if keep(x, args.seeds)]}


def summarise_cells(cfg: dict[str, Any], finished: list[dict[str, Any]],
                    start: dict[str, float]) -> dict[str, Any]:
    """method → s → `summarise` of its finished seeds (a (method, s) pair cut by a deadline
    has fewer seeds; one with none is absent)."""
    out: dict[str, Any] = {}
    for method in cfg["methods"]:
        by_s: dict[str, Any] = {}
        for s in cfg["staleness"]:
            mine = sorted((r for r in finished if r["method"] == method and r["s"] == s),
                          key=lambda r: r["seed"])
            if mine:
                by_s[str(s)] = summarise(
                    {str(r["seed"]): [{"updates": 0, **start}, *r["rows"]] for r in mine},
                    {str(r["seed"]): r["seconds"] for r in mine}, s, cfg["updates"])
                by_s[str(s)]["lr"] = mine[0]["lr"]
        out[method] = by_s
    return out


def merge(dirs: list[Path], cfg: dict[str, Any]) -> dict[str, Any]:
    """One summary of the runs in earlier outputs' results.json. Refuses outputs whose start
    (μ probed on the same draws) differs: they ran with other numerics (device) or questions."""
    parts = [json.loads((d / "results.json").read_text()) for d in dirs]
    start = parts[0]["start"]
    for d, part in zip(dirs, parts, strict=True):
        if part["start"] != start:
            raise SystemExit(f"{d}/results.json: start {part['start']} differs from "
                             f"{dirs[0]}/results.json's {start}: not the same probe or device")
    finished, devices = {}, {}
    for part in parts:
        for method, by_s in part["methods"].items():
            for s, entry in by_s.items():
                for seed, rows in entry["runs"].items():  # rows[0] is the start
                    finished[(method, int(s), int(seed))] = {
                        "method": method, "s": int(s), "seed": int(seed), "lr": entry["lr"],
                        "rows": rows[1:], "seconds": entry["seconds"][seed]}
                    devices[f"{method}-s{s}-seed{seed}"] = part.get("device", "not recorded")
    merged = {**parts[0], "config": cfg, "merged_from": [str(d) for d in dirs],
              "lr_sweep": merged_sweeps(parts),
              "start_validation": next((p["start_validation"] for p in parts
                                        if p.get("start_validation")), None)}
    merged["methods"] = summarise_cells(cfg, list(finished.values()), start)
    merged["cells"] = {"runs": len(finished)}
    merged["device"] = devices  # run → the device it ran on
    return merged


def merged_sweeps(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Per method, its lr-sweep entry from the outputs being merged: a swept entry (with
    validation pass@1 per rate) over one whose rate was fixed by `--lr`; the first swept
    one where several outputs swept the same method."""
    out: dict[str, Any] = {}
    for part in parts:
        for method, entry in (part.get("lr_sweep") or {}).items():
            if method not in out or (entry.get("validation_pass_at_1")
                                     and not out[method].get("validation_pass_at_1")):
                out[method] = entry
    return out


def seeds_of(cfg: dict[str, Any], s: int) -> list[int]:
    """The seeds run at staleness s: `seeds_by_staleness[s]`, else `seeds`."""
    return list((cfg.get("seeds_by_staleness") or {}).get(s, cfg["seeds"]))


def summarise(runs: dict[str, list[dict[str, float]]], seconds: dict[str, float], s: int,
              updates: int) -> dict[str, Any]:
    """Mean ± SE over seeds of the probe curves and the last probe."""
    by_seed = list(runs.values())
    out: dict[str, Any] = {"updates": [r["updates"] for r in by_seed[0]], "runs": runs,
                           "seconds": seconds, "seeds": len(by_seed),
                           "updates_on_initial_policy_samples": min(s + 1, updates)}
    keys = [k for k in by_seed[0][-1] if k in ("pass_at_1", "invalid") or k.startswith("loss/")]
    for key in keys:
        first = 0 if key in ("pass_at_1", "invalid") else 1  # step 0 has no loss metrics
        if all(key in r for rows in by_seed for r in rows[first:]):
            out[key] = aggregate.over_seeds(by_seed, key, first=first)
    for key in ("pass_at_1", "invalid"):
        per_seed = [rows[-1][key] for rows in by_seed]
        out[f"final_{key}"] = {**aggregate.mean_and_se(per_seed), "per_seed": per_seed}
    out["final_minus_start"] = aggregate.mean_and_se(
        [rows[-1]["pass_at_1"] - rows[0]["pass_at_1"] for rows in by_seed])
    return out


FRACTIONS = {"topr": "loss/clip_frac_neg_high", "grpo": "loss/clip_frac",
             "cispo": "loss/clip_frac_high", "m2po": "loss/masked_frac",
             "icepop": "loss/masked_frac", "dppo": "loss/masked_frac",
             "trm": "loss/masked_frac", "vcpo": "loss/is_truncated_frac"}


def plot(results: dict[str, Any], path: Path) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # a merge of part-grids has the config's every method: draw (and label) those with runs
    methods = [m for m, by_s in results["methods"].items() if by_s]
    stal = results["config"]["staleness"]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4))
    for i, method in enumerate(methods):  # final pass@1 vs s
        entry = results["methods"][method]
        xs = [j for j, s in enumerate(stal) if str(s) in entry]  # a cut run may lack some s
        m = [entry[str(stal[j])]["final_pass_at_1"]["mean"] for j in xs]
        se = [entry[str(stal[j])]["final_pass_at_1"]["se"] for j in xs]
        axes[0].errorbar(xs, m, yerr=se, marker="o", capsize=3, color=f"C{i}", label=method)
    axes[0].axhline(results["start"]["pass_at_1"], color="k", ls="--", label="μ (start)")
    axes[0].set(xticks=range(len(stal)), xticklabels=[str(s) for s in stal], xlabel="staleness s",
                ylabel="test pass@1 after the last update", title="final pass@1 (mean ± SE)")
    for ax, s in zip(axes[1:3], (stal[0], stal[-1]), strict=True):  # curves at s_min, s_max
        for i, method in enumerate(methods):
            if str(s) not in results["methods"][method]:
                continue
            e = results["methods"][method][str(s)]
            m, se = np.array(e["pass_at_1"]["mean"]), np.array(e["pass_at_1"]["se"])
            ax.plot(e["updates"], m, marker=".", color=f"C{i}", label=method)
            ax.fill_between(e["updates"], m - se, m + se, color=f"C{i}", alpha=0.2)
        ax.set(xlabel="update", ylabel="test pass@1", title=f"s = {s}")
    for i, method in enumerate(methods):  # masked/clipped fraction at s_max
        e = results["methods"][method].get(str(stal[-1]), {})
        key = FRACTIONS.get(method)
        if key in e:
            axes[3].plot(e["updates"][1:], e[key]["mean"], marker=".", color=f"C{i}",
                         label=f"{method}: {key}")
    axes[3].set(xlabel="update", ylabel="fraction (window mean)",
                title=f"masked / clipped fraction, s = {stal[-1]}")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Online loop on the quickstart testbed: staleness s (update u trains on the "
                 "samples of update u − s)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig


def options(parser: Any) -> None:
    parser.add_argument("--workers", type=int, default=None,
                        help="runs in parallel, one process each (default: the config's "
                             "`workers`, else 1)")
    parser.add_argument("--deadline-min", type=float, default=None,
                        help="stop after this many minutes and summarise the finished runs")
    parser.add_argument("--methods", nargs="+", default=None, help="a subset of the methods")
    parser.add_argument("--staleness", nargs="+", type=int, default=None, help="a subset of s")
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="a subset of seeds")
    parser.add_argument("--lr", nargs="+", default=[], metavar="METHOD=LR",
                        help="fix a method's lr (no sweep for it)")
    parser.add_argument("--merge", nargs="+", type=Path, default=[], metavar="DIR",
                        help="run nothing: summarise the runs of earlier outputs' results.json "
                             "(e.g. invocations with different --methods/--seeds) into OUT")


def main() -> None:
    common.run_experiment(__doc__, "staleness", CONFIG, run, plot,
                          cache_name="warm_policy_quickstart", extra=options)


if __name__ == "__main__":
    main()
