"""`jaxrl-llm score`: write μ (sampling T) and π_ref (T = 1) per-token log-probs (docs/architecture.md § Why μ is re-scored).

Prints the sampler-vs-trainer mismatch report (also in the output manifest's
`extra.score_metrics`); `generate.max_mismatch` / `generate.drop_mismatched` flag or drop
sequences beyond a bound.

Runs on the training mesh (`mesh:` section: parameters and rows sharded like the train step).
Multi-host: start the same command on every host; `parallel.distributed.initialize` joins the
job (JAXRL_* variables, SLURM or the TPU pod), each process scores every P-th input shard and
process 0 writes the manifest.
"""

from __future__ import annotations

import argparse
import json

from jaxrl_llm.commands.config import add_config_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--records", help="input record directory (default: data.records)")
    parser.add_argument("--out", help="output directory (default: generate.score_output or <records>-scored)")
    parser.add_argument("--temperature", type=float, help="default: the manifest's sampling temperature")
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from jaxrl_llm.commands.config import load_experiment_config
    from jaxrl_llm.data.stages import scored_directory, stage_input
    from jaxrl_llm.parallel.mesh import make_mesh
    from jaxrl_llm.policy.opener import open_model
    from jaxrl_llm.train.preflight import (
        check_all_records,
        check_records_fit_model,
        check_routing,
    )
    from jaxrl_llm.train.score import score_records
    from jaxrl_llm.weights.loading import check_weights_found, decoder_config

    config = load_experiment_config(args.config, args.overrides)
    mesh = make_mesh(config.mesh)  # the configuration (mesh, model) before any record is read
    check_weights_found(config.model)
    vocab_size = decoder_config(config.model).vocab_size
    # data/stages.py: reads data.records, writes generate.score_output or <records>-scored.
    records = stage_input(config, "score", args.records)
    out = args.out or scored_directory(config, records)
    # Every record, before any is scored: an id past the model's vocabulary embeds as NaN,
    # a row past the model's context is scored at positions it was never trained on.
    check_records_fit_model(config, records)
    check_routing(config, records)  # model.routing_replay: the records must carry it
    check_all_records(records, vocab_size)
    model = open_model(None, config, mesh=mesh, with_tokenizer=False).model  # already sharded
    metrics = score_records(model, records, out, temperature=args.temperature,
                            batch_size=config.generate.score_batch_size,
                            chunk_size=config.loss.logprob_chunk_size,
                            model_name=config.model.path or config.model.source,
                            mesh=mesh, max_mismatch=config.generate.max_mismatch,
                            drop_mismatched=config.generate.drop_mismatched,
                            routing_replay=config.model.routing_replay == "sampler")
    print(json.dumps({"output": out, **metrics}, indent=2))
    _warn_about_sampling(out)
    return 0


def _warn_about_sampling(out: str) -> None:
    """Say on stderr when the sampler's log-probs are not the policy's (manifest flags)."""
    import sys

    from jaxrl_llm.data.shards import read_manifest

    extra = read_manifest(out).extra
    if extra.get("sampling_truncated"):
        print(f"note: {out} was sampled with top-k/top-p: its behaviour log-probs are of the "
              "truncated distribution, so train with loss.mu_source=trainer (these mu_logprobs)",
              file=sys.stderr)
    if not extra.get("score_temperature_matches_sampling", True):
        print(f"note: {out} was scored at T={extra.get('score_temperature')}, not its sampling "
              "temperature: mu_logprobs are not the distribution the tokens were drawn from",
              file=sys.stderr)
