"""`jaxrl-llm data show|stats|export-jsonl DIR`: inspect a record directory."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any

import numpy as np


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="data_command", required=True, metavar="SUBCOMMAND")
    show = sub.add_parser("show", help="print records (text, reward, flags)")
    show.add_argument("records", help="record directory")
    show.add_argument("--start", type=int, default=0)
    show.add_argument("--num", type=int, default=5)
    stats = sub.add_parser("stats", help="manifest and dataset statistics as JSON")
    stats.add_argument("records")
    export = sub.add_parser("export-jsonl", help="every record as one JSON line")
    export.add_argument("records")
    export.add_argument("--out", help="output file (default: stdout)")


def dataset_stats(directory: str) -> dict[str, Any]:
    """Composition, lengths, rewards, per-group correct counts (TOPR arXiv:2503.14286 Fig. 3/4 quantities)."""
    from jaxrl_llm.data.shards import RecordSource

    source = RecordSource(directory)
    rewards, correct, invalid, groups, has_mu = [], [], [], [], []
    for r in source:
        rewards.append(r.reward)
        correct.append(r.correct)
        invalid.append(r.invalid)
        groups.append(r.group_id)
        has_mu.append(r.mu_logprobs is not None)
    lengths = source.lengths()
    n = len(rewards)
    _, group_correct = np.unique(np.asarray(groups), return_inverse=True) if n else (None, np.zeros(0, int))
    per_group = np.bincount(group_correct, weights=np.asarray(correct, float)).astype(int) if n else np.zeros(0, int)
    hist = {int(k): int(v) for k, v in zip(*np.unique(per_group, return_counts=True))}

    def summary(x: np.ndarray) -> dict[str, float]:
        return {"mean": float(x.mean()), "min": float(x.min()), "max": float(x.max())} if x.size else {}

    return {
        "manifest": json.loads(source.manifest.to_json()),
        "num_records": n,
        "num_groups": int(len(per_group)),
        "correct_fraction": float(np.mean(correct)) if n else 0.0,
        "invalid_fraction": float(np.mean(invalid)) if n else 0.0,
        "scored_fraction": float(np.mean(has_mu)) if n else 0.0,
        "reward": summary(np.asarray(rewards, float)),
        "prompt_length": summary(lengths[:, 0].astype(float)),
        "completion_length": summary(lengths[:, 1].astype(float)),
        "correct_per_group_histogram": hist,
    }


def run(args: argparse.Namespace) -> int:
    from jaxrl_llm.data.records import RecordError

    try:
        return _run(args)
    except (RecordError, FileNotFoundError) as err:
        print(f"jaxrl-llm data {args.data_command}: {err}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from jaxrl_llm.atomic import atomic_open
    from jaxrl_llm.data.shards import RecordSource

    if args.data_command == "stats":
        print(json.dumps(dataset_stats(args.records), indent=2))
        return 0
    source = RecordSource(args.records)
    if args.data_command == "show":
        for i in range(args.start, min(len(source), args.start + args.num)):
            r = source[i]
            flags = "correct" if r.correct else ("invalid" if r.invalid else "incorrect")
            print(f"=== {source.where(i)}  group {r.group_id}  reward {r.reward:+g}  {flags}  answer {r.answer!r}")
            print(f"--- prompt ({r.prompt_ids.size} tokens)\n{r.prompt_text}")
            print(f"--- completion ({r.completion_ids.size} tokens)\n{r.completion_text}")
        return 0
    with atomic_open(args.out) if args.out else contextlib.nullcontext(sys.stdout) as out:
        for r in source:
            out.write(json.dumps(r.to_json()) + "\n")
    return 0
