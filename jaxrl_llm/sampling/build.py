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
import jax.numpy as jnp
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
from jaxrl_llm.sampling.layout import DecodeLayout, castable, from_model, sampling_dtype
from jaxrl_llm.sampling.sampler import Sampler, default_bucket, sampling_bytes

BATCHING = ("continuous", "static")


def _placed_bytes(model: Any, tree: Any, layout: DecodeLayout | None) -> int:
    """Bytes per device of `tree`'s arrays in the sampling dtype (`castable` ones), the
    matrices split over the `layout`'s tensor axis."""
    dtype = sampling_dtype(model)
    dtype = None if dtype is None else jnp.dtype(dtype)
    tensor = 1 if layout is None else layout.tensor

    def size(a: Any) -> int:
        item = dtype.itemsize if dtype is not None and castable(a, dtype) else a.dtype.itemsize
        return a.size * item // (tensor if a.ndim >= 2 else 1)

    return sum(size(a) for a in jax.tree.leaves(tree))


def weight_version_bytes(model: Any, layout: DecodeLayout | None = None) -> int:
    """Bytes per device of one copy of the model's weights as the sampler decodes with them
    (a weight version a pipeline publishes: `DecodeLayout.place_state`)."""
    return _placed_bytes(model, nnx.state(model, nnx.Param), layout)


def decode_weights_bytes(model: Any, layout: DecodeLayout | None = None) -> int:
    """Bytes per device of the weights' decode copies: the layer weights' fused copy
    (`Decoder.decode_layer_params`, built once per sampling call; counted as the whole layer
    weights, an upper bound), and with a `layout` that places or casts them (`place_state`)
    the whole model once more, in the sampling dtype, split over its tensor axis."""
    dtype = sampling_dtype(model)
    dtype = None if dtype is None else jnp.dtype(dtype)
    layers = _placed_bytes(model, nnx.state(model.layers, nnx.Param), layout)
    placed = layout is not None and (layout.mesh is not None or any(
        dtype is not None and castable(a, dtype) for a in jax.tree.leaves(nnx.state(model))))
    return layers + (weight_version_bytes(model, layout) if placed else 0)


def fit_sampler_batch(model: Any, *, batch_size: int, n: int, prompt_len: int,
                      max_new_tokens: int, key: str, cache_itemsize: int = 4,
                      layout: DecodeLayout | None = None,
                      say: Callable[[str], None] | None = None, reserve: int = 0,
                      reserved: str = "") -> int:
    """The largest prompt batch ≤ `batch_size` (halving) whose sampling memory fits on each
    device of the decode `layout` (the KV cache split over its slot groups and tensor axis,
    beside the decode copies of the weights, `decode_weights_bytes`); `key` names the config
    key of the batch size in the messages. On a host whose fake devices share its memory (CPU),
    the need is this process's devices' sum. `reserve`: bytes per chip kept free besides
    (`reserved` says for what, e.g. the weight versions a pipeline holds in flight)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "num_kv_heads"):
        return batch_size  # not a Decoder (test models): nothing to estimate
    layout = layout or DecodeLayout()
    say = say or (lambda text: print(text, file=sys.stderr))
    devices = [jax.devices()[0]] if layout.mesh is None else list(layout.mesh.devices.flat)
    available = available_memory(devices[0])
    local = sum(d.process_index == jax.process_index() for d in devices) if available.host else 1
    weights = decode_weights_bytes(model, layout)
    overhead = HOST_OVERHEAD if available.host else 0
    split_kv = layout.groups * layout.tensor
    step = layout.groups // math.gcd(n, layout.groups)  # prompts per step keeping slots divisible

    def per_chip(prompts: int) -> int:
        kv = sampling_bytes(config, prompts=prompts, n=n, prompt_len=prompt_len,
                            max_new_tokens=max_new_tokens, cache_itemsize=cache_itemsize,
                            kv_only=True)
        rest = sampling_bytes(config, prompts=prompts, n=n, prompt_len=prompt_len,
                              max_new_tokens=max_new_tokens, cache_itemsize=cache_itemsize) - kv
        return int((kv / split_kv + rest / layout.groups) * (1 + MARGIN)) + weights + reserve

    need = lambda prompts: per_chip(prompts) * local + overhead
    size = batch_size
    while size > step and need(size) > available.bytes:
        size = max(step, -(-((size + 1) // 2) // step) * step)
    if need(size) > available.bytes:
        raise InsufficientMemory(
            f"sampling {n} completions of up to {max_new_tokens} tokens after a "
            f"{prompt_len}-token prompt needs about {gib(per_chip(size))} per chip even "
            f"{'one prompt' if size == 1 else f'{size} prompts'} at a time (KV cache, logits and the decode copies of the "
            f"weights{f', {reserved}' if reserved else ''}, estimated, over the decode layout's "
            f"{layout.describe()}"
            + (f"; {gib(need(size))} for this host's {local} devices" if local > 1 else "")
            + f"); {gib(available.bytes)} is {available.where}. "
            "Lower the samples per prompt (generate.n / eval.n), the new tokens "
            "(generate.max_new_tokens / eval.max_new_tokens) or the prompt (e.g. "
            "data.task_options: {num_shots: 0}), or split the cache over more devices "
            "(mesh:, generate.decode_data × generate.decode_tensor)")
    if size < batch_size:
        say(f"memory: {batch_size} prompts per batch would need about "
            f"{gib(per_chip(batch_size))} per chip (KV cache of {batch_size}×{n} rows × "
            f"{prompt_len + max_new_tokens} tokens over {layout.describe()}, estimated) and "
            f"{gib(available.bytes)} is {available.where}: sampling {size} prompts per batch "
            f"instead (set {key}={size} to silence this)")
    return size


def build_sampler(model: Any, tokenizer: Any, prompt_ids: Sequence[Sequence[int]], *,
                  batch_size: int, n: int, max_new_tokens: int, key: str,
                  say: Callable[[str], None] | None = None,
                  segment_s: float | None = None, batching: str = "continuous",
                  prefill_chunk: int | None = None, decode_data: int | None = None,
                  decode_tensor: int | None = None, fit_memory: bool = True) -> Sampler:
    """A `Sampler` for `prompt_ids` (token id lists): pad id from `tokenizer` (0 if it has
    none), prompt batch `batch_size` or fewer so that `n` samples of `max_new_tokens` after
    the longest prompt's bucket fit (`fit_sampler_batch`; `key` is the batch size's config key).
    `segment_s`: decode segments cut to about that many seconds, so a command's progress and
    Ctrl-C act within a batch (single-process only: the sampler's own rule). `batching`:
    "continuous" (batch_size × n slots refilled as samples end; `prefill_chunk` prompt tokens
    prefilled per decode step, None: whole prompts) or "static" (`generate.batching`,
    `generate.prefill_chunk`: `GenerateConfig.sampler_options`). `decode_data` ×
    `decode_tensor`: the continuous sampler's decode layout (`layout.from_model`; None: derived
    from the weights' mesh); its slots are batch_size × n rounded up to a multiple of its slot
    groups, said through `say` when that adds slots. `fit_memory=False`: exactly
    `batch_size` prompts per batch, not refitted to the memory left now (a batch the caller
    fixed once, after its own memory check: `Policy.sampler_batch`)."""
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
    if batching == "static" and (decode_data or decode_tensor):
        raise ConfigError("generate.decode_data / generate.decode_tensor lay out the continuous "
                          "sampler; generate.batching=static samples unplaced: unset them or "
                          "set generate.batching: continuous")
    layout = (from_model(model, data=decode_data, tensor=decode_tensor)
              if batching == "continuous" else DecodeLayout())
    prompt_len = default_bucket(max(map(len, prompt_ids), default=1))
    fitted = batch_size if not fit_memory else fit_sampler_batch(
        model, batch_size=batch_size, n=n, prompt_len=prompt_len,
        max_new_tokens=max_new_tokens, key=key, layout=layout, say=say)
    pad = getattr(tokenizer, "pad_token_id", None)
    pad = 0 if pad is None else pad
    segment_s = segment_s if jax.process_count() == 1 else None
    if batching == "static":
        return Sampler(model, pad_token_id=pad, batch_size=fitted, segment_s=segment_s)
    slots = -(-fitted * n // layout.groups) * layout.groups
    if slots != fitted * n:
        (say or (lambda text: print(text, file=sys.stderr)))(
            f"sampler: {fitted}×{n} = {fitted * n} samples at a time rounded up to {slots} "
            f"decode slots, a multiple of the decode layout's {layout.groups} slot groups "
            f"({key} × n a multiple of {layout.groups} avoids the extra slots)")
    return ContinuousSampler(model, slots=slots, batch_size=fitted, pad_token_id=pad,
                             segment_s=segment_s, prefill_chunk=prefill_chunk,
                             decode_layout=layout)
