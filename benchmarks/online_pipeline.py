"""Serial `jaxrl-llm online` against the deterministic pipeline (`online.pipeline:
deterministic`, the sampler on its own device ahead of the trainer), in one run, on the same
machine, config and cores: updates per hour, trained tokens per second, and where each side's
time goes.

Both are the user's command as a subprocess pinned to the same cores (`taskset`): serial on one
CPU device (XLA's intra-op threads use both pinned cores), the pipeline on two CPU devices, one
sampling and one training (`online.sampler_devices: 1`), each computing on one thread
(`--xla_cpu_multi_thread_eigen=false`: one core per side), staleness 2 in both. Rates are over the
steady state: from the end of the first round that trained (its compiles) to the last row.
Runs alternate serial / pipeline `--repeats` times (a shared machine's load moves).

    python benchmarks/online_pipeline.py [--testbeds quickstart smollm2] [--rounds 12]
        [--repeats 2] [--smollm2-rounds 5] [--smollm2-repeats 1] [--cores 0,1] [--smoke]
        [--out benchmarks/results/online_pipeline.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]

# TOPR, T = 1, each completion until EOS or the token cap, staleness 2, μ auto
COMMON: dict[str, Any] = {
    "seed": 0, "loss": {"name": "topr"},
    "online": {"staleness": 2, "prompts_per_round": 2, "checkpoint_every": 1000},
}
TESTBEDS: dict[str, dict[str, Any]] = {
    # the quickstart's policy architecture (configs/quickstart.yaml: 4 layers, d 128, vocab
    # 384), random init (it never stops early: every completion is 40 tokens), its task; the
    # default tokenizer (not the quickstart's BPE) makes prompts longer: max_seq_len 160
    "quickstart": {
        "model": {"source": "random", "family": "llama", "vocab_size": 384, "hidden_size": 128,
                  "intermediate_size": 384, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
                  "max_position_embeddings": 128},
        "optim": {"name": "adamw", "learning_rate": 3e-4, "clip_norm": 1.0},
        "data": {"task": "arithmetic", "num_prompts": 256,
                 "task_options": {"min_ops": 1, "max_ops": 2, "max_operand": 9}},
        "generate": {"n": 8, "temperature": 1.0, "max_new_tokens": 40, "batch_size": 2},
        "train": {"batch_size": 16, "max_seq_len": 160},
    },
    # the packaged SmolLM2-135M on arithmetic prompts
    "smollm2": {
        "model": {"source": "smollm2"},
        "optim": {"name": "adamw", "learning_rate": 1e-6, "clip_norm": 1.0},
        "data": {"task": "arithmetic", "num_prompts": 256},
        "generate": {"n": 4, "temperature": 1.0, "max_new_tokens": 128, "batch_size": 2},
        # prompts ≤ 72 tokens through its chat template, + 128 new
        "train": {"batch_size": 8, "max_seq_len": 208},
    },
}


def config(testbed: str, rounds: int, *, pipeline: bool) -> dict[str, Any]:
    tree = json.loads(json.dumps({**COMMON, **TESTBEDS[testbed]}))
    tree["online"]["rounds"] = rounds
    if pipeline:
        tree["online"].update(pipeline="deterministic", sampler_devices=1)
    tree["run_dir"] = "run"
    return tree


def run(tree: dict[str, Any], cwd: Path, *, devices: int, cores: str) -> dict[str, Any]:
    """One `jaxrl-llm online` subprocess pinned to `cores`; its wall time and rows."""
    if cwd.exists():
        shutil.rmtree(cwd)
    cwd.mkdir(parents=True)
    (cwd / "online.yaml").write_text(yaml.safe_dump(tree))
    # two devices = the pipeline: one compute thread per device, i.e. one core per side
    flags = "" if devices == 1 else " --xla_cpu_multi_thread_eigen=false"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}{flags}"}
    pin = ["taskset", "-c", cores] if shutil.which("taskset") and cores else []
    start = time.perf_counter()
    out = subprocess.run([*pin, sys.executable, "-m", "jaxrl_llm.cli", "online", "--config",
                          "online.yaml", "--no-progress"], cwd=cwd, env=env,
                         capture_output=True, text=True)
    wall = time.perf_counter() - start
    if out.returncode:
        raise SystemExit(f"online failed in {cwd}:\n{out.stderr[-3000:]}")
    rows = [json.loads(x) for x in (cwd / "run/metrics.jsonl").read_text().splitlines() if x]
    return {"wall_s": wall, "rows": rows}


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Steady-state rates (after the first round that trained) and the time per side."""
    rows = result["rows"]
    first = next(i for i, r in enumerate(rows) if r.get("round_updates", 0) > 0)
    window = rows[first + 1:]
    seconds = rows[-1]["time"] - rows[first]["time"]
    updates = sum(r["round_updates"] for r in window)
    tokens = sum(r.get("completion_tokens", 0.0) * r["round_updates"] for r in window)
    out: dict[str, Any] = {
        "wall_s": round(result["wall_s"], 1), "updates": rows[-1]["updates"],
        "steady_updates": updates, "steady_s": round(seconds, 2),
        "updates_per_hour": round(3600 * updates / seconds, 1),
        "trained_tokens_per_s": round(tokens / seconds, 1),
        "first_training_round_s": round(rows[first]["time"] - rows[0]["time"], 1),
    }
    keys = [k for k in window[0] if k.startswith("seconds_") or (
        k.startswith("pipeline/") and k.endswith("_s") and k != "pipeline/round_s")]
    out["per_round_mean_s"] = {k: round(sum(r.get(k, 0.0) for r in window) / len(window), 3)
                               for k in keys}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--testbeds", nargs="+", default=["quickstart", "smollm2"],
                        choices=sorted(TESTBEDS))
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--smollm2-rounds", type=int, default=5,
                        help="SmolLM2's rounds (each about a minute here)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--smollm2-repeats", type=int, default=1)
    parser.add_argument("--cores", default="0,1", help="taskset's core list for both runs")
    parser.add_argument("--smoke", action="store_true", help="3 rounds, 1 repeat (tests)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/online_pipeline.json"))
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.smollm2_rounds, args.repeats = 3, 3, 1
    results: dict[str, Any] = {}
    out = {
        "benchmark": "serial `online` (1 CPU device, 2 threads) against `online.pipeline: "
                     "deterministic` (2 CPU devices: 1 samples, 1 trains, 1 thread each), "
                     "staleness 2, TOPR, T = 1 until EOS or the cap, each a subprocess pinned "
                     "to the same cores; steady-state rates after the first round that trained",
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "pinned_cores": args.cores, "python": platform.python_version()},
        "rounds": {"quickstart": args.rounds, "smollm2": args.smollm2_rounds},
        "repeats": {"quickstart": args.repeats, "smollm2": args.smollm2_repeats},
        "results": results,
    }
    with tempfile.TemporaryDirectory(prefix="online-pipeline-") as tmp:
        for testbed in args.testbeds:
            runs: dict[str, list[dict[str, Any]]] = {"serial": [], "pipeline": []}
            for i in range(args.smollm2_repeats if testbed == "smollm2" else args.repeats):
                for name in ("serial", "pipeline"):
                    pipe = name == "pipeline"
                    rounds = args.smollm2_rounds if testbed == "smollm2" else args.rounds
                    done = run(config(testbed, rounds, pipeline=pipe),
                               Path(tmp) / f"{testbed}-{name}-{i}", devices=2 if pipe else 1,
                               cores=args.cores)
                    runs[name].append(summarize(done))
                    print(testbed, name, i, json.dumps(runs[name][-1]), flush=True)
            rate = {name: sum(r["updates_per_hour"] for r in rs) / len(rs)
                    for name, rs in runs.items()}
            tokens = {name: sum(r["trained_tokens_per_s"] for r in rs) / len(rs)
                      for name, rs in runs.items()}
            results[testbed] = {
                "config": config(testbed, args.smollm2_rounds if testbed == "smollm2"
                                 else args.rounds, pipeline=True), "runs": runs,
                "updates_per_hour": {k: round(v, 1) for k, v in rate.items()},
                "trained_tokens_per_s": {k: round(v, 1) for k, v in tokens.items()},
                "speedup_updates_per_hour": round(rate["pipeline"] / rate["serial"], 2),
                "load_average_after": list(os.getloadavg())}
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # after each testbed
            Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({t: {k: v for k, v in r.items() if k not in ("config", "runs")}
                      for t, r in results.items()}))


if __name__ == "__main__":
    main()
