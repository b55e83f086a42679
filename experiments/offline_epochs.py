"""One fixed offline dataset from the quickstart's SFT-warmed policy μ, many epochs over it (the
set-up of TOPR arXiv:2503.14286 Fig. 1), for each off-policy method at its best learning rate.

Per seed: `jaxrl-llm generate` (n samples per prompt from μ, ±1 rewards) → `score` (μ and
π_ref with the trainer's numerics) → `curate` (uniform: every record), then, per method and
learning rate, the public `Trainer` for many epochs over that one dataset (same data and batch
order for every method), probing test pass@1 and invalid rate every `eval_every` steps on
fixed test questions with a fixed sampling seed, and at the last step pass@1 on validation
questions. Each method's learning rate is the one with the best mean validation pass@1 at the
last step over `select_seeds`; its remaining seeds then run at that rate. Logged beside the
probes: the trainer's own ESS fraction and masked/clipped fraction (`metrics.jsonl`, where the
kernel logs them) and, for every method alike, the ESS fraction of the sequence-level weights
π(y)/μ(y) over a fixed subset of the dataset.

Methods are loss names with their `loss.*` keys (offline_epochs.yaml); a name the loss
registry does not have is skipped with a note, so the config can name losses before they land.

    python experiments/offline_epochs.py --out runs/experiments/offline_epochs [--smoke]
        [--methods NAME ...]

`--methods` runs only the named methods (same protocol, datasets and warm policy, reused from
OUT when there) and merges them into OUT/results.json: the other methods' entries are read
from it and kept, provided it was written under the same config. `--merge DIR ...` runs
nothing: it joins the methods of earlier outputs' results.json (e.g. two processes run side
by side with disjoint `--methods`) into OUT, provided each was written under this config and
from the same start (μ probed on the same draws). Each finished training run is kept in
OUT/cells/ and reused by a later invocation with the same protocol, overrides, μ and start (a
cut invocation resumes with the runs it had finished).
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
from experiments import aggregate, common, redraw

CONFIG = Path(__file__).with_name("offline_epochs.yaml")
ESS_METRIC = "loss/ess_fraction"
# the trainer metrics kept beside the probes: ESS, clipped, masked or truncated fractions
LOGGED = ("ess", "clip", "mask", "truncated")


def available_methods(cfg: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The configured methods the loss registry has, and the names it does not (skipped)."""
    from jaxrl_llm.losses.registry import LOSS_SPECS

    methods = {m: dict(keys or {}) for m, keys in cfg["methods"].items() if m in LOSS_SPECS}
    skipped = [m for m in cfg["methods"] if m not in LOSS_SPECS]
    for m in skipped:
        print(f"note: loss {m!r} is not in this checkout's loss registry; skipping it "
              f"(registry: {', '.join(LOSS_SPECS)})", flush=True)
    return methods, skipped


def select_methods(methods: dict[str, dict[str, Any]], names: list[str] | None,
                   cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`--methods`: the named subset of the runnable methods (all of them without it)."""
    if not names:
        return methods
    unknown = [m for m in names if m not in methods]
    if unknown:
        raise SystemExit(f"--methods {' '.join(unknown)}: not among this config's runnable "
                         f"methods ({', '.join(methods)})")
    return {m: methods[m] for m in cfg["methods"] if m in names}


PER_METHOD = ("methods", "clip_metric")  # config keys with an entry per method


def same_protocol(old: dict[str, Any], cfg: dict[str, Any], methods: list[str]) -> bool:
    """`old` (a results.json's config) ran `methods` as `cfg` would: every key but the
    per-method ones equal, and those methods' own entries equal."""
    return ({k: v for k, v in cfg.items() if k not in PER_METHOD}
            == {k: v for k, v in old.items() if k not in PER_METHOD}
            and all(old[k].get(m) == cfg[k].get(m) for k in PER_METHOD for m in methods))


def merge(previous: dict[str, Any], results: dict[str, Any],
          cfg: dict[str, Any]) -> dict[str, Any]:
    """This run's methods merged into a previous results.json's: the previous entries of the
    methods not rerun are kept, in the config's method order; the protocol must match."""
    kept = [m for m in previous["methods"] if m not in results["methods"]]
    if not same_protocol(previous["config"], cfg, kept):
        raise SystemExit("--methods: the previous results.json was written under another "
                         "config; rerun every method instead")
    if previous.get("start") != results.get("start"):
        print(f"warning: the start differs from the previous run's: {previous.get('start')} "
              f"vs {results.get('start')}", flush=True)
    entries = {**previous["methods"], **results["methods"]}
    ran = [m for m in entries if m in cfg["methods"]]
    merged = {**previous, **results,
              "methods": {m: entries[m] for m in cfg["methods"] if m in ran},
              "datasets": {**previous.get("datasets", {}), **results["datasets"]},
              "merged": {"kept_from_previous": kept, "rerun": list(results["methods"]),
                         "previous_seconds": previous.get("seconds")}}
    merged["skipped_methods"] = [m for m in cfg["methods"] if m not in merged["methods"]]
    return merged


def merge_outputs(dirs: list[Path], cfg: dict[str, Any]) -> dict[str, Any]:
    """`--merge`: the methods of several outputs' results.json joined under `cfg`. Each must
    have run its methods under this config, from the same start (μ on the same probe draws)
    on the same datasets, and no method may come from two outputs."""
    parts = [json.loads((d / "results.json").read_text()) for d in dirs]
    owner: dict[str, Path] = {}
    datasets: dict[str, Any] = {}
    for d, part in zip(dirs, parts, strict=True):
        if not same_protocol(part["config"], cfg, list(part["methods"])):
            raise SystemExit(f"{d}/results.json was written under another config")
        if part["start"] != parts[0]["start"]:
            raise SystemExit(f"{d}/results.json: start {part['start']} differs from "
                             f"{dirs[0]}/results.json's {parts[0]['start']}: another μ or probe")
        for seed, comp in part["datasets"].items():
            if datasets.setdefault(seed, comp) != comp:
                raise SystemExit(f"{d}/results.json: seed {seed}'s dataset {comp} differs "
                                 f"from {datasets[seed]} in an earlier output")
        for m in part["methods"]:
            if m in owner:
                raise SystemExit(f"--merge: method {m!r} is in both {owner[m]} and {d}")
            owner[m] = d
    entries = {m: e for part in parts for m, e in part["methods"].items()}
    return {**parts[0], "config": cfg, "datasets": datasets,
            "methods": {m: entries[m] for m in cfg["methods"] if m in entries},
            "skipped_methods": [m for m in cfg["methods"] if m not in entries],
            "merged_from": [{"out": str(d), "methods": list(part["methods"]),
                             "seconds": part.get("seconds"),
                             "cpu_seconds": part.get("cpu_seconds")}
                            for d, part in zip(dirs, parts, strict=True)]}


def dataset(out: Path, warm: dict[str, Any], cfg: dict[str, Any], seed: int) -> Path:
    """generate → score → curate for one seed; returns its config."""
    d = out / f"data-seed{seed}"
    sections = common.quickstart_sections(warm)
    config = common.write_config(d / "config.yaml", common.base_config(
        common.warm_model_section(warm), seed=seed, run_dir=str(out / "runs"),
        generate={**sections["generate"], "n": cfg["n"], "output": str(d / "records")},
        data={**sections["data"], "num_prompts": cfg["num_prompts"],
              "records": str(d / "records"), "curated": str(d / "curated"),
              "shuffle_seed": seed},
        train={**sections["train"], "steps": cfg["steps"], "batch_size": cfg["batch_size"],
               "log_every": cfg["eval_every"]},
        optim={"learning_rate": cfg["learning_rates"][0], "schedule": "constant"}))
    if not (d / "curated" / "manifest.json").exists():
        common.jaxrl("generate", "--config", str(config))
        common.jaxrl("score", "--config", str(config))
        common.jaxrl("curate", "--config", str(config))
    return config


def composition(records_dir: Path) -> dict[str, float]:
    from jaxrl_llm.data.shards import RecordSource

    records = list(RecordSource(str(records_dir)))
    correct = np.array([r.correct for r in records], bool)
    return {"num_records": len(records), "positive_fraction": float(correct.mean())}


def ess_fraction(log_w: np.ndarray) -> float:
    """(Σ w)² / (N Σ w²) of weights w = exp(log_w), in log space."""
    log_w = log_w - log_w.max()
    w = np.exp(log_w)
    return float(w.sum() ** 2 / (len(w) * np.sum(w * w)))


def logged(run_dir: Path) -> dict[int, dict[str, float]]:
    """step → the ESS / clip / mask / truncation metrics of that metrics.jsonl row."""
    out: dict[int, dict[str, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "step" in row:
            out[int(row["step"])] = {k: float(v) for k, v in row.items()
                                     if k.startswith("loss/") and isinstance(v, int | float)
                                     and any(w in k for w in LOGGED)}
    return out


def train_one(config: Any, cfg: dict[str, Any], probes: dict[str, Any],
              weights: Any) -> list[dict[str, float]]:
    """One training run; rows {step, pass_at_1, invalid, dataset_ess_fraction} at every probe,
    and val_pass_at_1 at the last step."""
    if cfg["steps"] % cfg["eval_every"]:
        raise ValueError(f"steps ({cfg['steps']}) must be a multiple of eval_every "
                         f"({cfg['eval_every']}): the last step is probed on validation")
    calls = [0]

    def probe(model: Any) -> dict[str, float]:
        calls[0] += 1
        row = probes["test"](model)
        row["dataset_ess_fraction"] = ess_fraction(weights(model))
        if calls[0] * cfg["eval_every"] == cfg["steps"]:
            val = probes["validation"](model)
            row["val_pass_at_1"] = val["pass_at_1"]
            row["val_pass_at_1_se"] = val["pass_at_1_se"]
        return row

    rows = common.train_with_probe(config, probe, eval_every=cfg["eval_every"])
    if rows[-1]["step"] != cfg["steps"] or "val_pass_at_1" not in rows[-1]:
        raise RuntimeError(f"{config.run_dir}: the last probe was at step {rows[-1]['step']}, "
                           f"not {cfg['steps']}")
    return rows


def run(args: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    from jaxrl_llm.config import load_config
    from jaxrl_llm.data.shards import RecordSource

    if getattr(args, "merge", None):
        return merge_outputs(args.merge, cfg)
    methods, skipped = available_methods(cfg)
    methods = select_methods(methods, getattr(args, "methods", None), cfg)
    previous_path = args.out / "results.json"
    previous = json.loads(previous_path.read_text()) if getattr(args, "methods", None) \
        and previous_path.exists() else None
    warm = common.warm_policy_quickstart(args.cache, smoke=args.smoke)
    results: dict[str, Any] = {"config": cfg, "warm_policy": warm, "methods": {},
                               "skipped_methods": skipped, "datasets": {}}
    step0: dict[str, float] | None = None
    runs: dict[str, dict[float, dict[int, list[dict[str, float]]]]] = {m: {} for m in methods}
    seconds: dict[str, dict[str, float]] = {m: {} for m in methods}
    cache: dict[int, tuple[Path, Any, dict[str, Any]]] = {}

    def seed_setup(seed: int) -> tuple[Path, Any, dict[str, Any]]:
        if seed not in cache:
            config_path = dataset(args.out, warm, cfg, seed)
            d = config_path.parent
            results["datasets"][str(seed)] = composition(d / "records")
            config = load_config(str(config_path), [])
            probes = {
                "test": common.Probe(config, num_questions=cfg["eval_questions"],
                                     n=cfg["eval_n"]),
                "validation": common.Probe(config, num_questions=cfg["val_questions"],
                                           n=cfg["val_n"], split="validation",
                                           problem_seed=common.VALIDATION_SEED)}
            source = RecordSource(str(d / "curated"))
            pick = np.random.default_rng(seed).choice(
                len(source), min(cfg["ess_records"], len(source)), replace=False)
            mu = common.load_policy(warm["model"], config)
            # the score pass wrote π_ref = μ (the warm policy): log π − log π_ref = log π/μ
            weights = common.SequenceLogprobs([source[int(i)] for i in np.sort(pick)], mu)
            cache[seed] = (config_path, probes, {"weights": weights})
        return cache[seed]

    def one(method: str, lr: float, seed: int) -> list[dict[str, float]]:
        nonlocal step0
        config_path, probes, extra = seed_setup(seed)
        run_dir = args.out / "runs" / f"{method}-lr{lr:g}-seed{seed}"
        overrides = [f"loss.name={method}", f"optim.learning_rate={lr}",
                     *(f"loss.{k}={v}" for k, v in methods[method].items())]
        config = load_config(str(config_path), [*overrides, f"run_dir={run_dir}"])
        if step0 is None:  # the initial policy, once: every run starts from it
            mu = common.load_policy(warm["model"], config)
            step0 = {**probes["test"](mu), "dataset_ess_fraction": 1.0}
            val0 = probes["validation"](mu)
            results["start"] = {**step0, "val_pass_at_1": val0["pass_at_1"],
                                "val_pass_at_1_se": val0["pass_at_1_se"]}
        # a run finished under the same protocol, overrides, μ and start is reused (a cut
        # invocation resumes with the runs it had finished)
        key = {"overrides": overrides, "protocol": {k: v for k, v in cfg.items()
                                                    if k not in PER_METHOD},
               "warm_model": warm["model"], "start": step0}
        cell = args.out / "cells" / f"{run_dir.name}.json"
        done = json.loads(cell.read_text()) if cell.exists() else None
        if done is not None and done["key"] == key:
            rows, seconds[method][f"lr{lr:g}-seed{seed}"] = done["rows"], done["seconds"]
            print(f"[{method} lr {lr:g} seed {seed}] reused {cell}", flush=True)
            return [{"step": 0, **step0}, *rows]
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: the Trainer would resume
        t0 = time.perf_counter()
        rows = train_one(config, cfg, probes, extra["weights"])
        metrics = logged(run_dir)
        rows = [{**r, **metrics.get(int(r["step"]), {})} for r in rows]
        seconds[method][f"lr{lr:g}-seed{seed}"] = round(time.perf_counter() - t0, 1)
        cell.parent.mkdir(parents=True, exist_ok=True)
        common.write_results(cell.parent, run_dir.name, {
            "key": key, "rows": rows, "seconds": seconds[method][f"lr{lr:g}-seed{seed}"]})
        last = rows[-1]
        print(f"[{method} lr {lr:g} seed {seed}] step {last['step']}: test pass@1 "
              f"{last['pass_at_1']:.3f} invalid {last['invalid']:.3f} val pass@1 "
              f"{last['val_pass_at_1']:.3f} ({seconds[method][f'lr{lr:g}-seed{seed}']} s)",
              flush=True)
        return [{"step": 0, **step0}, *rows]

    for method in methods:
        for lr in cfg["learning_rates"]:
            runs[method][lr] = {s: one(method, lr, s) for s in cfg["select_seeds"]}
        val = {lr: float(np.mean([r[-1]["val_pass_at_1"] for r in by_seed.values()]))
               for lr, by_seed in runs[method].items()}
        best = max(val, key=lambda lr: val[lr])
        for s in cfg["seeds"]:
            if s not in runs[method][best]:
                runs[method][best][s] = one(method, best, s)
        results["methods"][method] = summarise(cfg, method, runs[method], val, best,
                                               seconds[method])
    return merge(previous, results, cfg) if previous is not None else results


def summarise(cfg: dict[str, Any], method: str, runs: dict[float, dict[int, list]],
              val: dict[float, float], best: float, seconds: dict[str, float]) -> dict[str, Any]:
    """Mean ± SE over seeds of the best lr's curves; the sweep's validation means."""
    by_seed = [runs[best][s] for s in cfg["seeds"]]
    keys = [cfg["clip_metric"].get(method)] if method in cfg["clip_metric"] else \
        cfg["clip_metrics"]
    clip_key = next((k for k in keys if k in by_seed[0][-1]), None)
    entry: dict[str, Any] = {
        "best_lr": best, "val_pass_at_1_by_lr": {f"{lr:g}": v for lr, v in val.items()},
        "test_pass_at_1_by_lr": {f"{lr:g}": float(np.mean([r[-1]["pass_at_1"]
                                                           for r in by_s.values()]))
                                 for lr, by_s in runs.items()},
        "steps": [r["step"] for r in by_seed[0]], "trained_steps": [r["step"] for r in
                                                                    by_seed[0][1:]],
        "clip_metric": clip_key,
        "ess_metric": ESS_METRIC if ESS_METRIC in by_seed[0][-1] else None,
        "runs": {f"lr{lr:g}": {str(s): rows for s, rows in by_s.items()}
                 for lr, by_s in runs.items()},
        "seconds": seconds,
    }
    for key in ("pass_at_1", "invalid", "dataset_ess_fraction"):
        entry[key] = aggregate.over_seeds(by_seed, key)
    for name, key in (("clip_fraction", clip_key), ("trainer_ess_fraction", entry["ess_metric"])):
        if key is not None:
            entry[name] = aggregate.over_seeds(by_seed, key, first=1)
    entry["final_test_pass_at_1"] = aggregate.mean_and_se([rows[-1]["pass_at_1"]
                                                           for rows in by_seed])
    # the change from the start, per seed (each seed's start is the same μ on the same draws)
    entry["final_minus_start"] = aggregate.mean_and_se(
        [rows[-1]["pass_at_1"] - rows[0]["pass_at_1"] for rows in by_seed])
    return entry


def plot(results: dict[str, Any], path: Path) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # each method's seeds are the runs at its chosen lr (a merged results.json may mix counts)
    labels = {method: redraw.seed_label(entry["runs"][f"lr{entry['best_lr']:g}"])
              for method, entry in results["methods"].items()}
    fig, axes = plt.subplots(1, 4, figsize=(19, 3.9))
    panels = (("pass_at_1", "steps", "test pass@1"), ("invalid", "steps", "invalid rate"),
              ("dataset_ess_fraction", "steps", "ESS fraction of π(y)/μ(y) on the data"),
              ("clip_fraction", "trained_steps", "masked/clipped fraction (trainer)"))
    for i, (method, entry) in enumerate(results["methods"].items()):
        color, style = f"C{i % 10}", ("-", "--")[i // 10 % 2]  # 10 colours, then dashed
        for ax, (key, xs, _) in zip(axes, panels, strict=True):
            if key not in entry:
                continue
            steps = np.array(entry[xs])
            m, se = np.array(entry[key]["mean"]), np.array(entry[key]["se"])
            label = f"{method} ({labels[method]}, lr {entry['best_lr']:g})"
            if key == "clip_fraction":
                label = f"{method}: {entry['clip_metric']}"
            ax.plot(steps, m, color=color, ls=style, label=label, marker=".")
            ax.fill_between(steps, m - se, m + se, color=color, alpha=0.2)
            if key == "dataset_ess_fraction" and "trainer_ess_fraction" in entry:
                t = entry["trainer_ess_fraction"]
                ax.plot(np.array(entry["trained_steps"]), t["mean"], color=color, ls=":",
                        label=f"{method}: trainer {entry['ess_metric']}")
    for ax, (_, _, title) in zip(axes, panels, strict=True):
        ax.set(xlabel="step", title=title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    same = len(set(labels.values())) == 1
    axes[0].set_ylabel(f"mean ± SE, {next(iter(labels.values()))}" if same
                       else "mean ± SE over each method's seeds (legend)")
    skipped = results.get("skipped_methods") or []
    note = f"; not in the registry yet: {', '.join(skipped)}" if skipped else ""
    fig.suptitle("Fixed offline dataset from the quickstart's SFT policy μ, many epochs, "
                 f"each method at its best lr on validation{note}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig


def main() -> None:
    def methods_arg(parser: Any) -> None:
        parser.add_argument("--methods", nargs="+", metavar="NAME",
                            help="run only these methods and merge them into OUT/results.json "
                                 "(the other methods' entries there are kept)")
        parser.add_argument("--merge", nargs="+", type=Path, default=[], metavar="DIR",
                            help="run nothing: join the methods of earlier outputs' "
                                 "results.json (same config and start) into OUT")

    common.run_experiment(__doc__, "offline_epochs", CONFIG, run, plot,
                          cache_name="warm_policy_quickstart", extra=methods_arg)


if __name__ == "__main__":
    main()
