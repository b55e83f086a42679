"""`jaxrl-llm curate`: select a training set from records (SPEC §7) and report its composition."""

from __future__ import annotations

import argparse
import json

from jaxrl_llm.config_cli import add_config_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--records", help="input record directory (default: data.records)")
    parser.add_argument("--out", help="output directory (default: data.curated)")
    parser.add_argument("--overwrite", action="store_true")
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from jaxrl_llm.config import ConfigError, load_config
    from jaxrl_llm.data.curation import curate_directory

    config = load_config(args.config, args.overrides)
    d = config.data
    records = args.records or d.records
    out = args.out or d.curated
    if records is None or out is None:
        raise ConfigError("set --records/--out or data.records/data.curated")
    try:
        comp = curate_directory(
            records, out, strategy=d.curation, num=d.num_records, seed=d.shuffle_seed,
            target=d.target_positive_fraction, power=d.hard_power, transform=d.group_transform,
            pkpo_k=d.pkpo_k, baseline=config.loss.baseline, overwrite=args.overwrite,
        )
    except ValueError as err:
        raise ConfigError(f"data.curation={d.curation!r}: {err}") from err
    print(json.dumps({"output": out, **comp.to_dict()}, indent=2))
    return 0
