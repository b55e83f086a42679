"""`jaxrl-llm export --checkpoint DIR --out HF_DIR`: a training checkpoint as an HF directory,
or with `--format gguf` one GGUF file, written atomically (`export.export_checkpoint`)."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True,
                        help="run directory, its checkpoints/ directory, or checkpoints/<step>")
    parser.add_argument("--out", required=True,
                        help="HF directory to write (--format gguf: a .gguf file)")
    parser.add_argument("--format", choices=("hf", "gguf"), default="hf",
                        help="hf: safetensors directory; gguf: one llama.cpp/Ollama file")
    parser.add_argument("--gguf-type", choices=("f32", "f16", "q8_0"), default="f16",
                        help="--format gguf: storage of every matrix (norms stay f32)")
    parser.add_argument("--step", type=int, default=None, help="default: the latest complete")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer directory to include (default: the run's tokenizer)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    parser.add_argument("--overwrite", action="store_true", help="replace an existing HF_DIR")


def run(args: argparse.Namespace) -> int:
    from jaxrl_llm.export import export_checkpoint
    from jaxrl_llm.models.gguf_export import GGUFExportError

    try:
        out = export_checkpoint(args.checkpoint, args.out, step=args.step,
                                tokenizer=args.tokenizer, dtype=args.dtype,
                                overwrite=args.overwrite, format=args.format,
                                gguf_type=args.gguf_type)
    except GGUFExportError as err:  # an architecture/type/tokenizer GGUF cannot hold
        print(f"jaxrl-llm export: {err}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} -> {out}")
    return 0
