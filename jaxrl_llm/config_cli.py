"""`jaxrl-llm config`: show the configuration a run would use, after validation."""

from __future__ import annotations

import argparse

from jaxrl_llm.config import dump_config, load_config


def add_config_arguments(parser: argparse.ArgumentParser, *, required: bool = False) -> None:
    """The `--config FILE` flag and trailing `key.sub=value` overrides every command shares."""
    parser.add_argument("--config", required=required, help="experiment YAML (configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. optim.learning_rate=3e-6")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    print(dump_config(config), end="")
    return 0
