"""Free-running pipeline against the serial loop on the quickstart testbed: test pass@1 against
wall-clock seconds, process CPU seconds and updates.

Per loss (TOPR, GRPO) and seed, from the quickstart's SFT-warmed policy μ, in one process on
two CPU devices (`--xla_force_host_platform_device_count=2`, set here before JAX starts):

- **serial**: `jaxrl-llm online`'s loop with `online.pipeline: off`, `staleness: 0` on the same
  placements (`online.sampler_devices: 1`: device 0 samples, device 1 trains, in turn;
  `online.pipeline.run_pipeline`, the reference the pipeline tests compare with);
- **free, max_staleness s** for s in `max_staleness`: `online.pipeline: free` (the sampler
  thread on device 0 always samples with the newest weights, the trainer on device 1 trains
  batches at most s updates old and drops older ones; `online.free.free_rounds`, the loop
  `online.free.run_free` runs).

Every run trains `updates` optimizer updates and is probed every `eval_every` updates: test
pass@1 on fixed questions with a fixed sampling seed (common random numbers), with the run's
wall-clock and process-CPU seconds since it started (model load and compiles included) *less
the probes' own time*: while a probe runs, the clock is paused and the sampler is held (it
finishes the rollout it is drawing, then waits for the probe; the trainer's wait for that
rollout stays on the clock). Per run also: updates done, samples received / trained / dropped,
the version-lag histogram of the trained samples and each side's busy / waiting seconds, from
the loop's metric rows (docs/online.md § Pipeline).

Runs go seed-major, serial first in each (loss, seed): the process caches the compiled train
step by config, seed included (`train.trainer.cached_train_step`), so that serial run compiles
it and the free runs after it reuse it; compare the clocks from the first probe on (README).

    python experiments/free_running.py --out runs/experiments/free_running [--smoke]
        [--seeds 0 1] [--deadline-min M] [--methods async]

`--methods async` runs the config's `methods_async` (TOPR, DPPO, OAPL, VCPO at the rates claim 9
chose on their μ) in place of `methods` (TOPR, GRPO).
"""

from __future__ import annotations

import os
import re

# two host devices (sampler, trainer), before anything imports jax: replaces any device count.
# Run as a script only: `experiments/redraw.py` imports this module for its `plot`, and a
# changed XLA_FLAGS would reach every process the importer starts later.
if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                                     os.environ.get("XLA_FLAGS", "")) + \
        " --xla_force_host_platform_device_count=2"

import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script
from experiments import aggregate, common, redraw, staleness

CONFIG = Path(__file__).with_name("free_running.yaml")


class Clock:
    """Wall and process-CPU seconds since it started, less the time spent `paused()`."""

    def __init__(self) -> None:
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()
        self.paused_wall = self.paused_cpu = 0.0

    def now(self) -> dict[str, float]:
        return {"wall_s": time.perf_counter() - self.wall0 - self.paused_wall,
                "cpu_s": time.process_time() - self.cpu0 - self.paused_cpu}

    @contextmanager
    def paused(self) -> Iterator[None]:
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.paused_wall += time.perf_counter() - wall
            self.paused_cpu += time.process_time() - cpu


def arm_names(cfg: dict[str, Any]) -> list[str]:
    return ["serial", *(f"free-{s}" for s in cfg["max_staleness"])]


def arm_config(out: Path, warm: dict[str, Any], cfg: dict[str, Any], method: str, arm: str,
               seed: int) -> Any:
    """The `jaxrl-llm online` config of one run: sampler on device 0, trainer on device 1."""
    online: dict[str, Any] = {"sampler_devices": 1}
    if arm != "serial":
        online.update(pipeline="free", max_staleness=int(arm.split("-")[1]))
    return staleness.online_config(out, warm, cfg, method, 0, seed, {"online": online},
                                   name=f"{method}-{arm}-seed{seed}")


def run_probed(config: Any, probe: Callable[[Any], dict[str, float]], every: int
               ) -> dict[str, Any]:
    """One run of `config` (serial or free), probed every `every` updates on a paused clock;
    its probe rows, the clock at the end and the loop's counters (module docstring)."""
    from jaxrl_llm.online.free import NO_END, free_rounds, rounds_ahead
    from jaxrl_llm.online.pipeline import open_run, run_pipeline
    from jaxrl_llm.online.sampler_side import Feed

    total = config.online.rounds * config.online.updates_per_round
    if total % every:
        raise SystemExit(f"updates={total} must be a multiple of eval_every={every}")
    clock, rows = Clock(), []
    gate = threading.Lock()  # held by the sampler while it samples, by the trainer while probing

    def measure(updates: int, model: Any) -> dict[str, float]:
        at = clock.now()
        with gate, clock.paused():
            row = probe(model)
        rows.append({"updates": updates, **{k: round(v, 3) for k, v in at.items()}, **row})
        return row

    if config.online.pipeline == "off":  # in turn: nothing samples while the hook runs
        result = run_pipeline(config, progress=False, eval_every=every,
                              eval_hook=lambda updates, policy: measure(updates, policy.model))
    else:  # online.free.run_free's loop, with the sampler gated and each update counted
        opened = open_run(config)
        side, policy = opened.side, opened.policy
        side.free = True
        sample, step, done = side.sample, policy.step, [0]

        def gated_sample(round_index: int, position: int) -> Any:
            with gate:
                return sample(round_index, position)

        def probed_step(records: Any) -> dict[str, float]:
            metrics = step(records)
            done[0] += 1
            if done[0] % every == 0:
                measure(done[0], policy.model)
            return metrics

        side.sample, policy.step = gated_sample, probed_step
        result = free_rounds(opened, lambda: Feed(side, 0, NO_END, opened.run.position,
                                                  overlap=True, ahead=rounds_ahead(config)),
                             progress=False)
    end = clock.now()
    if result.updates != total or [r["updates"] for r in rows] != list(
            range(every, total + 1, every)):
        raise RuntimeError(f"{config.run_dir}: {result.updates} updates, probes at "
                           f"{[r['updates'] for r in rows]}")
    return {"rows": rows, "end": {k: round(v, 2) for k, v in end.items()},
            **counters(Path(config.run_dir) / "metrics.jsonl", config.train.batch_size)}


def counters(metrics_path: Path, batch_size: int) -> dict[str, Any]:
    """The run's totals from its metric rows: lag histogram (samples per lag), samples
    received / trained / dropped (free), and each side's busy / waiting / sync seconds."""
    rows = [json.loads(x) for x in metrics_path.read_text().splitlines() if x]
    hist: dict[str, float] = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith("pipeline/lag_hist_"):
                lag = k.rsplit("_", 1)[1]
                hist[lag] = hist.get(lag, 0.0) + v
    sides = {k.split("/")[1]: round(float(sum(r.get(k, 0.0) for r in rows)), 2)
             for k in ("pipeline/sampler_busy_s", "pipeline/sampler_wait_s",
                       "pipeline/trainer_busy_s", "pipeline/trainer_wait_s",
                       "pipeline/trainer_sync_s")}
    trained = sum(r.get("round_updates", 0) for r in rows) * batch_size
    last = rows[-1]
    received = int(last.get("pipeline/received_total", trained))
    dropped = int(last.get("pipeline/dropped_total", 0))
    lags = [int(k) for k, v in hist.items() for _ in range(int(v))]
    return {"lag_hist": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
            "lag_mean": float(np.mean(lags)) if lags else 0.0,
            "samples": {"received": received, "trained": int(last.get(
                "pipeline/trained_total", trained)), "dropped": dropped,
                "dropped_fraction": dropped / received if received else 0.0},
            "seconds_by_side": sides}


def summarise(runs: dict[str, dict[str, Any]], start: dict[str, float]) -> dict[str, Any]:
    """Mean ± SE over seeds of each probe's pass@1, wall and CPU seconds (the start, μ, at 0),
    and of the run totals."""
    by_seed = [[{"updates": 0, "wall_s": 0.0, "cpu_s": 0.0, **start}, *r["rows"]]
               for r in runs.values()]
    out: dict[str, Any] = {"seeds": sorted(int(s) for s in runs),
                           "updates": [r["updates"] for r in by_seed[0]]}
    for key in ("pass_at_1", "wall_s", "cpu_s", "invalid"):
        out[key] = aggregate.over_seeds(by_seed, key)
    for key in ("wall_s", "cpu_s"):
        out[f"end_{key}"] = aggregate.mean_and_se([r["end"][key] for r in runs.values()])
    out["final_pass_at_1"] = {**aggregate.mean_and_se([r["rows"][-1]["pass_at_1"]
                                                       for r in runs.values()]),
                              "per_seed": [r["rows"][-1]["pass_at_1"] for r in runs.values()]}
    for key in ("dropped_fraction", "dropped", "received"):
        out[key] = aggregate.mean_and_se([r["samples"][key] for r in runs.values()])
    out["lag_mean"] = aggregate.mean_and_se([r["lag_mean"] for r in runs.values()])
    hist: dict[str, float] = {}
    for r in runs.values():
        for lag, n in r["lag_hist"].items():
            hist[lag] = hist.get(lag, 0.0) + n / len(runs)
    out["lag_hist_mean"] = dict(sorted(hist.items(), key=lambda kv: int(kv[0])))
    out["seconds_by_side_mean"] = {k: round(float(np.mean([r["seconds_by_side"][k]
                                                           for r in runs.values()])), 2)
                                   for k in next(iter(runs.values()))["seconds_by_side"]}
    return out


def run(args: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    import jax

    if args.methods == "async":  # checked before the warm policy is built (minutes)
        if "methods_async" not in cfg:
            raise SystemExit(f"--methods async: {CONFIG} has no `methods_async` in this section")
        cfg = {**cfg, "methods": cfg["methods_async"]}
    warm = common.warm_policy_quickstart(args.cache, smoke=args.smoke)
    if len(jax.devices()) != 2:
        raise SystemExit(f"{len(jax.devices())} devices: this experiment runs on 2 (XLA_FLAGS)")
    first = next(iter(cfg["methods"]))
    config = arm_config(args.out, warm, cfg, first, "serial", 0)
    config.generate.batch_size = cfg["eval_batch_size"]  # the probe's (the runs have their own)
    probe = common.Probe(config, num_questions=cfg["eval_questions"], n=cfg["eval_n"])
    probe.progress = False
    start = probe(common.load_policy(warm["model"], config))
    print(f"[μ] test pass@1 {start['pass_at_1']:.3f}", flush=True)
    deadline = time.time() + (args.deadline_min * 60 if args.deadline_min else float("inf"))
    done: dict[tuple[str, str, int], dict[str, Any]] = {}
    # seed-major: every (loss, arm) gets seed 0 before any gets seed 1
    for seed in cfg["seeds"]:
        for method in cfg["methods"]:
            for arm in arm_names(cfg):
                if time.time() >= deadline:
                    break
                run_cfg = arm_config(args.out, warm, cfg, method, arm, seed)
                r = run_probed(run_cfg, probe, cfg["eval_every"])
                done[(method, arm, seed)] = r
                print(f"[{method} {arm} seed {seed}] pass@1 {r['rows'][-1]['pass_at_1']:.3f} "
                      f"after {cfg['updates']} updates: {r['end']['wall_s']:.1f} s wall, "
                      f"{r['end']['cpu_s']:.1f} CPU-s; dropped {r['samples']['dropped']}, "
                      f"lag mean {r['lag_mean']:.2f}", flush=True)
    # the seeds every (loss, arm) finished: the summary and the figure's seed counts
    complete = [s for s in cfg["seeds"] if all((m, a, s) in done for m in cfg["methods"]
                                               for a in arm_names(cfg))]
    if not complete:
        raise SystemExit("no seed finished for every loss and arm before the deadline")
    results: dict[str, Any] = {
        "config": {**cfg, "seeds": complete, "seeds_planned": cfg["seeds"]},
        "warm_policy": warm, "start": start, "devices": [str(d) for d in jax.devices()],
        "runs_finished": len(done), "methods": {}}
    for method in cfg["methods"]:
        results["methods"][method] = {}
        for arm in arm_names(cfg):
            runs = {str(s): done[(method, arm, s)] for s in complete}
            results["methods"][method][arm] = {
                **summarise(runs, start),
                "runs": runs}
    return results


def options(parser: Any) -> None:
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="run only these of the config's seeds")
    parser.add_argument("--deadline-min", type=float, default=None,
                        help="start no run after this many minutes; summarise the seeds "
                             "every loss and arm finished")
    parser.add_argument("--methods", choices=("default", "async"), default="default",
                        help="the config's `methods` (default) or `methods_async`")


def plot(results: dict[str, Any], path: Path) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(results["methods"])
    axes_keys = (("wall_s", "wall-clock seconds (probes excluded)"),
                 ("cpu_s", "process CPU seconds (probes excluded)"), ("updates", "updates"))
    fig, axes = plt.subplots(len(methods), 3, figsize=(17, 4.2 * len(methods)), squeeze=False,
                             layout="constrained")
    for row, method in enumerate(methods):
        arms = results["methods"][method]
        for i, (arm, e) in enumerate(arms.items()):
            name = "serial (pipeline off)" if arm == "serial" else \
                f"free, max_staleness {arm.split('-')[1]}"
            label = f"{name}, {redraw.seed_label(e['seeds'])}"
            y, yse = e["pass_at_1"]["mean"], e["pass_at_1"]["se"]
            for ax, (key, xlabel) in zip(axes[row], axes_keys, strict=True):
                if key == "updates":
                    ax.errorbar(e["updates"], y, yerr=yse, marker="o", ms=3, capsize=2,
                                color=f"C{i}", label=label)
                else:
                    ax.errorbar(e[key]["mean"], y, xerr=e[key]["se"], yerr=yse, marker="o",
                                ms=3, capsize=2, color=f"C{i}", label=label)
                ax.set(xlabel=xlabel, ylabel="test pass@1",
                       title=f"{method}: pass@1 vs {xlabel.split(' (')[0]}")
    for ax in axes.flat:  # μ's probe, the start of every curve
        ax.axhline(results["start"]["pass_at_1"], color="gray", ls=":", label="μ (start)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle("Free-running pipeline vs the serial loop, quickstart testbed, 2 CPU devices "
                 "(sampler 1, trainer 1); mean ± SE over seeds, a shared machine", fontsize=10)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig


def main() -> None:
    common.run_experiment(__doc__, "free_running", CONFIG, run, plot,
                          cache_name="warm_policy_quickstart", extra=options)


if __name__ == "__main__":
    main()
