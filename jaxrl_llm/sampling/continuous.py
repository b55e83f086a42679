"""Continuous batching: a fixed number of decode slots, each refilled with the next
(prompt, sample) as soon as its sample ends (`slot_program.py` holds the compiled programs).

`ContinuousSampler(model, slots=R).generate(prompts, params, key)` returns the same
`GenerationOutput` as the static `Sampler` (rows prompt-major, tokens / logprobs /
raw_logprobs / lengths / finish_reason with the same meaning), and the same samples up to
float rounding: the noise of token t of sample j of prompt i is keyed by (key, i, j, t) alone.

The loop, on the host: while slots are free and work remains, prefill up to K new prompts into
the prompt store (one program of fixed shape [K, W]; a prompt is prefilled once) and copy store
rows into free slots, one per sample (its n samples are n copies of the prompt's keys and values:
the KV bytes per concurrent sequence stay W + max_new_tokens slots, `kv_bytes_per_sequence`);
then decode all slots until `refill_slots` of them are free (or the segment's steps are done),
collect the finished samples, and refill. The cache of every slot is cut to the narrowest of a
few windows (`window_ends`) that holds the longest running sample, so steps do not attend over
max_new_tokens empty slots; once no work waits, the slots still running are gathered into
fewer rows (`select_slots`) as the static sampler drops finished rows. Decode never waits for the longest sample of a batch;
a prefill runs between decode segments (it is not split into chunks), so the slots still
decoding wait for it: K prompts at width W, about refill_slots / n prompts per refill.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_llm.parallel.distributed import host_array
from jaxrl_llm.sampling.decode_program import Program, fused_layer_params
from jaxrl_llm.sampling.sampler import (
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationOutput,
    Sampler,
    SamplingParams,
    window_ends,
)
from jaxrl_llm.sampling.slot_program import (
    assign_slots,
    decode_slots,
    init_slots,
    prefill_store,
    resize_slots,
    select_slots,
)

Array = jax.Array


def kv_bytes_per_token(config: Any, itemsize: int) -> int:
    """Keys and values of one token in every layer."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize


class ContinuousSampler(Sampler):
    """`slots` concurrent sequences (compile-time), refilled as they finish.

    batch_size: prompts per chunk for callers that feed the sampler in chunks (`generate`'s
        `chunk_prompts` default) and for progress counts; default `slots`.
    refill_slots: the decode loop returns to refill once this many slots are free (default
        slots / 4); the prompt store holds ceil(refill_slots / n) prompts.
    segment_steps / segment_s: as `Sampler` (how often `on_segment` runs at most).
    cache_windows: the slots' cache is W + e slots wide for e in `window_ends` (max_new_tokens,
        cache_windows): each segment runs on the narrowest that holds every running sample's
        next token, so a step attends over the context the longest running sample needs.
    min_rows: once no work waits and at most half the slots run, only the running ones go on
        (a power of two ≥ min_rows of them), as `Sampler` drops finished rows.
    """

    def __init__(self, model: Any, *, slots: int, pad_token_id: int = 0,
                 batch_size: int | None = None, refill_slots: int | None = None,
                 prompt_buckets: Sequence[int] | None = None, cache_dtype: Any = None,
                 segment_steps: int | None = None, segment_s: float | None = None,
                 cache_windows: int = 4, min_rows: int = 4):
        if slots < 1:
            raise ValueError(f"slots={slots} must be >= 1")
        super().__init__(model, pad_token_id=pad_token_id, batch_size=batch_size or slots,
                         prompt_buckets=prompt_buckets, cache_dtype=cache_dtype,
                         segment_steps=segment_steps, segment_s=segment_s,
                         cache_windows=cache_windows, min_rows=min_rows)
        self.slots = int(slots)
        self.refill_slots = int(refill_slots or max(1, slots // 4))
        if not 1 <= self.refill_slots <= self.slots:
            raise ValueError(f"refill_slots={refill_slots} must be in [1, slots={slots}]")
        # Diagnostics: prefill programs run, prompts prefilled, decode steps run.
        self.prefills = self.prefilled_prompts = self.steps = 0
        self.kv_bytes_per_sequence = 0

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, key: Array,
                 *, progress: bool = False, return_logits: bool = False,
                 on_batch: Callable[[int], None] | None = None,
                 on_segment: Callable[[int, int], None] | None = None,
                 prompt_ids: Sequence[int] | None = None) -> GenerationOutput:
        """`Sampler.generate`'s contract. `on_segment(0, 0)` runs before the first prefill
        and `on_segment(0, t)` after each decode segment (t ≥ 1: the longest sample's tokens
        among those that ran in it);
        `on_batch(k)` when k more prompts have all their samples. `progress` is unused."""
        del progress
        prompts = self.checked_prompts(prompts, params)
        ids = self.checked_ids(prompt_ids, len(prompts))
        n, max_new, count = params.n, params.max_new_tokens, len(prompts)
        width = self.bucket(max(map(len, prompts)))
        store_rows = max(1, min(count, math.ceil(self.refill_slots / n)))
        graphdef, state = nnx.split(self.model)
        layer_params = fused_layer_params(graphdef, state)
        vocab = int(getattr(self.model.config, "vocab_size", 0)) if return_logits else 0
        cache_dtype = self._cache_dtype()
        config = getattr(self.model, "config", None)
        if config is not None and hasattr(config, "num_kv_heads"):
            per_token = kv_bytes_per_token(config, cache_dtype.itemsize)
            self.kv_bytes_per_sequence = per_token * (width + max_new + store_rows * width
                                                      / self.slots)
        traced = dict(temperature=jnp.float32(params.temperature if not params.greedy else 1.0),
                      top_p=jnp.float32(params.top_p),
                      stop_ids=jnp.asarray(params.stop_token_ids or (-1,), jnp.int32))
        static = dict(program=Program.of(params), pad_token_id=self.pad_token_id,
                      return_logits=return_logits)
        widths = [width + end for end in window_ends(max_new, self.cache_windows)]
        carry = init_slots(self.model, slots=self.slots, cache_len=widths[0],
                           cache_dtype=cache_dtype, max_new=max_new, vocab=vocab,
                           pad_token_id=self.pad_token_id, key=key,
                           return_logits=return_logits)
        store = dict(cache=self.model.init_cache(store_rows, width, cache_dtype),
                     logits=jnp.zeros((store_rows, self.model.config.vocab_size), jnp.float32),
                     lengths=jnp.zeros((store_rows,), jnp.int32))
        host = dict(tokens=np.full((count * n, max_new), self.pad_token_id, np.int32),
                    logprobs=np.zeros((count * n, max_new), np.float32),
                    raw_logprobs=np.zeros((count * n, max_new), np.float32),
                    lengths=np.zeros(count * n, np.int32), stopped=np.zeros(count * n, bool))
        if return_logits:
            host["logits"] = np.zeros((count * n, max_new, vocab), np.float32)
        held = [-1] * store_rows  # the prompt in each store row (-1: none)
        given = [n] * store_rows  # how many of its samples have a slot
        done_per_prompt = np.zeros(count, np.int32)
        busy = np.zeros(self.slots, bool)
        slot_row = np.zeros(self.slots, np.int64)  # the output row of each slot's sample
        index = np.zeros(self.slots, np.int64)  # each slot's next cache slot (= position)
        next_prompt = 0
        longest = max_new if not params.stop_token_ids else (
            self.segment_steps or max(8, math.ceil(max_new / 8)))
        if on_segment is not None:
            on_segment(0, 0)
        while True:
            free = [int(s) for s in np.flatnonzero(~busy)]
            while free:
                pending = sum(n - g for g in given)
                empty = [r for r in range(store_rows) if given[r] >= n]
                if pending < len(free) and next_prompt < count and empty:
                    store = self._prefill(graphdef, state, layer_params, store, prompts,
                                          range(next_prompt, next_prompt + len(empty)),
                                          empty, width, held, given)
                    next_prompt = max(held) + 1
                    pending = sum(n - g for g in given)
                if pending == 0:
                    break
                plan = []  # (slot, store row, prompt, sample)
                for r in sorted(range(store_rows), key=lambda r: held[r]):
                    while given[r] < n and len(plan) < len(free):
                        plan.append((free[len(plan)], r, ids[held[r]], given[r]))
                        given[r] += 1
                carry = self._assign(carry, store, plan, key, traced, static)
                for slot_index, row, _, sample in plan:
                    slot_row[slot_index] = held[row] * n + sample
                    index[slot_index] = len(prompts[held[row]])
                busy[[p[0] for p in plan]] = True
                free = free[len(plan):]
            if not busy.any():
                break
            more = next_prompt < count or any(g < n for g in given)
            steps = longest if self.segment_s is None else min(longest, self._timed_steps)
            if not more and busy.sum() <= len(busy) // 2 and len(busy) > self.min_rows:
                keep = self._tail_rows(busy)  # the tail: fewer rows
                carry = select_slots(carry, jnp.asarray(keep, jnp.int32))
                busy, slot_row, index = busy[keep], slot_row[keep], index[keep]
            # The smallest cache window every running sample fits in for at least one step.
            top = int(index[busy].max())
            cache_len = next(w for w in widths if w > top)
            if cache_len != carry["state"]["cache"].max_len:
                carry = resize_slots(carry, cache_len)
            steps = min(steps, cache_len - top)
            start = time.perf_counter()
            carry = decode_slots(graphdef, state, layer_params, carry, jnp.int32(steps),
                                 jnp.int32(self.refill_slots if more else len(busy) + 1),
                                 **traced, **static)
            slot = {k: host_array(carry["state"][k])
                    for k in ("active", "t", "stopped", "position")}
            index = slot["position"].astype(np.int64)
            done = int(host_array(carry["steps"]))
            self.steps += done
            self.rows_decoded += len(busy) * done
            self.slots_attended += len(busy) * done * cache_len
            if self.segment_s is not None and done:
                rate = done / max(time.perf_counter() - start, 1e-6)
                self._timed_steps = max(1, int(self.segment_s * rate))
            longest_t = int(np.max(slot["t"], where=busy, initial=1))  # (busy is not empty)
            finished = np.flatnonzero(busy & ~slot["active"])
            if len(finished):
                out = {k: host_array(v) for k, v in carry["out"].items()}
                rows = slot_row[finished]
                for name, value in out.items():
                    host[name][rows] = value[finished]
                host["lengths"][rows] = slot["t"][finished]
                host["stopped"][rows] = slot["stopped"][finished]
                busy[finished] = False
                before = int(np.sum(done_per_prompt == n))
                np.add.at(done_per_prompt, rows // n, 1)
                if on_batch is not None and np.sum(done_per_prompt == n) > before:
                    on_batch(int(np.sum(done_per_prompt == n)) - before)
            if on_segment is not None:
                on_segment(0, longest_t)
        return GenerationOutput(
            prompt_index=np.repeat(np.arange(count), n), sample_index=np.tile(np.arange(n), count),
            tokens=host["tokens"], logprobs=host["logprobs"], raw_logprobs=host["raw_logprobs"],
            lengths=host["lengths"],
            finish_reason=np.where(host["stopped"], FINISH_STOP, FINISH_LENGTH),
            temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
            logits=host.get("logits"))

    def _tail_rows(self, busy: np.ndarray) -> np.ndarray:
        """The slots to keep once no work waits: the busy ones, padded with free ones to a
        power of two ≥ `min_rows` (few compiled sizes)."""
        size = max(self.min_rows, 1 << max(0, math.ceil(math.log2(busy.sum()))))
        return np.concatenate([np.flatnonzero(busy), np.flatnonzero(~busy)])[:size]

    def _prefill(self, graphdef, state, layer_params, store: dict, prompts: list[list[int]],
                 ids: range, rows: list[int], width: int, held: list[int],
                 given: list[int]) -> dict:
        """Prefill prompts `ids` (as many as fit) into store rows `rows`; updates held/given."""
        k = len(held)
        tokens = np.full((k, width), self.pad_token_id, np.int32)
        lengths = np.ones(k, np.int32)
        replace = np.zeros(k, bool)
        for row, index in zip(rows, ids):
            if index >= len(prompts):
                break
            tokens[row, :len(prompts[index])] = prompts[index]
            lengths[row] = len(prompts[index])
            replace[row] = True
            held[row], given[row] = index, 0
            self.prefilled_prompts += 1
        self.prefills += 1
        return prefill_store(graphdef, state, layer_params, store, jnp.asarray(tokens),
                             jnp.asarray(lengths), jnp.asarray(replace))

    def _assign(self, carry: dict, store: dict, plan: list[tuple[int, int, int, int]],
                key: Array, traced: dict, static: dict) -> dict:
        """Run `assign_slots` for `plan` padded to `slots` entries (slot index R: none)."""
        table = np.zeros((4, self.slots), np.int32)
        table[0] = self.slots
        table[:, :len(plan)] = np.asarray(plan, np.int32).T
        return assign_slots(carry, store, *(jnp.asarray(row) for row in table), key,
                            **traced, **static)
