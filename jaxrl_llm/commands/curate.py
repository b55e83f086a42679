"""`jaxrl-llm curate`: select a training set from records (TOPR §4.3 and App. D, FPA App. B.1) and report its composition."""

from __future__ import annotations

import argparse
import json
import sys

from jaxrl_llm.commands.config import add_config_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--records", help="input record directory (default: the scored records "
                        "generate.score_output or <data.records>-scored when they exist, else "
                        "data.records)")
    parser.add_argument("--out", help="output directory (default: data.curated)")
    parser.add_argument("--overwrite", action="store_true")
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from jaxrl_llm.commands.config import load_experiment_config
    from jaxrl_llm.config import ConfigError
    from jaxrl_llm.core.paths import as_path
    from jaxrl_llm.data.curation import curate_directory
    from jaxrl_llm.data.records import RecordError
    from jaxrl_llm.data.shards import MANIFEST_NAME
    from jaxrl_llm.data.signal import check_signal
    from jaxrl_llm.data.stages import has_mu, needs_score, stage_input, stage_output

    config = load_experiment_config(args.config, args.overrides)
    d = config.data
    # data/stages.py: the scored records when `score` wrote them, else data.records.
    records = stage_input(config, "curate", args.records)
    out = stage_output(config, "curate", args.out)
    # Before any work: a re-run would otherwise curate, then fail on the old output.
    if not args.overwrite and (as_path(out) / MANIFEST_NAME).exists():
        raise ConfigError(f"{out} already holds curated records (an earlier `curate`): pass "
                          "--overwrite to replace them, or write elsewhere with --out or "
                          "data.curated")
    if needs_score(config) and not has_mu(records):
        print(f"note: curating {records}, which `jaxrl-llm score` has not scored; "
              f"loss.name={config.loss.name} will need its output scored before training",
              file=sys.stderr)
    try:
        comp = curate_directory(
            records, out, strategy=d.curation, num=d.num_records, seed=d.shuffle_seed,
            target=d.target_positive_fraction, power=d.hard_power, transform=d.group_transform,
            pkpo_k=d.pkpo_k, baseline=config.loss.baseline, overwrite=args.overwrite,
        )
    except RecordError:
        raise  # bad input data: its message names the file
    except ValueError as err:
        raise ConfigError(f"data.curation={d.curation!r}: {err}") from err
    print(json.dumps({"output": out, **comp.to_dict()}, indent=2))
    # No positives / all-equal groups: what that does to the loss, before anyone trains on it.
    warning = check_signal(config, out, refuse=False)
    if warning:
        print(warning, file=sys.stderr)
    return 0
