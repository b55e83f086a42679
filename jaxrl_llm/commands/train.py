"""`jaxrl-llm train --config C`: train on scored (or curated) records with the config's loss;
resumes from the run's latest checkpoint (`train.trainer.Trainer`)."""

from __future__ import annotations

import argparse
import sys

from jaxrl_llm.commands.config import add_config_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, required=True)
    parser.add_argument("--records", default=None, help="records directory (default: data.curated, else the scored "
                        "records <data.records>-scored when they exist, else data.records)")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bar")


def run(args: argparse.Namespace) -> int:
    from jaxrl_llm.commands.config import load_experiment_config
    from jaxrl_llm.core.signals import exit_code, signal_name
    from jaxrl_llm.train.nonfinite import NonFiniteError
    from jaxrl_llm.train.trainer import Trainer

    config = load_experiment_config(args.config, args.overrides)
    hook = None
    if config.train.eval_every:  # held-out pass@1 ± SE every eval_every steps
        from jaxrl_llm.eval.during_training import make_eval_hook
        from jaxrl_llm.policy.opener import open_tokenizer

        # the evaluation's own bar under the trainer's (none with --no-progress)
        hook = make_eval_hook(config, open_tokenizer(config), progress=not args.no_progress)
    # refuse_no_signal: records that give the loss nothing to learn stop the command
    # (exit 2) unless train.allow_no_signal (data/signal.py).
    trainer = Trainer(config, records=args.records, progress=not args.no_progress,
                      eval_hook=hook, eval_at_start=True, refuse_no_signal=True)
    try:
        result = trainer.run()
    except NonFiniteError as err:  # a diagnosis, not a crash: no traceback
        print(f"jaxrl-llm train: {err}", file=sys.stderr)
        return 1
    finally:
        trainer.close()
    if result.stopped:
        print(f"stopped by {signal_name(result.stop_signal)} at step {result.step}; checkpoint "
              f"in {result.checkpoint_dir}; run the same command to resume")
        return exit_code(result.stop_signal)
    print(f"trained {result.step} steps; checkpoints {result.checkpoint_dir}; "
          f"metrics {result.metrics_path}")
    return 0
