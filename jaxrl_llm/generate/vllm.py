"""vLLM backend for a GPU host: `python -m jaxrl_llm.generate.vllm --model HF_DIR --out DIR …`.

Uses vLLM's offline `LLM.generate` with `SamplingParams(n, temperature, top_p, top_k,
max_tokens, logprobs=1)` on token-id prompts built by the same task code as the JAX backend,
and writes records with the same shard writer. `vllm` is an optional extra
(`pip install jaxrl_llm[vllm]`); nothing here imports it until a run starts. The command's
flags and printing live in `commands/vllm_host.py`.

Which log-probs vLLM reports is an engine option (`logprobs_mode`): with
`processed_logprobs` (default here) they are after temperature and top-k/top-p — the
distribution the tokens were drawn from — and go to `behavior_logprobs`; with
`raw_logprobs` they are log-softmax of the unprocessed logits and go to `raw_logprobs`.
The manifest records the mode and the truncation (`extra.sampling_truncated`,
`extra.raw_logprobs_temperature`: vLLM's raw log-probs are before temperature, T = 1). Set-ups (configs/):
TOPR T=1, top-p 1, top-k 500, 512 tokens, n=16 GSM8K / 32 MATH; FPA T=0.7, n=8.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from jaxrl_llm.generate.completions import Completion


def completions_from_request_outputs(outputs: Sequence[Any], *, logprobs_mode: str = "processed_logprobs") -> list[Completion]:
    """vLLM `RequestOutput`s (request i = prompt i, in order) -> `Completion`s.

    Each sampled token's log-prob is read from the per-position `{token_id: Logprob}` map
    (`dict` or vLLM's `FlatLogprobs`, which index the same way). A position whose sampled
    token is missing from the map is an error naming the request and position.
    """
    if logprobs_mode not in ("processed_logprobs", "raw_logprobs"):
        raise ValueError(f"logprobs_mode must be processed_logprobs or raw_logprobs, got {logprobs_mode!r}")
    completions = []
    for i, request in enumerate(outputs):
        for sample in request.outputs:
            ids = np.asarray(list(sample.token_ids), np.int32)
            if sample.logprobs is None:
                raise ValueError(f"vLLM request {i}: no logprobs (SamplingParams(logprobs=1) is required)")
            if len(sample.logprobs) != ids.size:
                raise ValueError(f"vLLM request {i}: {len(sample.logprobs)} logprob entries for {ids.size} tokens")
            lp = np.empty(ids.size, np.float32)
            for t, token in enumerate(ids.tolist()):
                entry = sample.logprobs[t]
                if token not in entry:
                    raise ValueError(f"vLLM request {i} sample {sample.index} position {t}: sampled token {token} has no logprob")
                lp[t] = entry[token].logprob
            processed = logprobs_mode == "processed_logprobs"
            completions.append(Completion(
                prompt_index=i, token_ids=ids,
                logprobs=lp if processed else None, raw_logprobs=None if processed else lp,
                finish_reason=str(sample.finish_reason or ""),
            ))
    return completions


def generate_vllm_records(config: Any, model: str, out: str, *, chunk_prompts: int = 1024,
                          overwrite: bool = False) -> Any:
    """Sample `generate.n` completions per prompt of the config's task with vLLM's offline
    engine on `model` (HF directory or hub id) and write reward-scored records to `out`;
    returns the written manifest."""
    from vllm import LLM, SamplingParams  # the optional extra; only on the GPU host

    from jaxrl_llm.data.shards import SamplingInfo, ShardWriter
    from jaxrl_llm.errors import ConfigError
    from jaxrl_llm.generate.completions import (
        build_records,
        encode_prompts,
        format_prompts,
        sampler_logprob_info,
    )
    from jaxrl_llm.generate.loading import task_from_config

    g, d = config.generate, config.data
    task = task_from_config(config)
    problems = task.load(split=g.split, num=d.num_prompts, seed=config.seed)
    engine: dict[str, Any] = dict(model=model, tensor_parallel_size=g.tensor_parallel_size,
                                  gpu_memory_utilization=g.gpu_memory_utilization, seed=config.seed)
    if g.vllm_logprobs_mode != "raw_logprobs":  # vLLM's default; the option exists from 0.10.2
        engine["logprobs_mode"] = g.vllm_logprobs_mode
    try:
        llm = LLM(**engine)
    except TypeError as err:
        raise ConfigError(f"generate.vllm_logprobs_mode={g.vllm_logprobs_mode!r} needs vLLM >= 0.10.2 "
                          f"(or set it to raw_logprobs): {err}") from err
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(n=g.n, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k or -1,
                            max_tokens=g.max_new_tokens, logprobs=1, seed=config.seed)
    chat = config.data.chat_template
    prompts = format_prompts(tokenizer, [task.prompt(p) for p in problems], chat_template=chat)
    prompt_ids = encode_prompts(tokenizer, prompts, chat_template=chat)
    with ShardWriter(out, records_per_shard=g.records_per_shard, vocab_size=None, overwrite=overwrite,
                     tokenizer=model, model=model, task=task.name, reward_fn=task.reward_fn,
                     sampling=SamplingInfo(backend="vllm", temperature=g.temperature, top_p=g.top_p,
                                           top_k=g.top_k, max_new_tokens=g.max_new_tokens, n=g.n,
                                           seed=config.seed),
                     extra={"vllm_logprobs_mode": g.vllm_logprobs_mode,
                            **sampler_logprob_info(backend="vllm", temperature=g.temperature,
                                                   top_k=g.top_k, top_p=g.top_p,
                                                   logprobs_mode=g.vllm_logprobs_mode)}) as writer:
        for start in tqdm(range(0, len(problems), chunk_prompts), desc="vllm generate", unit="chunk"):
            sub = slice(start, start + chunk_prompts)
            outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids[sub]], params)
            completions = completions_from_request_outputs(outputs, logprobs_mode=g.vllm_logprobs_mode)
            writer.write_all(build_records(task, problems[sub], prompt_ids[sub], completions, tokenizer,
                                           group_offset=start, prompts=prompts[sub]))
        writer.manifest.extra["task_metrics"] = task.metrics()
    return writer.manifest


if __name__ == "__main__":  # the GPU host's entry point (launch/vllm_host.sh)
    import runpy

    # The command (flags, config loading, printing) is the command layer's; named by string
    # like cli.py's command table, so this library module does not import it.
    runpy.run_module("jaxrl_llm.commands.vllm_host", run_name="__main__", alter_sys=True)
