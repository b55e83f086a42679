"""The online checkpoint's staleness queue: its own item in the record codec (what a checkpoint
holds now, online/queue.py) against the JSON number lists in the checkpoint's meta (the format
before), both measured in this run on the same queued records.

The records are GSM8K-sized and shaped as the online loop's (`Policy.rollout`): `--n` samples
per prompt sharing an 8-shot prompt of 600–900 tokens and its text, completions of 100–512
tokens with their text, the sampler's processed and raw log-probs and μ, and the metadata the
rollout adds (problem id, question, gold answer, finish reason, in-flight `weight_versions`).
The old format keeps only the fields training reads; the new one every field, bit for bit.
Each format saves `--runs` checkpoints (a 1 MiB train state beside the queue, synchronous
Orbax saves as the online loops make) after one warm-up save, and restores the queue from each
(meta + item read, records decoded); sizes are the step directories' bytes on disk.

    python benchmarks/queue_checkpoint.py            # 1,024 queued records, 5 runs

Writes benchmarks/results/queue_checkpoint.json.
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

from jaxrl_llm.data.records import Record
from jaxrl_llm.online.queue import QUEUE_ITEM, StalenessQueue
from jaxrl_llm.train.checkpoint import Checkpointer

RESULTS = Path(__file__).parent / "results"
ONLINE = "online"


def gsm8k_like(num: int, n: int, seed: int = 0) -> list[Record]:
    """`num` records, `n` per prompt, with the fields and sizes of an online GSM8K round's."""
    rng = np.random.default_rng(seed)
    out: list[Record] = []
    for g in range((num + n - 1) // n):
        p = int(rng.integers(600, 900))
        prompt_ids = rng.integers(0, 128_000, p)
        prompt_text = "".join(rng.choice(list("abcdefghij klmnop\n0123456789"), 4 * p))
        question = prompt_text[-300:]
        for _ in range(min(n, num - len(out))):
            c = int(rng.integers(100, 513))
            lp = np.minimum(-rng.exponential(0.5, c), 0).astype(np.float32)
            switch = int(rng.integers(0, c))
            out.append(Record(
                prompt_ids=prompt_ids, completion_ids=rng.integers(0, 128_000, c),
                reward=float(rng.choice([-1.0, 1.0])) - 0.125, raw_reward=1.0, correct=True,
                group_id=g, task="gsm8k", behavior_logprobs=lp, raw_logprobs=lp * 1.25,
                mu_logprobs=lp * 0.75, answer="72", prompt_text=prompt_text,
                completion_text="".join(rng.choice(list("abcdef 0123456789=+"), 4 * c)),
                metadata={"problem_id": f"gsm8k-train-{g}", "question": question,
                          "gold": "72", "finish_reason": "stop",
                          "weight_versions": [[7, 0], [8, switch]]}))
    return out


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(queue: StalenessQueue, fmt: str, runs: int, root: Path) -> dict:
    """Save `runs` + 1 checkpoints holding `queue` in format `fmt` ("json" or "codec"), then
    restore the queue from each: medians of the last `runs`, and the bytes on disk."""
    # 1 MiB of random float32 (incompressible): a train state beside the queue
    state = {"w": np.random.default_rng(0).standard_normal((512, 512), np.float32)}
    position = {"round": 9, "prompt_position": 18, "updates": 16, "mu_source": "sampler"}
    directory = root / fmt
    saves, restores = [], []
    with Checkpointer(directory, save_every=1, keep=runs + 1, async_save=False) as ckpt:
        for step in range(1, runs + 2):
            t0 = time.perf_counter()
            if fmt == "json":
                ckpt.save(step, state, meta={ONLINE: {**position, "queue": queue.to_json()}})
            else:
                ckpt.save(step, state, meta={ONLINE: position},
                          blobs={QUEUE_ITEM: queue.to_bytes()})
            saves.append(time.perf_counter() - t0)
        for step in range(1, runs + 2):
            t0 = time.perf_counter()
            meta = ckpt.read_meta(step)[ONLINE]
            back = StalenessQueue.from_checkpoint(queue.staleness,
                                                  ckpt.read_blob(QUEUE_ITEM, step), meta,
                                                  where=str(step))
            restores.append(time.perf_counter() - t0)
    if fmt == "codec":  # every record as it was, metadata included
        assert back.to_bytes() == queue.to_bytes()
    step_dir = directory / "1"
    queue_file = (step_dir / "meta" / "metadata" if fmt == "json"
                  else step_dir / QUEUE_ITEM / "bytes")
    return {"checkpoint_bytes": dir_bytes(step_dir),
            "queue_file_bytes": queue_file.stat().st_size,
            "state_item_bytes": dir_bytes(step_dir / "state"),
            "save_median_s": statistics.median(saves[1:]), "save_times_s": saves,
            "restore_median_s": statistics.median(restores[1:]), "restore_times_s": restores}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=1024)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--batch-size", type=int, default=64, help="records per queued batch")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS / "queue_checkpoint.json"))
    args = ap.parse_args()
    records = gsm8k_like(args.records, args.n)
    b = args.batch_size
    queue = StalenessQueue(2, [records[i:i + b] for i in range(0, len(records), b)])
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as d:
        old = measure(queue, "json", args.runs, Path(d))
        new = measure(queue, "codec", args.runs, Path(d))
    result = {
        "benchmark": "queue_checkpoint",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "records": len(records), "batches": len(queue), "samples_per_prompt": args.n,
        "runs": args.runs,
        "tokens": {"prompt": int(sum(r.prompt_ids.size for r in records)),
                   "completion": int(sum(r.completion_ids.size for r in records))},
        "old_json_in_meta": old, "new_record_codec_item": new,
        "ratio_new_over_old": {
            "checkpoint_bytes": new["checkpoint_bytes"] / old["checkpoint_bytes"],
            "queue_bytes": new["queue_file_bytes"] / old["queue_file_bytes"],
            "save_time": new["save_median_s"] / old["save_median_s"],
            "restore_time": new["restore_median_s"] / old["restore_median_s"]},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=2))


if __name__ == "__main__":
    main()
