"""`jaxrl-llm iterate --config X`: generate → score → curate → train → export → evaluate, once
per iteration, with μ_i = π_{i−1} (`iterate.run_iterations`)."""

from __future__ import annotations

import argparse

from jaxrl_llm.commands.config import add_config_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, required=True)
    parser.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    from jaxrl_llm.config import load_config
    from jaxrl_llm.eval.evaluate import format_table
    from jaxrl_llm.flows.iterate import IterateConfig, run_iterations

    config = load_config(args.config, args.overrides, schema=IterateConfig)
    initial, results = run_iterations(config, progress=not args.no_progress)
    rows = ([("initial", initial)] if initial else []) + [
        (f"iter {r.index}", r.eval) for r in results if r.eval is not None
    ]
    if rows:
        print(format_table(rows))
    print(f"run directory: {config.run_dir}")
    return 0
