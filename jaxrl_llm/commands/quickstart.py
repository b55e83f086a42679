"""`jaxrl-llm quickstart [--model tiny|smollm2]`: the whole flow on a CPU, offline, in minutes
(`quickstart.run_quickstart`)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny",
                        help="tiny: a small Llama trained from scratch (default); smollm2: the "
                             "packaged SmolLM2-135M-Instruct GGUF")
    parser.add_argument("--sampler", choices=("jax", "vllm"), default=None,
                        help="who samples the RL data: the JAX sampler (default) or vLLM in its "
                             "own process (generate.backend=vllm; `jaxrl-llm vllm install` first)")
    parser.add_argument("--config", default=None, help="quickstart YAML (default: built in)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")


def run(args: argparse.Namespace) -> int:
    from jaxrl_llm.flows.quickstart import SMOLLM2_OVERRIDES, load_quickstart_config, run_quickstart

    overrides = (SMOLLM2_OVERRIDES if args.model == "smollm2" else []) + \
        ([f"generate.backend={args.sampler}"] if args.sampler else []) + list(args.overrides)
    config = load_quickstart_config(args.config, overrides)
    run_quickstart(config, progress=not args.no_progress)
    return 0
