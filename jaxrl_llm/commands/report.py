"""`jaxrl-llm report RUN_DIR`: PNG plots and a Markdown summary of a run (`eval.report`)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="run directory (holds metrics.jsonl / eval.json files)")
    parser.add_argument("--out", default=None, help="output directory (default RUN_DIR/report)")


def run(args: argparse.Namespace) -> int:
    from jaxrl_llm.eval.report import write_report

    report = write_report(args.run_dir, args.out)
    print(f"report: {report}")
    for png in sorted(report.parent.glob("*.png")):
        print(f"  {png}")
    return 0

