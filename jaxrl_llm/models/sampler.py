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

Shapes are static: prompts are left-padded to a length bucket (`prompt_buckets`, powers of two
by default) and the batch is padded to `batch_size` prompts, so repeated calls with the same
bucket, batch size, `max_new_tokens`, `n`, `top_k` and top-p on/off reuse one compiled program
(temperature, the top_p value and stop ids are traced arguments). Decode runs inside one
`lax.while_loop` that exits early once every row has emitted a stop token. Finished rows keep
running (static shapes) but their tokens are `pad_token_id` and their log-probs 0.

Determinism: the same `key`, prompts, `batch_size` and params give the same samples (each
prompt batch uses `fold_in(key, batch_index)`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxrl_llm.models.decoder import KVCache

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

    def completions(self) -> list[list[int]]:
        """Completion token lists without padding."""
        return [row[:length].tolist() for row, length in zip(self.tokens, self.lengths)]


# ---- logit processing (pure) ---------------------------------------------------------------


def process_logits(logits: Array, temperature: Array, top_p: Array, *, top_k: int,
                   use_top_p: bool) -> Array:
    """Temperature, then top-k, then top-p (HF/vLLM order). Removed tokens get -inf.

    logits [B, V] float32; temperature > 0 and top_p traced scalars (no recompilation when
    they change); top_k static (0 = off); `use_top_p` static (False skips the sort).
    """
    scaled = logits / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(scaled, top_k)[0][:, -1:]
        scaled = jnp.where(scaled >= kth, scaled, -jnp.inf)
    if use_top_p:
        desc = -jnp.sort(-scaled, axis=-1)
        probs = jax.nn.softmax(desc, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        # Keep token j (in descending order) while the mass before it is below top_p; the most
        # likely token is always kept.
        keep = (mass_before < top_p).at[:, 0].set(True)
        cutoff_index = jnp.sum(keep, axis=-1, keepdims=True) - 1
        cutoff = jnp.take_along_axis(desc, cutoff_index, axis=-1)
        scaled = jnp.where(scaled >= cutoff, scaled, -jnp.inf)
    return scaled


@dataclasses.dataclass(frozen=True)
class _Program:
    """The parts of `SamplingParams` that change the compiled program (temperature, top_p
    values and stop ids are traced, so changing them does not recompile)."""

    max_new_tokens: int
    n: int
    greedy: bool
    top_k: int
    use_top_p: bool

    @classmethod
    def of(cls, params: SamplingParams) -> _Program:
        return cls(params.max_new_tokens, params.n, params.greedy, params.top_k,
                   params.top_p < 1.0)


def sample_step(key: Array, logits: Array, temperature: Array, top_p: Array, *,
                greedy: bool, top_k: int, use_top_p: bool) -> tuple[Array, Array, Array]:
    """One token per row and its (processed, raw) log-probs. logits [B, V] -> 3 × [B]."""
    logits = logits.astype(jnp.float32)
    if greedy:
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        raw = jax.nn.log_softmax(logits, axis=-1)
        raw_lp = jnp.take_along_axis(raw, token[:, None], axis=-1)[:, 0]
        return token, jnp.zeros_like(raw_lp), raw_lp
    processed = process_logits(logits, temperature, top_p, top_k=top_k, use_top_p=use_top_p)
    token = jax.random.categorical(key, processed, axis=-1).astype(jnp.int32)
    lp = jnp.take_along_axis(jax.nn.log_softmax(processed, axis=-1), token[:, None], axis=-1)
    raw = jax.nn.log_softmax(logits / temperature, axis=-1)
    raw_lp = jnp.take_along_axis(raw, token[:, None], axis=-1)[:, 0]
    return token, lp[:, 0], raw_lp


# ---- the compiled prefill + decode program -------------------------------------------------


def _last_logits(model: Any, hidden: Array) -> Array:
    """Logits [B, V] of the last position (prompts are left-padded: it is the last real one)."""
    return model.logits(hidden[:, -1:, :])[:, 0, :].astype(jnp.float32)


def _repeat_rows(cache: KVCache, n: int) -> KVCache:
    """Each row of the cache repeated n times (adjacent), k/v rows live on axis 1."""
    if n == 1:
        return cache
    return cache.replace(
        k=jnp.repeat(cache.k, n, axis=1),
        v=jnp.repeat(cache.v, n, axis=1),
        segment_ids=jnp.repeat(cache.segment_ids, n, axis=0),
        positions=jnp.repeat(cache.positions, n, axis=0),
        lengths=jnp.repeat(cache.lengths, n, axis=0),
    )


@functools.partial(jax.jit, static_argnames=("graphdef", "program", "pad_token_id", "cache_dtype",
                                    "return_logits"))
def _generate_batch(graphdef, state, prompt_tokens: Array, prompt_mask: Array, key: Array,
                    temperature: Array, top_p: Array, stop_ids: Array, *, program: _Program,
                    pad_token_id: int, cache_dtype, return_logits: bool) -> dict[str, Array]:
    """Prefill B left-padded prompts, then decode `max_new_tokens` for each of their n samples.

    prompt_tokens, prompt_mask [B, P] (mask 1 on real tokens, left padding 0).
    Returns tokens/logprobs/raw_logprobs [B·n, max_new], lengths [B·n], stopped [B·n] and,
    with `return_logits`, the unprocessed logits of every step [B·n, max_new, V].
    """
    model = nnx.merge(graphdef, state)
    chex.assert_equal_shape([prompt_tokens, prompt_mask])
    n, max_new = program.n, program.max_new_tokens
    sample = functools.partial(sample_step, greedy=program.greedy, top_k=program.top_k,
                               use_top_p=program.use_top_p)
    batch, prompt_len = prompt_tokens.shape
    mask = prompt_mask.astype(jnp.int32)
    segment_ids = mask  # left padding has segment id 0 and is never attended to
    positions = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)

    # Prefill each prompt once, then give each of its n samples a copy of its cache: the n
    # samples of a prompt are adjacent rows (prompt-major order).
    cache = model.init_cache(batch, prompt_len + max_new, cache_dtype)
    hidden, cache = model(prompt_tokens, positions=positions, segment_ids=segment_ids,
                          cache=cache)
    cache = _repeat_rows(cache, n)
    logits = jnp.repeat(_last_logits(model, hidden), n, axis=0)
    next_position = jnp.repeat(positions[:, -1] + 1, n, axis=0)
    rows = batch * n
    key, first_key = jax.random.split(key)
    token, lp, raw_lp = sample(first_key, logits, temperature, top_p)

    out = dict(
        tokens=jnp.full((rows, max_new), pad_token_id, jnp.int32).at[:, 0].set(token),
        logprobs=jnp.zeros((rows, max_new), jnp.float32).at[:, 0].set(lp),
        raw_logprobs=jnp.zeros((rows, max_new), jnp.float32).at[:, 0].set(raw_lp),
    )
    if return_logits:
        out["logits"] = jnp.zeros((rows, max_new, logits.shape[-1]), jnp.float32)
        out["logits"] = out["logits"].at[:, 0].set(logits)
    state0 = dict(step=jnp.int32(1), cache=cache, last=token, key=key,
                  stopped=jnp.isin(token, stop_ids), lengths=jnp.ones((rows,), jnp.int32))

    def cond(carry):
        loop, _ = carry
        return (loop["step"] < max_new) & ~jnp.all(loop["stopped"])

    def body(carry):
        loop, out = carry
        step = loop["step"]
        pos = (next_position + step - 1)[:, None]
        hidden, cache = model(loop["last"][:, None], positions=pos,
                              segment_ids=jnp.ones_like(pos), cache=loop["cache"])
        logits = _last_logits(model, hidden)
        key, step_key = jax.random.split(loop["key"])
        token, lp, raw_lp = sample(step_key, logits, temperature, top_p)
        live = ~loop["stopped"]
        token = jnp.where(live, token, pad_token_id)
        # Write column `step` in place (the buffers are loop-carried, so XLA updates them).
        write = lambda buf, col: jax.lax.dynamic_update_slice(
            buf, col[:, None].astype(buf.dtype), (0, step) + (0,) * (buf.ndim - 2))
        out = dict(out, tokens=write(out["tokens"], token),
                   logprobs=write(out["logprobs"], jnp.where(live, lp, 0.0)),
                   raw_logprobs=write(out["raw_logprobs"], jnp.where(live, raw_lp, 0.0)))
        if return_logits:
            out["logits"] = write(out["logits"], logits)
        loop = dict(step=step + 1, cache=cache, last=token, key=key,
                    stopped=loop["stopped"] | (live & jnp.isin(token, stop_ids)),
                    lengths=loop["lengths"] + live.astype(jnp.int32))
        return loop, out

    loop, out = jax.lax.while_loop(cond, body, (state0, out))
    return dict(out, lengths=loop["lengths"], stopped=loop["stopped"])


# ---- Python-level driver --------------------------------------------------------------------


def default_bucket(length: int, minimum: int = 16) -> int:
    """Smallest power of two ≥ max(length, minimum)."""
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(length, 1)))))


class Sampler:
    """Generate from an NNX `Decoder` (anything with `init_cache`, `__call__(..., cache=)`
    and `logits`). The model is re-read at every call, so training updates are picked up.

    batch_size: prompts per compiled batch (rows = batch_size · n); the last batch is padded.
    prompt_buckets: allowed padded prompt lengths (sorted); None = powers of two ≥ 16.
    """

    def __init__(self, model: Any, *, pad_token_id: int = 0, batch_size: int = 8,
                 prompt_buckets: Sequence[int] | None = None, cache_dtype: Any = None):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
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

    def _cache_dtype(self):
        if self.cache_dtype is not None:
            return jnp.dtype(self.cache_dtype)
        config = getattr(self.model, "config", None)
        return jnp.dtype(getattr(config, "compute_jnp_dtype", jnp.float32))

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, key: Array,
                 *, progress: bool = False, return_logits: bool = False) -> GenerationOutput:
        """Sample `params.n` completions for every prompt (token id lists, no padding).

        `return_logits` also returns every step's unprocessed logits (tests and debugging:
        memory N × max_new × V floats).
        """
        prompts = [list(map(int, p)) for p in prompts]
        if not prompts:
            raise ValueError("prompts is empty")
        for index, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompts[{index}] is empty")
        graphdef, state = nnx.split(self.model)
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        if vocab is not None:
            for index, prompt in enumerate(prompts):
                bad = [t for t in prompt if not 0 <= t < vocab]
                if bad:
                    raise ValueError(f"prompts[{index}] has token ids outside [0, {vocab}): "
                                     f"{bad[:5]}")
        temperature = jnp.float32(params.temperature if not params.greedy else 1.0)
        top_p = jnp.float32(params.top_p)
        # -1 never matches a token: "no stop tokens" keeps the same array shape.
        stop_ids = jnp.asarray(params.stop_token_ids or (-1,), jnp.int32)
        cache_dtype = self._cache_dtype()
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
            out = _generate_batch(graphdef, state, jnp.asarray(tokens), jnp.asarray(mask),
                                  jax.random.fold_in(key, batch_index), temperature, top_p,
                                  stop_ids, program=_Program.of(params),
                                  pad_token_id=self.pad_token_id, cache_dtype=cache_dtype,
                                  return_logits=return_logits)
            keep = len(chunk) * params.n
            pieces.append({k: np.asarray(v)[:keep] for k, v in out.items()})
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
        )
