"""`jaxrl-llm config`: show the configuration a run would use, after validation.

A config file is read with the schema of the command it is written for: a plain experiment
(`train`, `score`, `curate`, ...), `iterate` (an `iterate:` section) or `quickstart` (`sft:`,
`tokenizer_vocab_size`). The schema is picked from the file's top-level keys (and the
overrides'), or given with `--schema`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from jaxrl_llm.config import ConfigError, load_config

# --schema name -> "module:class"; imported on use so `--help` stays fast.
SCHEMAS: dict[str, str] = {
    "experiment": "jaxrl_llm.config:ExperimentConfig",
    "iterate": "jaxrl_llm.flows.iterate:IterateConfig",
    "online": "jaxrl_llm.online.config:OnlineConfig",
    "quickstart": "jaxrl_llm.flows.quickstart:QuickstartConfig",
}


def add_config_arguments(parser: argparse.ArgumentParser, *, required: bool = False) -> None:
    """The `--config FILE` flag and trailing `key.sub=value` overrides every command shares."""
    parser.add_argument("--config", required=required, help="experiment YAML (configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. optim.learning_rate=3e-6")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--schema", choices=("auto", *SCHEMAS), default="auto",
                        help="which command's config the file is (default: from its keys)")
    parser.add_argument("--reference", action="store_true",
                        help="print every key with its type, default and description "
                             "(docs/configuration.md) instead")


def schema_class(name: str) -> type[Any]:
    import importlib

    module, cls = SCHEMAS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def top_level_keys(path: str | None, overrides: Sequence[str]) -> set[str]:
    """The top-level keys a file and its `a.b=c` overrides set (unreadable files: none; the
    loader reports them)."""
    keys = {o.split("=", 1)[0].split(".", 1)[0] for o in overrides if "=" in o}
    if path is not None:
        try:
            tree = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError):
            tree = None
        if isinstance(tree, dict):
            keys |= {str(k) for k in tree}
    return keys


def pick_schema(keys: set[str]) -> str:
    """The narrowest schema whose fields include every key; else the one that leaves the
    fewest unknown (its validation then names only those)."""
    # SCHEMAS is ordered narrowest first, and min() keeps the first of equals.
    return min(SCHEMAS, key=lambda name: len(keys - set(schema_class(name).model_fields)))


def load_experiment_config(path: str | None, overrides: Sequence[str]) -> Any:
    """The plain experiment a stage command (`generate`, `evaluate`, `train`, ...) runs, from any
    config file: an `iterate` or `quickstart` file is validated whole with its own schema, then
    its extra sections (`iterate:`, `sft:`, ...) are left out. So `jaxrl-llm evaluate --config
    configs/quickstart.yaml --model runs/quickstart/iter_3/export` reads the quickstart's task."""
    name = pick_schema(top_level_keys(path, overrides))
    if name == "experiment":
        return load_config(path, overrides)
    try:
        config = load_config(path, overrides, schema=schema_class(name))
    except ConfigError as err:
        raise ConfigError(f"{err} (read as a {name!r} config from its keys)") from err
    from jaxrl_llm.flows.iterate import experiment_part

    return experiment_part(config)


def run(args: argparse.Namespace) -> int:
    if args.reference:
        from jaxrl_llm.config.reference import render

        print(render({name: schema_class(name) for name in SCHEMAS}), end="")
        return 0
    name = args.schema
    if name == "auto":
        name = pick_schema(top_level_keys(args.config, args.overrides))
    try:
        config = load_config(args.config, args.overrides, schema=schema_class(name))
    except ConfigError as err:
        raise ConfigError(f"{err} (read as a {name!r} config; --schema "
                          f"{'|'.join(SCHEMAS)} picks another)") from err
    from jaxrl_llm.config.reference import with_architecture

    print(with_architecture(config), end="")
    return 0
