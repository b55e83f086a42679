"""`jaxrl-llm generate`: sample completions for a task's prompts and write scored records.

`generate.backend: jax` runs the project's KV-cache sampler here; `vllm` runs vLLM's
offline engine (`jaxrl-llm vllm install --device gpu|cpu`; README § vLLM), resumable chunk by
chunk. Ctrl-C stops after the current decode segment (jax) or chunk (vllm), exit 130.
`--gold` writes the task's gold solutions as SFT records instead (warm start as in FPA arXiv:2509.19893).
"""

from __future__ import annotations

import argparse

from jaxrl_llm.commands.config import add_config_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", help="record directory (default: generate.output, else "
                        "data.records)")
    parser.add_argument("--model", help="vllm backend: HF model directory (default: model.path)")
    parser.add_argument("--gold", action="store_true", help="write gold solutions as SFT records")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing record directory")
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from jaxrl_llm.commands.config import load_experiment_config
    from jaxrl_llm.config import ConfigError
    from jaxrl_llm.data.stages import stage_output
    from jaxrl_llm.policy.opener import open_model, open_tokenizer
    from jaxrl_llm.tasks import task_from_config

    config = load_experiment_config(args.config, args.overrides)
    g, d = config.generate, config.data
    out = stage_output(config, "generate", args.out)  # --out, generate.output, data.records
    task = task_from_config(config)
    if args.gold:
        from jaxrl_llm.data.shards import write_records
        from jaxrl_llm.generate.completions import gold_records

        tokenizer = open_tokenizer(config)
        problems = task.load(split=g.split, num=d.num_prompts, seed=config.seed)
        manifest = write_records(out, gold_records(task, problems, tokenizer, eos_token_id=tokenizer.eos_token_id,
                                                       chat_template=d.chat_template),
                                 overwrite=args.overwrite, task=task.name, reward_fn=task.reward_fn,
                                 tokenizer=getattr(tokenizer, "name_or_path", ""), extra={"source": "gold"})
        print(f"wrote {manifest.num_records} gold records to {out}")
        return 0
    if g.backend == "vllm":
        from jaxrl_llm.generate.vllm import generate_vllm_records

        model = args.model or config.model.path
        if model is None:
            raise ConfigError("generate.backend=vllm needs --model or model.path (an HF directory)")
        manifest = generate_vllm_records(config, model, out, overwrite=args.overwrite)
        print(f"wrote {manifest.num_records} records to {out}")
        return 0
    from jaxrl_llm.envs.sampled import runner_for
    from jaxrl_llm.generate.jax_backend import generate_records
    from jaxrl_llm.weights.loading import check_fits_context, model_context

    # No prompt fits (it has at least one token): refused before the weights load; the
    # sampler checks the longest prompt + max_new_tokens once the prompts are tokenized.
    check_fits_context(model_context(config.model), g.max_new_tokens + 1,
                       what=f"generate.max_new_tokens={g.max_new_tokens} (+ a prompt)",
                       fix="lower generate.max_new_tokens",
                       random=config.model.source == "random")
    opened = open_model(None, config)
    model, tokenizer = opened.model, opened.tokenizer
    problems = task.load(split=g.split, num=d.num_prompts, seed=config.seed)
    manifest = generate_records(
        model, tokenizer, task, problems, out, n=g.n, temperature=g.temperature, top_k=g.top_k,
        top_p=g.top_p, max_new_tokens=g.max_new_tokens, batch_size=g.batch_size, seed=config.seed,
        stop_at_eos=g.stop_at_eos, records_per_shard=g.records_per_shard,
        model_name=config.model.path or config.model.source, overwrite=args.overwrite,
        chat_template=d.chat_template, sampler=config.generate.sampler_options(),
        runner=runner_for(config, task, tokenizer),
        return_routing=config.model.routing_replay == "sampler",
    )
    print(f"wrote {manifest.num_records} records ({manifest.num_correct} correct, "
          f"{manifest.num_invalid} invalid) to {out}")
    if manifest.extra.get("sampling_truncated"):
        import sys

        print(f"note: sampled with generate.top_k={g.top_k} / generate.top_p={g.top_p}: the "
              "behaviour log-probs are of the truncated distribution (manifest "
              "extra.sampling_truncated); run `jaxrl-llm score` and train with "
              "loss.mu_source=trainer", file=sys.stderr)
    return 0
