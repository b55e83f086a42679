"""The same work through `jaxrl-llm iterate` (one update per iteration) and `jaxrl-llm online`:
wall time of each, in one run, and where the time goes.

Work: R rounds; each samples n completions of P fresh arithmetic prompts from the current
policy, rewards them, re-scores μ with the trainer's numerics (iterate's `score` stage; online
with `online.mu_source: trainer`), and takes one TOPR update on the P·n records. `iterate`
runs generate → score → curate → train → export per iteration (evaluation off), handing over
through files; `online` keeps one train state that the sampler reads. Both are the user's
commands, run as subprocesses on one CPU device; times include start-up and compiles.

    python benchmarks/online_vs_iterate.py [--rounds 24] [--smoke] [--out benchmarks/results/online_vs_iterate.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ("model: {vocab_size: 128, hidden_size: 64, intermediate_size: 128, num_layers: 2, "
         "num_heads: 4, num_kv_heads: 2, max_position_embeddings: 256}\n")


def configs(rounds: int, prompts: int, n: int, new_tokens: int) -> dict[str, str]:
    common = (MODEL + "seed: 1\nloss: {name: topr}\noptim: {learning_rate: 1.0e-3}\n"
              f"generate: {{n: {n}, max_new_tokens: {new_tokens}, batch_size: {prompts}, "
              f"score_batch_size: {prompts * n}}}\n")
    return {
        "iterate": common + "run_dir: it\n"
        f"train: {{steps: 1, batch_size: {prompts * n}, max_seq_len: 160, log_every: 1}}\n"
        f"data: {{task: arithmetic, num_prompts: {prompts}}}\n"
        f"iterate: {{iterations: {rounds}, evaluate_initial: false, evaluate: false}}\n",
        "online": common + "run_dir: online_run\n"
        f"train: {{batch_size: {prompts * n}, max_seq_len: 160}}\n"
        f"data: {{task: arithmetic, num_prompts: {prompts * rounds}}}\n"
        f"online: {{rounds: {rounds}, prompts_per_round: {prompts}, staleness: 0, "
        "mu_source: trainer, checkpoint_every: 1}\n",
    }


def run(command: str, cwd: Path) -> float:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), "XLA_FLAGS": ""}
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "jaxrl_llm.cli", command, "--config",
                          f"{command}.yaml", "--no-progress"], cwd=cwd, env=env,
                         capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if out.returncode:
        raise SystemExit(f"{command} failed:\n{out.stderr[-3000:]}")
    return seconds


def iterate_breakdown(run_dir: Path) -> dict[str, float]:
    totals: dict[str, float] = {}
    for stages in sorted(run_dir.glob("iter_*/stages.json")):
        for stage, info in json.loads(stages.read_text()).items():
            if isinstance(info, dict) and "seconds" in info:
                totals[stage] = totals.get(stage, 0.0) + float(info["seconds"])
    return {k: round(v, 2) for k, v in totals.items()}


def online_breakdown(run_dir: Path) -> dict[str, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    keys = ("seconds_sampling", "seconds_scoring", "seconds_training")
    out = {k.removeprefix("seconds_"): round(sum(r[k] for r in rows), 2) for k in keys}
    out["first_round"] = round(sum(rows[0][k] for k in keys), 2)
    out["updates"] = rows[-1]["updates"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--smoke", action="store_true", help="2 rounds of 8 tokens (tests)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/online_vs_iterate.json"))
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.new_tokens = 2, 8
    with tempfile.TemporaryDirectory(prefix="online-vs-iterate-") as tmp:
        cwd = Path(tmp)
        for name, text in configs(args.rounds, args.prompts, args.n, args.new_tokens).items():
            (cwd / f"{name}.yaml").write_text(text)
        wall = {name: round(run(name, cwd), 2) for name in ("iterate", "online")}
        result = {
            "benchmark": "the same rounds (sample, reward, re-score mu, one TOPR update) through "
                         "`iterate` (one update per iteration) and `online`, subprocesses, one "
                         "CPU device, start-up and compiles included",
            "machine": {"cpu": platform.processor() or platform.machine(),
                        "cores": os.cpu_count(), "python": platform.python_version()},
            "work": {"rounds": args.rounds, "prompts_per_round": args.prompts, "n": args.n,
                     "max_new_tokens": args.new_tokens, "updates": args.rounds,
                     "model": "random llama, 2 layers, d 64, vocab 128"},
            "wall_seconds": wall,
            "online_speedup": round(wall["iterate"] / wall["online"], 2),
            "iterate_stage_seconds": iterate_breakdown(cwd / "it"),
            "online_phase_seconds": online_breakdown(cwd / "online_run"),
        }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
