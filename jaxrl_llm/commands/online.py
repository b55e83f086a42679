"""`jaxrl-llm online --config X`: sample → reward → group transform → update in one program
(one process per host when multi-host: docs/online.md § Multi-host), the sampler and the
trainer sharing the policy's weights, with `online.staleness` updates between sampling a
batch and training on it (`online.loop.run_online`, docs/online.md); with
`online.sampler_devices` the sampler runs on its own devices, ahead of the trainer with
`online.pipeline: deterministic` (`online.pipeline.run_pipeline`) or free-running with
`online.pipeline: free` (`online.free.run_free`, docs/online.md § Pipeline); with
`online.exchange` it runs one side of a pipeline whose trainer and rollout workers are separate
processes sharing only that directory: `--role trainer`, `--role worker --worker K`
(`online.remote`). Re-running the same command resumes from the run's last checkpoint."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from jaxrl_llm.commands.config import add_config_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, required=True)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--role", choices=("trainer", "worker"), default=None,
                        help="with online.exchange: run the trainer, or a rollout worker")
    parser.add_argument("--worker", type=int, default=None, metavar="K",
                        help="--role worker: which worker (samples the rounds r with "
                        "r %% online.workers == K)")


def run(args: argparse.Namespace) -> int:
    from jaxrl_llm.config import load_config
    from jaxrl_llm.core.signals import exit_code, signal_name
    from jaxrl_llm.online.config import OnlineConfig
    from jaxrl_llm.online.free import run_free
    from jaxrl_llm.online.loop import run_online
    from jaxrl_llm.online.pipeline import run_pipeline, wants_pipeline

    config = load_config(args.config, args.overrides, schema=OnlineConfig)
    if args.role is not None or config.online.exchange:
        from jaxrl_llm.online.remote import check_roles

        check_roles(config, args.role, args.worker)
    if args.role == "worker":
        from jaxrl_llm.online.remote import run_worker

        print(json.dumps(run_worker(config, args.worker, progress=not args.no_progress),
                         indent=2))
        return 0
    hook, every = None, config.train.eval_every or 0
    if every:  # held-out pass@1 ± SE before, every eval_every updates, after (as `train`)
        from jaxrl_llm.eval.during_training import make_eval_hook
        from jaxrl_llm.policy.opener import open_tokenizer

        evaluate = make_eval_hook(config, open_tokenizer(config), progress=not args.no_progress)

        def hook(updates: int, policy: Any) -> Any:
            return evaluate(updates, policy.state)

    if args.role == "trainer":
        from jaxrl_llm.online.remote import run_trainer

        result = run_trainer(config, progress=not args.no_progress, eval_hook=hook,
                             eval_every=every, eval_at_start=bool(every))
    elif config.online.pipeline == "free":
        result = run_free(config, progress=not args.no_progress, eval_hook=hook,
                          eval_every=every, eval_at_start=bool(every))
    elif wants_pipeline(config):
        result = run_pipeline(config, progress=not args.no_progress, eval_hook=hook,
                              eval_every=every, eval_at_start=bool(every))
    else:
        result = run_online(config, progress=not args.no_progress, eval_hook=hook,
                            eval_every=every, eval_at_start=bool(every))
    if result.stopped:
        print(f"jaxrl-llm online: stopped by {signal_name(result.stop_signal)} after round "
              f"{result.rounds} ({result.updates} updates); checkpoint {result.checkpoint}; "
              "run the same command to resume", file=sys.stderr)
        return exit_code(result.stop_signal)
    print(json.dumps({"rounds": result.rounds, "updates": result.updates,
                      "run_dir": str(config.run_dir),
                      **{k: v for k, v in result.last.items() if k in (
                          "reward_mean", "pass@1", "loss", "seconds_sampling",
                          "seconds_training") or k.startswith("eval/")}}, indent=2))
    return 0
