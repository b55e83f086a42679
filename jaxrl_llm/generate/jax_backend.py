"""Generation with the project's own KV-cache sampler (`sampling/sampler.py`), on any JAX device.

Prompts are processed in chunks of `chunk_prompts`; each chunk is sampled (n per prompt),
scored by the task and appended to the record shards. The progress bar counts prompts and
moves after every prompt batch, its status after every decode segment (`jaxrl_llm/core/progress.py`).
Before sampling, the prompt batch is fitted to the memory left (`sampling/build.py`). Ctrl-C or
SIGTERM stops after the current decode segment (`jaxrl_llm/core/signals.py`): the directory stays
without a manifest, so readers refuse it and re-running the command writes it again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jaxrl_llm.core.errors import ConfigError
from jaxrl_llm.core.progress import progress_bar, set_status
from jaxrl_llm.core.signals import stop_point
from jaxrl_llm.data.routing import routing_info
from jaxrl_llm.data.shards import Manifest, SamplingInfo, ShardWriter
from jaxrl_llm.envs.episodes import EpisodeRunner
from jaxrl_llm.envs.sampled import RowTurns, begin_episodes, episode_records
from jaxrl_llm.generate.completions import (
    Completion,
    build_records,
    encode_prompts,
    format_prompts,
    sampler_logprob_info,
)
from jaxrl_llm.sampling.build import build_sampler
from jaxrl_llm.sampling.sampler import SamplingParams
from jaxrl_llm.tasks.base import Problem, Task

SEGMENT_S = 2.0  # decode segments of about this long: a Ctrl-C or a progress line waits no longer
STOP_GRACE_S = 5.0  # a Ctrl-C not taken at a segment by then (XLA compiling) exits at once


class SamplingProgress:
    """`on_batch` and `on_segment` for `Sampler.generate`: `bar` counts prompts after each
    prompt batch and shows the batch's decode step in between (`progress.set_status`); both
    first `stop.check(stage, then)`, so a signal stops the stage at the next decode segment
    and the batch it interrupted is never counted."""

    def __init__(self, bar: Any, stop: Any, stage: str, then: str, *, batches: int,
                 max_new_tokens: int) -> None:
        self.bar, self.stop, self.stage, self.then = bar, stop, stage, then
        self.batches, self.max_new_tokens = batches, max_new_tokens
        self.batch = 0  # the prompt batch being sampled (1-based, across calls)

    def on_batch(self, count: int) -> None:
        self.stop.check(self.stage, self.then)
        self.bar.update(count)

    def on_segment(self, _batch_in_call: int, step: int) -> None:
        self.stop.check(self.stage, self.then)
        self.batch += step == 0
        where = f"batch {self.batch}/{self.batches}"
        if step == 0:
            first = " (compiling the sampler)" if self.batch == 1 else ""
            set_status(self.bar, f"{where}: prefill{first}", now=self.batch == 1)
        else:
            set_status(self.bar, f"{where}: token {step}/{self.max_new_tokens}")


def progress_batches(sampler: Any, prompts_per_call: Sequence[int]) -> int:
    """How many batches `SamplingProgress` counts over these `generate` calls: each prompt
    batch of a static `Sampler`; a continuous sampler's call is one batch (its slots refill)."""
    if hasattr(sampler, "slots"):
        return len(prompts_per_call)
    return sum(-(-count // sampler.batch_size) for count in prompts_per_call)


def sample_completions(sampler: Any, prompt_ids: Sequence[Sequence[int]], params: Any,
                       key: jax.Array, progress: SamplingProgress | None = None,
                       first_id: int = 0, turns: Any = None,
                       return_routing: bool = False) -> list[Completion]:
    """Run the sampler; one `Completion` per (prompt, sample), with `progress`'s callbacks.
    `first_id`: the data-set index of prompt_ids[0] (its samples' noise is keyed by it).
    `turns`: multi-turn episodes (`envs.sampled.RowTurns`; the continuous sampler only).
    `return_routing`: each completion carries its tokens' experts (a mixture of experts)."""
    if turns is not None and not hasattr(sampler, "slots"):
        raise ConfigError("environments (env.name) need generate.batching: continuous")
    extra = {"turns": turns} if turns is not None else {}
    if return_routing:
        extra["return_routing"] = True
    out = sampler.generate(prompt_ids, params, key,
                           on_batch=progress and progress.on_batch,
                           on_segment=progress and progress.on_segment,
                           prompt_ids=range(first_id, first_id + len(prompt_ids)), **extra)
    completions = []
    for row in range(out.tokens.shape[0]):
        n = int(out.lengths[row])
        completions.append(Completion(
            prompt_index=int(out.prompt_index[row]),
            token_ids=np.asarray(out.tokens[row, :n], np.int32),
            logprobs=np.asarray(out.logprobs[row, :n], np.float32),
            raw_logprobs=np.asarray(out.raw_logprobs[row, :n], np.float32),
            finish_reason=str(out.finish_reason[row]),
            routing=None if out.routing is None else out.routing[row, :max(n - 1, 0)].copy(),
        ))
    return completions


def generate_records(
    model: Any,
    tokenizer: Any,
    task: Task,
    problems: Sequence[Problem],
    out_dir: str,
    *,
    n: int,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    max_new_tokens: int,
    batch_size: int = 8,
    seed: int = 0,
    stop_at_eos: bool = True,
    records_per_shard: int = 10_000,
    chunk_prompts: int | None = None,
    chat_template: bool | None = False,
    model_name: str = "",
    overwrite: bool = False,
    progress: bool = True,
    sampler: Mapping[str, Any] | None = None,
    runner: EpisodeRunner | None = None,
    return_routing: bool = False,
) -> Manifest:
    """Sample `n` completions per problem and write scored records to `out_dir`. `sampler`:
    the sampler's batching keywords (`GenerateConfig.sampler_options`). `runner`: each
    completion is a multi-turn episode of its environment (docs/environments.md).
    `return_routing` (a mixture of experts, `model.routing_replay: sampler`): each record
    holds its tokens' experts (`Record.routing`; manifest `extra.routing`)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                            top_p=top_p, n=n, stop_token_ids=(eos,) if stop_at_eos and eos is not None else ())
    if runner is not None:
        prompt_ids = begin_episodes(runner, problems, 1)[1]
        prompts = [tokenizer.decode(ids) for ids in prompt_ids]
    else:
        prompts = format_prompts(tokenizer, [task.prompt(p) for p in problems],
                                 chat_template=chat_template)
        prompt_ids = encode_prompts(tokenizer, prompts, chat_template=chat_template)
    sampler = build_sampler(model, tokenizer, prompt_ids, batch_size=batch_size, n=n,
                            max_new_tokens=max_new_tokens, key="generate.batch_size",
                            segment_s=SEGMENT_S, **(sampler or {}))
    chunk = chunk_prompts or sampler.batch_size * 4
    key = jax.random.key(seed)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    with ShardWriter(
        out_dir, records_per_shard=records_per_shard, vocab_size=vocab, overwrite=overwrite,
        tokenizer=getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__, model=model_name,
        task=task.name, reward_fn=task.reward_fn,
        sampling=SamplingInfo(backend="jax", temperature=temperature, top_p=top_p, top_k=top_k,
                              max_new_tokens=max_new_tokens, n=n, seed=seed),
        extra={**sampler_logprob_info(backend="jax", temperature=temperature, top_k=top_k,
                                      top_p=top_p),
               **({"routing": routing_info(model.config)} if return_routing else {})},
    ) as writer, stop_point("the current decode segment", grace_s=STOP_GRACE_S) as stop:
        bar = progress_bar(len(problems), desc=f"generate {task.name}", unit="prompt",
                           enabled=progress)
        starts = range(0, len(problems), chunk)
        # A stop leaves the writer unfinished: no manifest, so nothing reads a partial output.
        status = SamplingProgress(
            bar, stop, "generate", "re-run the same command to resume", max_new_tokens=max_new_tokens,
            batches=progress_batches(sampler, [min(chunk, len(problems) - s) for s in starts]))
        try:
            for start in starts:
                sub = slice(start, start + chunk)
                if runner is not None:  # each sample an episode (envs/sampled.py)
                    episodes = begin_episodes(runner, problems[sub], n)[0]
                    done = sample_completions(sampler, prompt_ids[sub], params, key, status,
                                              first_id=start, turns=RowTurns(runner, episodes),
                                              return_routing=return_routing)
                    records = episode_records(runner, episodes, n=n, group_offset=start,
                                              tokens=[c.token_ids for c in done])
                    writer.write_all([r.replace(routing=c.routing) if return_routing else r
                                      for r, c in zip(records, done, strict=True)])
                    continue
                # Noise keyed by (seed, data-set index, sample): the chunking changes nothing.
                completions = sample_completions(sampler, prompt_ids[sub], params, key, status,
                                                 first_id=start, return_routing=return_routing)
                writer.write_all(build_records(task, problems[sub], prompt_ids[sub], completions,
                                               tokenizer, group_offset=start, prompts=prompts[sub]))
        finally:
            bar.close()
        writer.manifest.extra["task_metrics"] = task.metrics()
    return writer.manifest
