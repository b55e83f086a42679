"""`jaxrl-llm vllm generate --model HF_DIR --config C [--out DIR]`: generate records with vLLM
on a GPU host (launch/vllm_host.sh; `jaxrl-llm generate` with `generate.backend: vllm` runs
the same library call, `generate.vllm.generate_vllm_records`). A sub-action of
`commands/vllm.py`, which imports it."""

from __future__ import annotations

import argparse

from jaxrl_llm.commands.config import add_config_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="Hugging Face model directory (or hub id)")
    parser.add_argument("--out", help="record directory (default: generate.output, else "
                        "data.records)")
    parser.add_argument("--chunk-prompts", type=int, default=None,
                        help="prompts per resumable chunk (default: generate.chunk_prompts, 256)")
    parser.add_argument("--overwrite", action="store_true")
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from jaxrl_llm.commands.config import load_experiment_config
    from jaxrl_llm.data.stages import stage_output
    from jaxrl_llm.generate.vllm import generate_vllm_records

    config = load_experiment_config(args.config, args.overrides)
    out = stage_output(config, "generate", args.out)  # --out, generate.output, data.records
    manifest = generate_vllm_records(config, args.model, out, chunk_prompts=args.chunk_prompts,
                                     overwrite=args.overwrite)
    print(f"wrote {manifest.num_records} records to {out}")
    return 0
