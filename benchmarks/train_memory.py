"""Peak memory and step time of `jaxrl-llm train` on the packaged SmolLM2-135M-Instruct, as a
user runs it: the command in a child process, from a temp directory, on synthetic scored
records of exactly the shape asked (prompt + completion = max_seq_len tokens), TOPR + AdamW.

Variants (the old defaults reached 16 GB at 4×768 and an OOM kill):
- before: `model.remat=none model.scan_layers=false` — the earlier defaults, the
  layers unrolled, every activation kept; `train.check_memory=false` (no check existed);
- after: the defaults now (pretrained sources: scanned layers, remat=full; the memory check).

Each variant's compiled peak comes first from `jaxrl-llm plan` (no weights, no run); a run
whose predicted peak exceeds `--max-rss-gib` is not started (a shared machine: it would push
the other jobs out of memory or be killed), and the row keeps the prediction. Measured: the
child's peak RSS (`os.wait4`), and the step time — the median of the `metrics.jsonl` rows
after the first (`train.log_every=1`, each row one step; the first includes the compile).

    python benchmarks/train_memory.py [--shapes 4x768 8x1024] [--steps 4] [--max-rss-gib 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
VARIANTS = {
    "before": ["model.remat=none", "model.scan_layers=false", "train.check_memory=false"],
    "after": [],
}
GIB = 1024**3


def write_records(directory: Path, batch: int, seq: int, steps: int, vocab: int) -> None:
    """batch × steps records of seq tokens (half prompt, half completion), scored."""
    import numpy as np

    from jaxrl_llm.data.records import Record
    from jaxrl_llm.data.shards import write_records as write

    rng = np.random.default_rng(0)
    prompt = seq // 2
    records = []
    for i in range(batch * steps):
        completion = seq - prompt
        lp = (-rng.random(completion) - 0.01).astype(np.float32)
        records.append(Record(prompt_ids=rng.integers(0, vocab, prompt),
                              completion_ids=rng.integers(0, vocab, completion),
                              reward=1.0 if i % 3 else -1.0, correct=bool(i % 3), group_id=i,
                              behavior_logprobs=lp, mu_logprobs=lp))
    write(directory, records, vocab_size=vocab, scored_by="benchmark")


def config_text(batch: int, seq: int, steps: int) -> str:
    return (f"name: bench\nrun_dir: run\nmodel: {{source: smollm2}}\nloss: {{name: topr}}\n"
            f"optim: {{learning_rate: 1.0e-6}}\nmesh: {{data: 1}}\nplan: {{num_devices: 1}}\n"
            f"train: {{steps: {steps}, batch_size: {batch}, max_seq_len: {seq}, log_every: 1, "
            f"checkpoint_every: {steps}}}\n")


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "jaxrl_llm.cli", *args]


def predicted_peak(cwd: Path, overrides: list[str]) -> dict:
    done = subprocess.run(cli("plan", "--config", "c.yaml", "--json", "plan.json", *overrides),
                          cwd=cwd, capture_output=True, text=True, timeout=900)
    if done.returncode not in (0, 1):
        raise RuntimeError(done.stderr[-2000:])
    plan = json.loads((cwd / "plan.json").read_text())
    return {"peak_gib": plan["peak_bytes"] / GIB, "temp_gib": plan["temp_bytes"] / GIB,
            "argument_gib": plan["argument_bytes"] / GIB}


def run_train(cwd: Path, overrides: list[str]) -> dict:
    start = time.perf_counter()
    with open(cwd / "train.log", "w") as log:
        child = subprocess.Popen(cli("train", "--config", "c.yaml", "--no-progress", *overrides),
                                 cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    text = (cwd / "train.log").read_text()
    code = os.waitstatus_to_exitcode(status)
    row = {"exit_code": code, "peak_rss_gib": usage.ru_maxrss * 1024 / GIB, "wall_s": wall,
           "load_average_after": os.getloadavg(),
           "memory_line": next((ln for ln in text.splitlines() if ln.startswith("memory:")), None)}
    if code != 0:
        row["error"] = text[-1500:]
        return row
    rows = [json.loads(line) for line in (cwd / "run" / "metrics.jsonl").read_text().splitlines()]
    times = [1 / r["throughput/steps_per_s"] for r in rows if r.get("throughput/steps_per_s")]
    row["step_times_s"] = times
    row["step_s_median"] = statistics.median(times[1:]) if len(times) > 1 else None
    row["tokens_per_s_median"] = statistics.median(
        [r["throughput/tokens_per_s"] for r in rows[1:]]) if len(rows) > 1 else None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["4x768", "8x1024"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--max-rss-gib", type=float, default=10.0,
                        help="do not run a variant whose predicted peak exceeds this")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "train_memory.json"))
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from benchmarks.machine import cpu_name

    results = {"benchmark": __doc__.splitlines()[0], "cpu": cpu_name(), "cores": os.cpu_count(),
               "steps": args.steps, "max_rss_gib": args.max_rss_gib, "rows": []}
    for shape in args.shapes:
        batch, seq = map(int, shape.split("x"))
        with tempfile.TemporaryDirectory(prefix="train-memory-") as tmp:
            cwd = Path(tmp)
            (cwd / "c.yaml").write_text(config_text(batch, seq, args.steps))
            write_records(cwd / "recs", batch, seq, args.steps, vocab=49152)
            (cwd / "c.yaml").write_text(config_text(batch, seq, args.steps)
                                        + "data: {records: recs}\n")
            for variant in args.variants:
                overrides = VARIANTS[variant]
                row = {"shape": shape, "variant": variant, "overrides": overrides,
                       "plan": predicted_peak(cwd, overrides)}
                if row["plan"]["peak_gib"] > args.max_rss_gib:
                    row["skipped"] = (f"plan predicts {row['plan']['peak_gib']:.2f} GiB > "
                                      f"--max-rss-gib {args.max_rss_gib}")
                else:
                    row.update(run_train(cwd, overrides))
                    subprocess.run(["rm", "-rf", str(cwd / "run")], check=True)
                results["rows"].append(row)
                print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
