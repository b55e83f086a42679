"""`jaxrl-llm data show|stats|export-jsonl DIR`: inspect a record directory."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="data_command", required=True, metavar="SUBCOMMAND")
    show = sub.add_parser("show", help="print records (text, reward, flags; an episode's turns)")
    show.add_argument("records", help="record directory")
    show.add_argument("--start", type=int, default=0)
    show.add_argument("--num", type=int, default=5)
    stats = sub.add_parser("stats", help="manifest and dataset statistics as JSON")
    stats.add_argument("records")
    export = sub.add_parser("export-jsonl", help="every record as one JSON line")
    export.add_argument("records")
    export.add_argument("--out", help="output file (default: stdout)")


def run(args: argparse.Namespace) -> int:
    from jaxrl_llm.data.records import RecordError

    try:
        return _run(args)
    except (RecordError, FileNotFoundError) as err:
        print(f"jaxrl-llm data {args.data_command}: {err}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from jaxrl_llm.core.atomic import atomic_open
    from jaxrl_llm.data.shards import RecordSource
    from jaxrl_llm.data.show import render_record
    from jaxrl_llm.data.stats import dataset_stats

    if args.data_command == "stats":
        print(json.dumps(dataset_stats(args.records), indent=2))
        return 0
    source = RecordSource(args.records)
    if args.data_command == "show":
        for i in range(args.start, min(len(source), args.start + args.num)):
            print(render_record(source[i], source.where(i)))
        return 0
    with atomic_open(args.out) if args.out else contextlib.nullcontext(sys.stdout) as out:
        for r in source:
            out.write(json.dumps(r.to_json()) + "\n")
    return 0
