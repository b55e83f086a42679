"""Batched autoregressive sampling with a KV cache: prefill + decode, jitted with static shapes.

`Sampler(model).generate(prompts, SamplingParams(...), key)` returns a `GenerationOutput`
with, for every sample, the completion tokens and TWO per-token log-probabilities:

* `logprobs` — log-prob of the sampled token under the distribution it was actually drawn
  from: `log_softmax(process(logits / T))` where `process` applies top-k then top-p
  (truncated tokens get probability 0, the rest are renormalised). With `temperature == 0`
  (greedy) this distribution is a point mass, so `logprobs == 0`.
* `raw_logprobs` — log-prob under the tempered but *untruncated* policy,
  `log_softmax(logits / T)` (`T = 1` when greedy). This is what a trainer that re-scores with
  `logits / T` (`mu_source`) computes, so compare against this one; the two agree
  exactly when top-k/top-p are off. Temperature is never silently baked in: both say which T.

Shapes are static: prompts are left-padded to a length bucket (`prompt_buckets`; 16, 24, 32, 48, …
by default) and the batch is padded to `batch_size` prompts, so repeated calls with the same
bucket, batch size, `max_new_tokens`, `n`, `top_k` and top-p on/off reuse one compiled program
(temperature, the top_p value and stop ids are traced arguments). Each prompt is prefilled
once and its n samples share that prefill. Decode runs in `lax.while_loop` segments that exit
early once every row has emitted a stop token; between segments, rows that have finished are
dropped from the batch once at most half are still running (`Sampler(segment_steps=,
min_rows=)`, sampling/decode_program.py), without changing any sample. A finished row's tokens
are `pad_token_id` and its log-probs 0 after its stop token. The KV cache grows between up
to `cache_windows` windows of steps (`window_ends`): a decode step attends over the slots its
window can fill, not over prompt + max_new_tokens from the first step.

Determinism: the noise of sample j of prompt i (its index in the call) at completion position
t is drawn from `fold_in(fold_in(fold_in(key, i), j), t)` (`decode_program.sample_key`), so a
sample does not depend on the batch it is decoded in, nor on `batch_size`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxrl_llm.parallel.distributed import host_array
from jaxrl_llm.sampling.decode_program import (  # noqa: F401 (process_logits re-exported)
    Program,
    decode_segment,
    fused_layer_params,
    grow_cache,
    prefill,
    process_logits,
    select_rows,
)
from jaxrl_llm.sampling.routing import check_routing_model

Array = jax.Array

FINISH_STOP = "stop"  # a stop token (e.g. EOS) was sampled; it is the row's last token
FINISH_LENGTH = "length"  # max_new_tokens reached without a stop token


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """What to sample. Hashable: it is a static argument of the compiled decode program.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it.
    top_k: keep the k most likely tokens (0 = off). Ties with the k-th logit are kept too.
    top_p: keep the smallest set of most likely tokens whose probability reaches top_p
        (1.0 = off), after top-k. Ties with the cut-off logit are kept too.
    n: samples per prompt (independent draws from the same prompt).
    stop_token_ids: a row ends after emitting any of these (the stop token is included in
        the completion and its length).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature={self.temperature} must be finite and >= 0")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 disables top-k)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.n < 1:
            raise ValueError(f"n={self.n} must be >= 1")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclasses.dataclass(frozen=True)
class GenerationOutput:
    """One row per sample, ordered prompt-major: rows `i*n .. i*n + n-1` belong to prompt i.

    tokens [N, max_new_tokens] int32, `pad_token_id` after `lengths`.
    logprobs / raw_logprobs [N, max_new_tokens] float32, 0 after `lengths` (module docstring).
    """

    prompt_index: np.ndarray  # [N] int: which prompt the sample continues
    sample_index: np.ndarray  # [N] int in [0, n): which of the prompt's n samples
    tokens: np.ndarray
    logprobs: np.ndarray
    raw_logprobs: np.ndarray
    lengths: np.ndarray  # [N] int: completion tokens including the stop token
    finish_reason: np.ndarray  # [N] str: FINISH_STOP or FINISH_LENGTH
    temperature: float
    top_k: int
    top_p: float
    logits: np.ndarray | None = None  # [N, max_new, V] raw logits, only with return_logits
    # [N, max_new] int: the weight version that sampled each token, only with in-flight weight
    # updates (`ContinuousSampler.generate(weights=...)`)
    versions: np.ndarray | None = None
    # [N, max_new] uint8: 1 where the model sampled the token, 0 where an environment's was
    # fed (multi-turn episodes, `ContinuousSampler.generate(turns=...)`); None: all sampled
    action_mask: np.ndarray | None = None
    # [N, max_new, L, k] int8/int16: the experts of token t as it was fed (t < length − 1;
    # -1 elsewhere), only with `generate(return_routing=True)` (sampling/routing.py)
    routing: np.ndarray | None = None

    def completions(self) -> list[list[int]]:
        """Completion token lists without padding."""
        return [row[:length].tolist() for row, length in zip(self.tokens, self.lengths)]


# ---- Python-level driver --------------------------------------------------------------------


def default_bucket(length: int, minimum: int = 16) -> int:
    """Smallest of the powers of two and their halfway points 3·2ᵏ⁻¹ (16, 24, 32, 48, 64, 96,
    …) ≥ max(length, minimum): padding is at most a third of a row (half with powers of two
    alone; a 42-token prompt is padded to 48, not 64) for twice the compiled shapes."""
    n = max(length, minimum, 1)
    power = 1 << (n - 1).bit_length()  # the smallest power of two ≥ n
    return power * 3 // 4 if power * 3 // 4 >= n else power


def window_ends(max_new_tokens: int, windows: int, min_steps: int = 32) -> list[int]:
    """The decode steps at which the KV cache grows: window i runs steps up to (not including)
    `ends[i]` with a cache of P + ends[i] slots (decode step s writes slot P + s - 1; one
    window is the P + max_new_tokens slots of an unwindowed cache).

    The max_new_tokens - 1 decode steps are split into at most `windows` equal parts of at
    least `min_steps` steps each (each window is one more compiled decode program; short
    generations keep one). The last end is max_new_tokens."""
    if windows < 1:
        raise ValueError(f"cache_windows={windows} must be >= 1")
    steps = max_new_tokens - 1
    count = max(1, min(windows, steps // min_steps))
    return [1 + -(-i * steps // count) for i in range(1, count + 1)]


def sampling_bytes(config: Any, *, prompts: int, n: int, prompt_len: int, max_new_tokens: int,
                   cache_itemsize: int = 4, kv_only: bool = False) -> int:
    """Estimated bytes one prompt batch adds to the resident weights: the KV cache of its
    prompts × n rows at its full length, twice (growing a window copies the cache), plus the
    prefill's widest temporaries (one layer's attention scores and MLP activations) and three
    float32 [rows, V] logit buffers (logits, probabilities, top-p's sort). `kv_only`: the KV
    cache's share alone (what tensor parallelism splits too)."""
    rows, slots = prompts * n, prompt_len + max_new_tokens
    kv = 2 * rows * config.num_layers * config.num_kv_heads * config.head_dim * slots * cache_itemsize
    if kv_only:
        return 2 * kv
    prefill = 4 * prompts * prompt_len * (config.num_heads * prompt_len
                                          + 3 * config.intermediate_size)
    return 2 * kv + prefill + 3 * 4 * rows * config.vocab_size


class Sampler:
    """Generate from an NNX `Decoder` (anything with `init_cache`, `__call__(..., cache=)`
    and `logits`). The model is re-read at every call, so training updates are picked up.

    batch_size: prompts per compiled batch (rows = batch_size · n); the last batch is padded.
    prompt_buckets: allowed padded prompt lengths (sorted); None = `default_bucket`.
    segment_steps: with stop tokens, decode runs in segments of this many steps (default
        max(8, max_new_tokens / 8)); after a segment, once at most half the rows are still
        running, only those rows (padded to a power of two ≥ `min_rows`) go on, so finished
        rows stop costing compute (`sampling.decode_program`: the samples do not change).
    cache_windows: decode runs in up to this many windows of steps, the KV cache growing
        between them (`window_ends`); 1 allocates prompt + max_new_tokens slots at the prefill.
    segment_s: if set, segments are also cut to about this many seconds (the steps per second
        of the last segment; 8 steps first), so `on_segment` (a stop check, a progress line)
        runs that often however slow a step is. One process only: hosts must run the same
        segments. The samples do not change.
    """

    def __init__(self, model: Any, *, pad_token_id: int = 0, batch_size: int = 8,
                 prompt_buckets: Sequence[int] | None = None, cache_dtype: Any = None,
                 segment_steps: int | None = None, min_rows: int = 4, cache_windows: int = 4,
                 segment_s: float | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if segment_steps is not None and segment_steps < 1:
            raise ValueError(f"segment_steps={segment_steps} must be >= 1")
        if min_rows < 1:
            raise ValueError(f"min_rows={min_rows} must be >= 1")
        if cache_windows < 1:
            raise ValueError(f"cache_windows={cache_windows} must be >= 1")
        self.cache_windows = int(cache_windows)
        self.segment_steps = segment_steps
        self.segment_s = segment_s
        self._timed_steps = 8  # the next segment's length under `segment_s`
        self.min_rows = int(min_rows)
        # Diagnostics (the tests read them): Σ over decode steps of the rows computed, and of
        # rows × the cache slots they attended over.
        self.rows_decoded = 0
        self.slots_attended = 0
        self.model = model
        self.pad_token_id = int(pad_token_id)
        self.batch_size = int(batch_size)
        self.prompt_buckets = None if prompt_buckets is None else tuple(sorted(prompt_buckets))
        self.cache_dtype = cache_dtype

    def bucket(self, length: int) -> int:
        if self.prompt_buckets is None:
            return default_bucket(length)
        for size in self.prompt_buckets:
            if size >= length:
                return size
        raise ValueError(
            f"prompt of {length} tokens is longer than the largest prompt bucket "
            f"{self.prompt_buckets[-1]} (prompts are never truncated; add a larger bucket)"
        )

    @staticmethod
    def checked_ids(prompt_ids: Sequence[int] | None, count: int) -> np.ndarray:
        """`prompt_ids` as int32 [count] (default 0 … count-1), or a ValueError."""
        if prompt_ids is None:
            return np.arange(count, dtype=np.int32)
        ids = np.asarray(prompt_ids, np.int64)
        if ids.shape != (count,) or np.any(ids < 0) or np.any(ids >= 2**31):
            raise ValueError(f"prompt_ids must be {count} ids in [0, 2**31), one per prompt")
        return ids.astype(np.int32)

    def checked_prompts(self, prompts: Sequence[Sequence[int]],
                        params: SamplingParams) -> list[list[int]]:
        """The prompts as int lists, or a ValueError naming the first bad prompt or stop id:
        empty, a token or stop id outside the vocabulary, longer than the model's context
        (`max_position_embeddings`) or than the largest prompt bucket. Before any compile."""
        prompts = [list(map(int, p)) for p in prompts]
        if not prompts:
            raise ValueError("prompts is empty")
        config = getattr(self.model, "config", None)
        vocab = getattr(config, "vocab_size", None)
        context = getattr(config, "max_position_embeddings", None)
        if vocab is not None:
            bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"stop token ids {bad} are outside the vocabulary [0, {vocab})"
                                 " (check the tokenizer's eos_token_id and the stop ids)")
        for index, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompts[{index}] is empty")
            bad = [t for t in prompt if vocab is not None and not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompts[{index}] has token ids outside [0, {vocab}): "
                                 f"{bad[:5]}")
            if context is not None and len(prompt) > context:
                raise ValueError(f"prompts[{index}] has {len(prompt)} tokens, more than the "
                                 f"model's context of {context} (max_position_embeddings); "
                                 "prompts are never truncated: shorten it")
        self.bucket(max(map(len, prompts)))  # the largest bucket's refusal, before compiling
        return prompts

    def _decode(self, carry: dict, params: SamplingParams, prompt_width: int,
                window_steps: list[int],
                run_segment: Callable[[dict, jax.Array], dict],
                on_segment: Callable[[int], None] | None = None) -> dict[str, np.ndarray]:
        """Run the decode segments of one prompt batch (`run_segment(carry, until)`), growing
        the cache at each of `window_steps` (`window_ends`); its outputs, one row per sample.
        `on_segment(step)` runs after each segment with the tokens decoded so far."""
        rows0 = self.batch_size * params.n
        max_new = params.max_new_tokens
        longest = max_new if not params.stop_token_ids else (
            self.segment_steps or max(8, math.ceil(max_new / 8)))
        ends = iter(window_steps)
        window_end = next(ends)
        current = np.arange(rows0)  # the original row of each row still in the carry
        host: dict[str, np.ndarray] = {}
        step = 1
        while step < max_new:
            if step >= window_end:
                window_end = next(ends)
                carry = grow_cache(carry, cache_len=prompt_width + window_end)
            segment = longest if self.segment_s is None else min(longest, self._timed_steps)
            until = min(step + segment, window_end)
            start = time.perf_counter()
            carry = run_segment(carry, jnp.int32(until))
            stopped = host_array(carry["loop"]["stopped"])  # (waits for the segment)
            done = int(carry["loop"]["step"]) - step
            if self.segment_s is not None:  # a compile makes the next one short, once
                rate = done / max(time.perf_counter() - start, 1e-6)
                self._timed_steps = max(1, int(self.segment_s * rate))
            self.rows_decoded += len(current) * done
            self.slots_attended += len(current) * done * (prompt_width + window_end)
            step = int(carry["loop"]["step"])
            if on_segment is not None:
                on_segment(step)
            if step >= max_new or stopped.all():
                break
            live = np.flatnonzero(~stopped)
            size = max(self.min_rows, 1 << max(0, math.ceil(math.log2(len(live)))))
            if size <= len(current) // 2:
                self._collect(carry, current, host)  # the finished rows are final
                # Pad with finished rows: they stay stopped and rewrite their own outputs.
                keep = np.concatenate([live, np.flatnonzero(stopped)[: size - len(live)]])
                carry = select_rows(carry, jnp.asarray(keep, jnp.int32))
                current = current[keep]
        self._collect(carry, current, host)
        return host

    @staticmethod
    def _collect(carry: dict, current: np.ndarray, host: dict[str, np.ndarray]) -> None:
        """Copy the carry's per-row outputs into `host` (rows indexed by original row)."""
        buffers = dict(carry["out"], lengths=carry["loop"]["lengths"],
                       stopped=carry["loop"]["stopped"])
        for name, value in buffers.items():
            value = host_array(value)
            if name not in host:  # the first call sees every row (nothing selected yet)
                host[name] = np.zeros_like(value)
            host[name][current] = value

    def _cache_dtype(self):
        if self.cache_dtype is not None:
            return jnp.dtype(self.cache_dtype)
        config = getattr(self.model, "config", None)
        return jnp.dtype(getattr(config, "compute_jnp_dtype", jnp.float32))

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, key: Array,
                 *, progress: bool = False, return_logits: bool = False,
                 on_batch: Callable[[int], None] | None = None,
                 on_segment: Callable[[int, int], None] | None = None,
                 prompt_ids: Sequence[int] | None = None,
                 return_routing: bool = False) -> GenerationOutput:
        """Sample `params.n` completions for every prompt (token id lists, no padding).

        `return_logits` also returns every step's unprocessed logits (tests and debugging:
        memory N × max_new × V floats). `on_batch(prompts)` is called after each prompt batch
        with its number of prompts (progress bars, stop checks); `on_segment(batch, step)`
        before each prompt batch (step 0: its prefill, which compiles on first use) and after
        each of its decode segments (`step` tokens decoded), so a stop check or a progress
        line does not wait for the whole batch. `prompt_ids`: the ids that key each prompt's
        noise (default 0, 1, …; a caller that samples a data set in chunks passes each prompt's
        index in the data set, so a sample does not depend on the chunking).
        `return_routing` (a mixture of experts): each fed token's experts in the output's
        `routing` (sampling/routing.py).
        """
        if return_routing:
            check_routing_model(self.model)
        prompts = self.checked_prompts(prompts, params)
        ids = self.checked_ids(prompt_ids, len(prompts))
        graphdef, state = nnx.split(self.model)
        temperature = jnp.float32(params.temperature if not params.greedy else 1.0)
        top_p = jnp.float32(params.top_p)
        # -1 never matches a token: "no stop tokens" keeps the same array shape.
        stop_ids = jnp.asarray(params.stop_token_ids or (-1,), jnp.int32)
        cache_dtype = self._cache_dtype()
        layer_params = fused_layer_params(graphdef, state)  # once per call, for every batch
        static = dict(program=Program.of(params, routing=return_routing),
                      pad_token_id=self.pad_token_id, return_logits=return_logits)
        run_segment = lambda carry, until: decode_segment(
            graphdef, state, layer_params, carry, until, temperature, top_p, stop_ids,
            **static)
        windows = window_ends(params.max_new_tokens, self.cache_windows)
        starts = range(0, len(prompts), self.batch_size)
        pieces = []
        for batch_index, start in enumerate(tqdm(starts, desc="generate", unit="batch",
                                                 disable=not progress)):
            chunk = prompts[start:start + self.batch_size]
            width = self.bucket(max(len(p) for p in chunk))
            tokens = np.full((self.batch_size, width), self.pad_token_id, np.int32)
            mask = np.zeros((self.batch_size, width), np.int32)
            for row, prompt in enumerate(chunk):
                tokens[row, width - len(prompt):] = prompt
                mask[row, width - len(prompt):] = 1
            # Padding prompts (last batch) are one real token so every row is well defined.
            tokens[len(chunk):, -1] = self.pad_token_id
            mask[len(chunk):, -1] = 1
            segment_done = None
            if on_segment is not None:
                on_segment(batch_index, 0)
                segment_done = functools.partial(on_segment, batch_index)
            carry = prefill(graphdef, state, layer_params, jnp.asarray(tokens),
                            jnp.asarray(mask),
                            jnp.asarray(np.resize(ids[start:start + self.batch_size],
                                                  self.batch_size)), key,
                            temperature, top_p, stop_ids, cache_dtype=cache_dtype,
                            cache_len=width + windows[0], **static)
            out = self._decode(carry, params, width, windows, run_segment, segment_done)
            keep = len(chunk) * params.n
            pieces.append({k: v[:keep] for k, v in out.items()})
            if on_batch is not None:
                on_batch(len(chunk))
        merged = {k: np.concatenate([p[k] for p in pieces]) for k in pieces[0]}
        count = len(prompts) * params.n
        return GenerationOutput(
            prompt_index=np.repeat(np.arange(len(prompts)), params.n),
            sample_index=np.tile(np.arange(params.n), len(prompts)),
            tokens=merged["tokens"],
            logprobs=merged["logprobs"],
            raw_logprobs=merged["raw_logprobs"],
            lengths=merged["lengths"],
            finish_reason=np.where(merged["stopped"], FINISH_STOP, FINISH_LENGTH)[:count],
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            logits=merged.get("logits"),
            routing=merged.get("routing"),
        )
