"""`jaxrl-llm export --checkpoint DIR --out HF_DIR`: a training checkpoint as an HF directory,
or with `--format gguf` one GGUF file, written atomically (`export.export_checkpoint`).
`--from SOURCE` converts a model instead: a GGUF file, `smollm2` (the packaged GGUF), a Hub id
or an HF directory (`export.export_model`)."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint",
                        help="run directory, its checkpoints/ directory, or checkpoints/<step>")
    source.add_argument("--from", dest="source", metavar="SOURCE",
                        help="convert a model: a .gguf file, smollm2 (the packaged "
                             "SmolLM2-135M-Instruct), a Hub id org/name or an HF directory")
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
    from jaxrl_llm.policy.export import export_checkpoint, export_model
    from jaxrl_llm.weights.gguf_export import GGUFExportError

    options = dict(tokenizer=args.tokenizer, dtype=args.dtype, overwrite=args.overwrite,
                   format=args.format, gguf_type=args.gguf_type)
    try:
        if args.source is not None:
            out = export_model(args.source, args.out, **options)
        else:
            out = export_checkpoint(args.checkpoint, args.out, step=args.step, **options)
    except GGUFExportError as err:  # an architecture/type/tokenizer GGUF cannot hold
        print(f"jaxrl-llm export: {err}", file=sys.stderr)
        return 2
    print(f"exported {args.source or args.checkpoint} -> {out}")
    return 0
