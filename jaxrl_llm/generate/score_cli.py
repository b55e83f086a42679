"""`jaxrl-llm score`: write μ per-token log-probs with the trainer's numerics (SPEC §0).

Runs on the training mesh (`mesh:` section: parameters and rows sharded like the train step).
Multi-host: start the same command on every host; `parallel.distributed.initialize` joins the
job (JAXRL_* variables, SLURM or the TPU pod), each process scores every P-th input shard and
process 0 writes the manifest.
"""

from __future__ import annotations

import argparse
import json

from jaxrl_llm.config_cli import add_config_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--records", help="input record directory (default: data.records)")
    parser.add_argument("--out", help="output directory (default: generate.score_output or <records>-scored)")
    parser.add_argument("--temperature", type=float, help="default: the manifest's sampling temperature")
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from jaxrl_llm.config import ConfigError, load_config
    from jaxrl_llm.generate.loading import model_and_tokenizer
    from jaxrl_llm.generate.score import score_records
    from jaxrl_llm.parallel.mesh import make_mesh

    config = load_config(args.config, args.overrides)
    records = args.records or config.data.records
    if records is None:
        raise ConfigError("set --records or data.records")
    out = args.out or config.generate.score_output or records.rstrip("/") + "-scored"
    mesh = make_mesh(config.mesh)
    model, _ = model_and_tokenizer(config)
    metrics = score_records(model, records, out, temperature=args.temperature,
                            batch_size=config.generate.score_batch_size,
                            chunk_size=config.loss.logprob_chunk_size,
                            model_name=config.model.path or config.model.source,
                            mesh=mesh)
    print(json.dumps({"output": out, **metrics}, indent=2))
    return 0
