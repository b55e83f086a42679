"""Loader throughput: the grain pipeline (decode + validate + align + pad + batch, threads,
prefetch) vs a plain loop over the same ArrayRecord shards that only decodes records.

The ratio says what the pipeline's extra work costs per record over the unavoidable read and
msgpack decode. Records are synthetic (GSM8K-like lengths: prompt 600–900 tokens with the
8-shot prefix, completion 100–512, three per-token log-prob arrays). One warm-up pass each,
then the median of `--runs` timed passes over all records.

    python benchmarks/data_loader.py               # 4096 records, batch 32, 5 runs

Writes benchmarks/results/data_loader.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np

from jaxrl_llm.data.loader import make_loader
from jaxrl_llm.data.records import Record
from jaxrl_llm.data.shards import RecordSource, write_records

RESULTS = Path(__file__).parent / "results"


def synthetic(num: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for i in range(num):
        p, c = int(rng.integers(600, 900)), int(rng.integers(100, 513))
        lp = -rng.random(c).astype(np.float32)
        yield Record(rng.integers(0, 128_000, p), rng.integers(0, 128_000, c), reward=1.0 if i % 3 else -1.0,
                     correct=bool(i % 3), group_id=i // 16, behavior_logprobs=lp, raw_logprobs=lp, mu_logprobs=lp)


def median_time(fn, runs: int) -> tuple[float, list[float]]:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        write_records(d, synthetic(args.records), records_per_shard=1024, vocab_size=128_256)
        source = RecordSource(d)

        def baseline() -> None:
            for i in range(len(source)):
                source[i]

        def pipeline() -> None:
            loader = make_loader(d, batch_size=args.batch_size, max_len=1424, buckets=(1024, 1424),
                                 num_epochs=1, read_threads=2, prefetch=2)
            for _ in loader:
                pass

        base_t, base_all = median_time(baseline, args.runs)
        pipe_t, pipe_all = median_time(pipeline, args.runs)
    result = {
        "benchmark": "data_loader",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "records": args.records, "batch_size": args.batch_size, "runs": args.runs,
        "baseline_decode_only": {"median_s": base_t, "records_per_s": args.records / base_t, "times": base_all},
        "grain_pipeline": {"median_s": pipe_t, "records_per_s": args.records / pipe_t, "times": pipe_all},
        "ratio_pipeline_over_baseline_time": pipe_t / base_t,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "data_loader.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=2))


if __name__ == "__main__":
    main()
