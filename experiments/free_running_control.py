"""Claim 12's per-update result under control: why did the free-running arms of
`experiments/free_running.py` end above the serial loop after 48 updates?

The arms of claim 12 differ in more than the lag: a free run trains the rounds its timing lets
through (other prompts, other sampling seeds, some batches dropped), while the serial run trains
round u at update u. Here each difference is held equal in turn, per loss and seed, from the
quickstart's SFT-warmed policy μ, on claim 12's two CPU devices (device 0 samples, device 1
trains) with claim 12's sizes (`free_running_control.yaml`):

- **serial**: claim 12's reference (`pipeline: off`, `staleness: 0`);
- **serial-b**: the same loop with another sampling stream (the sampler's seed shifted by
  `stream_offset`; prompts, weights and train step unchanged): how far two on-policy runs
  that differ only in their draws end apart;
- **lag-s**: the same loop with `online.staleness: s` (the deterministic pipeline's
  computation): update u trains round u's batch, which θ_{u−s} sampled — the serial run's
  prompts and sampling seeds round for round (common random numbers), only the weights that
  drew them differ;
- **free-s**: claim 12's free arm (`pipeline: free`, `max_staleness: s`).

Every update is recorded: the round it trained (its prompts and sampling seed), the version lag,
the batch's composition (mean reward, positives, invalid and truncated completions, lengths),
the loss's log π − log μ and clip fractions, the optimizer step and learning rate; a free run
also records what it dropped. Probes as claim 12 (test pass@1 on fixed questions and draws
every `eval_every` updates, with the optimizer step at which each ran); the summary pairs every
arm with the serial run of its seed (arm − serial per seed, mean ± SE).

    python experiments/free_running_control.py --out runs/experiments/free_running_control
        [--smoke] [--seeds 0 1]

Each run's records go to OUT/records/NAME.json; a run whose file exists is read back, not run
again (a cut run, or one extended by more seeds, goes on from there).
"""

from __future__ import annotations

import os
import re

# two host devices (sampler, trainer) before anything imports jax, as free_running.py does
if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                                     os.environ.get("XLA_FLAGS", "")) + \
        " --xla_force_host_platform_device_count=2"

import hashlib
import json
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script
from experiments import aggregate, common, redraw, staleness

CONFIG = Path(__file__).with_name("free_running_control.yaml")
LOSS_KEYS = ("loss/log_ratio_mean", "loss/log_ratio_mean_neg", "loss/log_ratio_mean_pos",
             "loss/clip_frac", "loss/clip_frac_neg_high", "loss/ess_fraction")
BATCH_KEYS = ("reward", "positives", "invalid", "truncated", "length_mean")


def parse_arm(arm: str) -> tuple[str, int]:
    """('serial' | 'serial-b' | 'lag' | 'free', s) of an arm name."""
    if arm in ("serial", "serial-b"):
        return arm, 0
    kind, _, s = arm.partition("-")
    if kind not in ("lag", "free") or not s.isdigit():
        raise ValueError(f"arm {arm!r}: one of serial, serial-b, lag-S, free-S")
    return kind, int(s)


def arm_config(out: Path, warm: dict[str, Any], cfg: dict[str, Any], method: str, arm: str,
               seed: int) -> Any:
    """The `jaxrl-llm online` config of one run: sampler on device 0, trainer on device 1."""
    kind, s = parse_arm(arm)
    online: dict[str, Any] = {"sampler_devices": 1}
    if kind == "free":
        online.update(pipeline="free", max_staleness=s)
    return staleness.online_config(out, warm, cfg, method, s if kind == "lag" else 0, seed,
                                   {"online": online}, name=f"{method}-{arm}-seed{seed}")


def batch_composition(records: list[Any], max_new_tokens: int) -> dict[str, float]:
    """What a batch holds: mean raw reward, positives, invalid and truncated completions (no
    EOS within `max_new_tokens`), mean completion length in tokens."""
    raw = np.asarray([r.raw_reward if r.raw_reward is not None else r.reward for r in records])
    lengths = np.asarray([r.completion_ids.size for r in records])
    return {"reward": float(raw.mean()), "positives": float((raw > 0).sum()),
            "invalid": float(sum(r.invalid for r in records)),
            "truncated": float((lengths >= max_new_tokens).sum()),
            "length_mean": float(lengths.mean())}


def completions_digest(records: list[Any]) -> str:
    """A short hash of a batch's completion tokens (two runs trained the same draws or not)."""
    return hashlib.sha1(b"".join(r.completion_ids.tobytes() for r in records)).hexdigest()[:16]


def run_recorded(config: Any, probe: Any, every: int, stream_offset: int = 0) -> dict[str, Any]:
    """One run of `config` with every sampled round and every update recorded, probed after
    every `every` updates; (probes, sampled rounds, updates)."""
    from jaxrl_llm.online.free import NO_END, free_rounds, rounds_ahead
    from jaxrl_llm.online.lag import total_rounds, version_of
    from jaxrl_llm.online.pipeline import open_run, train_rounds
    from jaxrl_llm.online.sampler_side import Feed

    o, max_new = config.online, config.generate.max_new_tokens
    free = o.pipeline == "free"
    opened = open_run(config)
    side, policy, run = opened.side, opened.policy, opened.run
    side.free = free
    if stream_offset:  # serial-b: only the sampler's seed moves (rounds.sampling_seed)
        side.config = config.model_copy(update={"seed": config.seed + stream_offset})
    sample, step = side.sample, policy.step
    gate = threading.Lock()  # the sampler holds it while sampling, the trainer while probing
    sampled: dict[int, dict[str, Any]] = {}
    updates: list[dict[str, Any]] = []
    probes: list[dict[str, Any]] = []

    def recorded_sample(round_index: int, position: int) -> Any:
        with gate:
            done = sample(round_index, position)
        sampled[done.round] = {"round": done.round, "version": done.version,
                               **batch_composition([r for b in done.batches for r in b],
                                                   max_new)}
        return done

    def recorded_step(records: Any) -> dict[str, float]:
        index = len(updates)  # updates before this one: the weights θ_index train it
        round_index = records[0].group_id // o.prompts_per_round
        version = sampled[round_index]["version"] if free else version_of(config, round_index)
        metrics = step(records)
        updates.append({"round": round_index, "lag": index - version,
                        "step": int(policy.state.step), "digest": completions_digest(records),
                        "learning_rate": float(metrics["learning_rate"]),
                        **batch_composition(records, max_new),
                        **{k: float(metrics[k]) for k in LOSS_KEYS if k in metrics}})
        if len(updates) % every == 0:
            with gate:
                probes.append({"updates": len(updates), "step": int(policy.state.step),
                               **probe(policy.model)})
        return metrics

    side.sample, policy.step = recorded_sample, recorded_step
    if free:  # online.free.run_free's loop
        free_rounds(opened, lambda: Feed(side, 0, NO_END, run.position, overlap=True,
                                         ahead=rounds_ahead(config)), progress=False)
    else:  # pipeline.run_pipeline's, in turn (pipeline: off)
        train_rounds(opened, lambda: Feed(side, run.round, total_rounds(config), run.position,
                                          overlap=False), progress=False)
    return {"probes": probes, "sampled": [sampled[r] for r in sorted(sampled)],
            "updates": updates}


def run_summary(record: dict[str, Any]) -> dict[str, Any]:
    """One run's totals: probes, what its updates trained on (means per update), what a free
    run dropped, the rounds trained, the lags, the loss's ratio statistics."""
    ups, trained = record["updates"], {u["round"] for u in record["updates"]}
    dropped = [s for s in record["sampled"] if s["round"] not in trained
               and s["round"] < max(trained)]  # rounds past the last trained were in flight
    mean = (lambda rows, key: float(np.mean([r[key] for r in rows])))
    return {"rows": record["probes"],
            "trained": {k: mean(ups, k) for k in BATCH_KEYS},
            "dropped": {"rounds": len(dropped), **({k: mean(dropped, k) for k in BATCH_KEYS}
                                                    if dropped else {})},
            "rounds_trained": [u["round"] for u in ups], "lags": [u["lag"] for u in ups],
            "digests": [u["digest"] for u in ups],
            "learning_rates": sorted({u["learning_rate"] for u in ups}),
            "loss": {k: mean(ups, k) for k in LOSS_KEYS if k in ups[0]}}


def summarise(runs: dict[str, dict[str, Any]], serial: dict[str, dict[str, Any]],
              start: dict[str, float]) -> dict[str, Any]:
    """Mean ± SE over seeds of an arm's probes and totals, and of (arm − serial) per seed."""
    seeds = sorted(runs, key=int)
    by_seed = [[{"updates": 0, "step": 0, **start}, *runs[s]["rows"]] for s in seeds]
    out: dict[str, Any] = {"seeds": [int(s) for s in seeds],
                           "updates": [r["updates"] for r in by_seed[0]],
                           "optimizer_steps": [r["step"] for r in by_seed[0]]}
    for key in ("pass_at_1", "invalid"):
        out[key] = aggregate.over_seeds(by_seed, key)
        out[f"{key}_minus_serial"] = aggregate.over_seeds(
            [[a[key] - b[key] for a, b in zip(runs[s]["rows"], serial[s]["rows"], strict=True)]
             for s in seeds], lambda x: x)
    for part in ("trained", "dropped"):  # a key every seed has (a run that dropped nothing)
        keys = set.intersection(*(set(runs[s][part]) for s in seeds))
        out[part] = {k: aggregate.mean_and_se([runs[s][part][k] for s in seeds])
                     for k in runs[seeds[0]][part] if k in keys}
    out["loss"] = {k: aggregate.mean_and_se([runs[s]["loss"][k] for s in seeds])
                   for k in runs[seeds[0]]["loss"]}
    out["lag_mean"] = aggregate.mean_and_se([np.mean(runs[s]["lags"]) for s in seeds])
    out["same_rounds_as_serial"] = all(runs[s]["rounds_trained"] == serial[s]["rounds_trained"]
                                       for s in seeds)
    # the updates that trained the very draws the serial run trained (same tokens)
    out["same_draws_as_serial"] = aggregate.mean_and_se(
        [sum(a == b for a, b in zip(runs[s]["digests"], serial[s]["digests"], strict=True))
         for s in seeds])
    return out


def run(args: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    import jax

    warm = common.warm_policy_quickstart(args.cache, smoke=args.smoke)
    if len(jax.devices()) != 2:
        raise SystemExit(f"{len(jax.devices())} devices: this experiment runs on 2 (XLA_FLAGS)")
    if cfg["arms"][0] != "serial":
        raise SystemExit("free_running_control.yaml: arms must start with serial (the pairs' "
                         "reference)")
    for arm in cfg["arms"]:
        parse_arm(arm)
    first = next(iter(cfg["methods"]))
    config = arm_config(args.out, warm, cfg, first, "serial", 0)
    config.generate.batch_size = cfg["eval_batch_size"]  # the probe's (the runs have their own)
    probe = common.Probe(config, num_questions=cfg["eval_questions"], n=cfg["eval_n"])
    probe.progress = False
    start = probe(common.load_policy(warm["model"], config))
    print(f"[μ] test pass@1 {start['pass_at_1']:.3f}", flush=True)
    summaries: dict[tuple[str, str, int], dict[str, Any]] = {}
    for seed in cfg["seeds"]:  # seed-major: every (loss, arm) gets seed 0 before seed 1
        for method in cfg["methods"]:
            for arm in cfg["arms"]:
                name = f"{method}-{arm}-seed{seed}"
                path = args.out / "records" / f"{name}.json"
                if path.exists():  # finished by an earlier invocation: a cut run is extended
                    record = json.loads(path.read_text())
                else:
                    offset = cfg["stream_offset"] if arm == "serial-b" else 0
                    record = run_recorded(arm_config(args.out, warm, cfg, method, arm, seed),
                                          probe, cfg["eval_every"], offset)
                    path.parent.mkdir(exist_ok=True)
                    common.write_results(path.parent, name, record)  # every update
                summaries[(method, arm, seed)] = s = run_summary(record)
                print(f"[{name}] pass@1 {[r['pass_at_1'] for r in s['rows']]}, trained reward "
                      f"{s['trained']['reward']:.3f}, lag mean {np.mean(s['lags']):.2f}, "
                      f"dropped {s['dropped']['rounds']}", flush=True)
    results: dict[str, Any] = {"config": cfg, "warm_policy": warm, "start": start,
                               "devices": [str(d) for d in jax.devices()], "methods": {}}
    for method in cfg["methods"]:
        serial = {str(s): summaries[(method, "serial", s)] for s in cfg["seeds"]}
        results["methods"][method] = {}
        for arm in cfg["arms"]:
            runs = {str(s): summaries[(method, arm, s)] for s in cfg["seeds"]}
            results["methods"][method][arm] = {
                **summarise(runs, serial, start),
                "runs": {s: {k: v for k, v in r.items() if k not in ("rounds_trained", "lags", "digests")}
                         for s, r in runs.items()}}
    return results


def plot(results: dict[str, Any], path: Path) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(results["methods"])
    fig, axes = plt.subplots(len(methods), 2, figsize=(14, 4.4 * len(methods)), squeeze=False,
                             layout="constrained")
    for row, method in enumerate(methods):
        arms = results["methods"][method]
        names = list(arms)
        for i, (arm, e) in enumerate(arms.items()):
            axes[row][0].errorbar(e["updates"], e["pass_at_1"]["mean"], yerr=e["pass_at_1"]["se"],
                                  marker="o", ms=3, capsize=2, color=f"C{i}",
                                  label=f"{arm}, {redraw.seed_label(e['seeds'])}")
        last = [arms[a]["pass_at_1_minus_serial"] for a in names]
        ax = axes[row][1]
        ax.errorbar(range(len(names)), [d["mean"][-1] for d in last],
                    yerr=[d["se"][-1] for d in last], fmt="o", capsize=3, color="k",
                    label=f"arm − serial at the last probe, {redraw.seed_label(arms['serial']['seeds'])}")
        ax.axhline(0.0, color="gray", ls=":")
        ax.set_xticks(range(len(names)), names)
        ax.set(ylabel="test pass@1, arm − serial (same seed)",
               title=f"{method}: paired difference at update {arms['serial']['updates'][-1]}")
        axes[row][0].axhline(results["start"]["pass_at_1"], color="gray", ls=":", label="μ (start)")
        axes[row][0].set(xlabel="updates", ylabel="test pass@1",
                         title=f"{method}: pass@1 vs updates, mean ± SE over seeds")
        for a in axes[row]:
            a.legend(fontsize=7)
            a.grid(alpha=0.3)
    fig.suptitle("Claim 12 under control: serial, another sampling stream, fixed lag s (same "
                 "prompts and seeds as serial), free-running (quickstart testbed, 2 CPU devices)",
                 fontsize=10)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig


def options(parser: Any) -> None:
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="run only these of the config's seeds")


def main() -> None:
    common.run_experiment(__doc__, "free_running_control", CONFIG, run, plot,
                          cache_name="warm_policy_quickstart", extra=options)


if __name__ == "__main__":
    main()
