"""The one way a caller gets a sampler (`generate`, `evaluate` and its verifier, the API's
`Policy.sample`, the online loop's rollouts through it): a `ContinuousSampler` (continuous
batching, `sampling/continuous.py`) over the model with the tokenizer's pad id, whose
batch_size × n decode slots fit the memory left; `batching="static"` gives the fixed prompt
batches of `Sampler` (the benchmarks' old sampler).

Before sampling, will a prompt batch's KV cache fit? If not, fewer prompts per batch (only
speed changes, and which random draws each sample gets), or a refusal naming the figure and
the fix (`parallel/memory.py`).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

from jaxrl_llm.core.errors import ConfigError
from jaxrl_llm.parallel.memory import (
    HOST_OVERHEAD,
    MARGIN,
    InsufficientMemory,
    available_memory,
    gib,
)
from jaxrl_llm.sampling.continuous import ContinuousSampler
from jaxrl_llm.sampling.sampler import Sampler, default_bucket, sampling_bytes

BATCHING = ("continuous", "static")


def decode_weights_bytes(model: Any) -> int:
    """Bytes per device of the layer weights' decode copy (`Decoder.decode_layer_params`,
    built once per sampling call: fused projections, one tree per layer), counted as the
    whole layer weights (a scanned model decoded unrolled copies them all; otherwise the fused
    projections are copies, most of them: an upper bound)."""
    layers = nnx.state(model.layers, nnx.Param)
    return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
               if hasattr(a, "sharding") else a.nbytes for a in jax.tree.leaves(layers))


def fit_sampler_batch(model: Any, *, batch_size: int, n: int, prompt_len: int,
                      max_new_tokens: int, key: str, cache_itemsize: int = 4,
                      say: Callable[[str], None] | None = None) -> int:
    """The largest prompt batch ≤ `batch_size` (halving) whose sampling memory fits, beside
    the decode copy of the layer weights (`decode_weights_bytes`); `key` names the config key
    of the batch size in the messages."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "num_kv_heads"):
        return batch_size  # not a Decoder (test models): nothing to estimate
    say = say or (lambda text: print(text, file=sys.stderr))
    available = available_memory(jax.devices()[0])
    overhead = (HOST_OVERHEAD if available.host else 0) + decode_weights_bytes(model)

    def need(prompts: int) -> int:
        est = sampling_bytes(config, prompts=prompts, n=n, prompt_len=prompt_len,
                             max_new_tokens=max_new_tokens, cache_itemsize=cache_itemsize)
        return int(est * (1 + MARGIN)) + overhead

    size = batch_size
    while size > 1 and need(size) > available.bytes:
        size = (size + 1) // 2
    if need(size) > available.bytes:
        raise InsufficientMemory(
            f"sampling {n} completions of up to {max_new_tokens} tokens after a "
            f"{prompt_len}-token prompt needs about {gib(need(1))} even one prompt at a time "
            f"(KV cache, logits and the decode copy of the layer weights, estimated); "
            f"{gib(available.bytes)} is {available.where}. "
            "Lower the samples per prompt (generate.n / eval.n), the new tokens "
            "(generate.max_new_tokens / eval.max_new_tokens) or the prompt (e.g. "
            "data.task_options: {num_shots: 0})")
    if size < batch_size:
        say(f"memory: {batch_size} prompts per batch would need about {gib(need(batch_size))} "
            f"(KV cache of {batch_size}×{n} rows × {prompt_len + max_new_tokens} tokens, "
            f"estimated) and {gib(available.bytes)} is {available.where}: sampling {size} "
            f"prompts per batch instead (set {key}={size} to silence this)")
    return size


def build_sampler(model: Any, tokenizer: Any, prompt_ids: Sequence[Sequence[int]], *,
                  batch_size: int, n: int, max_new_tokens: int, key: str,
                  say: Callable[[str], None] | None = None,
                  segment_s: float | None = None, batching: str = "continuous",
                  prefill_chunk: int | None = None) -> Sampler:
    """A `Sampler` for `prompt_ids` (token id lists): pad id from `tokenizer` (0 if it has
    none), prompt batch `batch_size` or fewer so that `n` samples of `max_new_tokens` after
    the longest prompt's bucket fit (`fit_sampler_batch`; `key` is the batch size's config key).
    `segment_s`: decode segments cut to about that many seconds, so a command's progress and
    Ctrl-C act within a batch (single-process only: the sampler's own rule). `batching`:
    "continuous" (batch_size × n slots refilled as samples end; `prefill_chunk` prompt tokens
    prefilled per decode step, None: whole prompts) or "static" (`generate.batching`,
    `generate.prefill_chunk`: `GenerateConfig.sampler_options`)."""
    if batching not in BATCHING:
        raise ValueError(f"batching={batching!r}: expected one of {BATCHING}")
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    longest = max(map(len, prompt_ids), default=0)
    if context is not None and longest > context:
        index = next(i for i, p in enumerate(prompt_ids) if len(p) == longest)
        raise ConfigError(
            f"prompt {index} has {longest} tokens, more than the model's context of {context} "
            "(model.max_position_embeddings); prompts are never truncated: use shorter prompts "
            "(e.g. data.task_options: {num_shots: 0}) or a model with a longer context")
    if context is not None and longest + max_new_tokens > context:
        tokens = key.split(".")[0] + ".max_new_tokens"  # generate.* or eval.*
        raise ConfigError(
            f"the longest prompt ({longest} tokens) + {tokens}={max_new_tokens} is "
            f"{longest + max_new_tokens} positions, more than the model's context of {context} "
            f"(max_position_embeddings, after model.rope_scaling): lower {tokens} to at most "
            f"{context - longest}, or extend the context with model.rope_scaling (random "
            "models: model.max_position_embeddings)")
    prompt_len = default_bucket(max(map(len, prompt_ids), default=1))
    fitted = fit_sampler_batch(model, batch_size=batch_size, n=n, prompt_len=prompt_len,
                               max_new_tokens=max_new_tokens, key=key, say=say)
    pad = getattr(tokenizer, "pad_token_id", None)
    pad = 0 if pad is None else pad
    segment_s = segment_s if jax.process_count() == 1 else None
    if batching == "static":
        return Sampler(model, pad_token_id=pad, batch_size=fitted, segment_s=segment_s)
    return ContinuousSampler(model, slots=fitted * n, batch_size=fitted, pad_token_id=pad,
                             segment_s=segment_s, prefill_chunk=prefill_chunk)
