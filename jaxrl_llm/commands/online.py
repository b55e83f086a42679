"""`jaxrl-llm online --config X`: sample → reward → group transform → update in one program
(one process per host when multi-host: docs/online.md § Multi-host), the sampler and the
trainer sharing the policy's weights, with `online.staleness` updates between sampling a
batch and training on it (`online.loop.run_online`, docs/online.md); with
`online.sampler_devices` the sampler runs on its own devices, ahead of the trainer with
`online.pipeline: deterministic` (`online.pipeline.run_pipeline`) or free-running with
`online.pipeline: free` (`online.free.run_free`, docs/online.md § Pipeline). Re-running the same
command resumes from the run's last checkpoint."""

from __future__ import annotations

import argparse
import json

from jaxrl_llm.commands.config import add_config_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, required=True)
    parser.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    from jaxrl_llm.config import load_config
    from jaxrl_llm.online.config import OnlineConfig
    from jaxrl_llm.online.free import run_free
    from jaxrl_llm.online.loop import run_online
    from jaxrl_llm.online.pipeline import run_pipeline, wants_pipeline

    config = load_config(args.config, args.overrides, schema=OnlineConfig)
    run = (run_free if config.online.pipeline == "free" else
           run_pipeline if wants_pipeline(config) else run_online)
    result = run(config, progress=not args.no_progress)
    print(json.dumps({"rounds": result.rounds, "updates": result.updates,
                      "run_dir": str(config.run_dir),
                      **{k: v for k, v in result.last.items() if k in (
                          "reward_mean", "pass@1", "loss", "seconds_sampling",
                          "seconds_training")}}, indent=2))
    return 0
