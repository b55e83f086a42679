"""Continuous batching: a fixed number of decode slots, each refilled with the next
(prompt, sample) as soon as its sample ends (`slot_program.py` holds the compiled programs),
over a shared prompt cache (`prompt_cache.py`).

`ContinuousSampler(model, slots=R).generate(prompts, params, key)` returns the same
`GenerationOutput` as the static `Sampler` (rows prompt-major, tokens / logprobs /
raw_logprobs / lengths / finish_reason with the same meaning), and the same samples up to
float rounding: the noise of token t of sample j of prompt i is keyed by (key, i, j, t) alone.

The loop, on the host: P prompts at a time are staged and prefilled in chunks of C tokens
(`prefill_chunk`), one chunk per decode step while other slots decode (all at once when no slot
runs); a prefilled prompt moves into a free row of the K-row prompt store, where it stays until
its n samples have ended. Each free slot takes the next sample of a stored prompt (a slot holds
only its generated tokens' keys and values, and reads its prompt's from the store: the KV bytes
per concurrent sequence are max_new_tokens + (K + P)·W / R slots instead of W + max_new_tokens,
`kv_bytes_per_sequence`). The slots decode until `refill_slots` of them are free and the staged
prompts are ready (or the segment's steps are done); finished samples are collected and the
slots refilled. Each slot's generated cache is cut to the narrowest of a few windows
(`window_ends`) that holds the longest running sample, and once no work waits the slots still
running are gathered into fewer rows (`select_slots`), as the static sampler drops finished
rows. Decode never waits for the longest sample of a batch nor for a whole prompt's prefill.

In-flight weight updates (`generate(..., weights=hook)`, PipelineRL, arXiv:2509.19128): before
each decode segment the hook may hand newer weights, and the segment runs on them; keys and
values already cached stay as the older weights computed them. Every token's log-prob is that of
the distribution that sampled it (the new weights over that cache), and
`GenerationOutput.versions` says which weights sampled each token (a sample's first token: the
weights that finished its prompt's prefill).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxrl_llm.parallel.distributed import host_array
from jaxrl_llm.sampling.decode_program import Program, fused_layer_params
from jaxrl_llm.sampling.layout import DecodeLayout, check_slots, from_model, sampling_dtype
from jaxrl_llm.sampling.prompt_cache import (
    init_staging,
    init_store,
    kv_bytes_per_sequence,
)
from jaxrl_llm.sampling.routing import check_routing_model, routing_buffer
from jaxrl_llm.sampling.sampler import (
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationOutput,
    Sampler,
    SamplingParams,
    window_ends,
)
from jaxrl_llm.sampling.schedule import (
    assignments,
    commit_rows,
    default_prompt_rows,
    staging_rows,
    tail_rows,
)
from jaxrl_llm.sampling.slot_program import (
    assign_slots,
    commit_staging,
    decode_slots,
    init_slots,
    prefill_staging,
    resize_slots,
    resume_slots,
    select_slots,
)
from jaxrl_llm.sampling.turns import ParkedSlots, TurnHook

Array = jax.Array


class ContinuousSampler(Sampler):
    """`slots` concurrent sequences (compile-time), refilled as they finish.

    batch_size: prompts per chunk for callers that feed the sampler in chunks (`generate`'s
        `chunk_prompts` default) and for progress counts; default `slots`.
    refill_slots: the decode loop returns to refill once this many slots are free (default
        slots / 4); ceil(refill_slots / n) prompts are staged (prefilled) at a time.
    prefill_chunk: tokens per prefill chunk (one chunk per decode step; the prompt width is
        rounded up to a multiple); None: the whole prompt width in one chunk.
    prompt_rows: rows of the shared prompt store (default `default_prompt_rows`): a prompt
        holds one from its prefill until its n samples have ended; a slot waits when none is free.
    segment_steps / segment_s: as `Sampler` (how often `on_segment` runs at most).
    cache_windows: each slot's generated cache is e slots wide for e in `window_ends`
        (max_new_tokens, cache_windows): each segment runs on the narrowest that holds every
        running sample's next token.
    min_rows: once no work waits and at most half the slots run, only the running ones go on
        (a power of two ≥ min_rows of them), as `Sampler` drops finished rows.
    decode_layout: where slots, prompt store, staging rows and weights live
        (`layout.DecodeLayout`; default `layout.from_model`: derived from the weights' mesh).
        The slots, store rows and staged prompts split into its `groups` (slot parallelism),
        each group's slots reading only its own store rows (`schedule.py`); `slots` must be a
        multiple of the groups, and each group gets the per-group share of the sizes below.
    """

    def __init__(self, model: Any, *, slots: int, pad_token_id: int = 0,
                 batch_size: int | None = None, refill_slots: int | None = None,
                 prefill_chunk: int | None = None, prompt_rows: int | None = None,
                 prompt_buckets: Sequence[int] | None = None, cache_dtype: Any = None,
                 segment_steps: int | None = None, segment_s: float | None = None,
                 cache_windows: int = 4, min_rows: int = 4,
                 decode_layout: DecodeLayout | None = None):
        if slots < 1:
            raise ValueError(f"slots={slots} must be >= 1")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk={prefill_chunk} must be >= 1 (or None: whole "
                             "prompts)")
        super().__init__(model, pad_token_id=pad_token_id, batch_size=batch_size or slots,
                         prompt_buckets=prompt_buckets, cache_dtype=cache_dtype,
                         segment_steps=segment_steps, segment_s=segment_s,
                         cache_windows=cache_windows, min_rows=min_rows)
        self.slots = int(slots)
        self.decode_layout = decode_layout or from_model(model)
        check_slots(self.decode_layout, self.slots, key="slots")
        self.refill_slots = int(refill_slots or max(1, slots // 4))
        if not 1 <= self.refill_slots <= self.slots:
            raise ValueError(f"refill_slots={refill_slots} must be in [1, slots={slots}]")
        self.prefill_chunk = prefill_chunk
        self.prompt_rows = prompt_rows
        # Diagnostics: prefill jobs, prompts prefilled, prefill chunks run beside decode
        # steps, decode steps run; KV bytes per concurrent sequence (shared, and copied).
        self.prefills = self.prefilled_prompts = self.overlapped_chunks = self.steps = 0
        self.kv_bytes_per_sequence = self.kv_bytes_per_sequence_copied = 0.0

    def layout(self, prompts: Sequence[Sequence[int]], n: int) -> dict[str, int]:
        """The compile-time sizes for prompts: width W (a multiple of the chunk C), staged
        prompts P, store rows K."""
        width = self.bucket(max(map(len, prompts)))
        chunk = min(self.prefill_chunk or width, width)
        groups = self.decode_layout.groups  # the sizes below are per group, then × groups
        staging = max(1, math.ceil(math.ceil(self.refill_slots / groups) / n))
        rows = (math.ceil(self.prompt_rows / groups) if self.prompt_rows else
                default_prompt_rows(self.slots // groups, n, staging))
        if rows < staging:
            raise ValueError(f"prompt_rows={rows * groups} must be >= the {staging * groups} "
                             "prompts staged at a time (ceil(refill_slots / n))")
        return dict(width=-(-width // chunk) * chunk, chunk=chunk, staging=staging * groups,
                    rows=rows * groups)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, key: Array,
                 *, progress: bool = False, return_logits: bool = False,
                 on_batch: Callable[[int], None] | None = None,
                 on_segment: Callable[[int, int], None] | None = None,
                 prompt_ids: Sequence[int] | None = None,
                 weights: Callable[[], tuple[int, Any] | None] | None = None,
                 version: int = 0, turns: TurnHook | None = None,
                 return_routing: bool = False) -> GenerationOutput:
        """`Sampler.generate`'s contract. `on_segment(0, 0)` runs before the first prefill
        and `on_segment(0, t)` after each decode segment (t ≥ 1: the longest sample's tokens
        among those that ran in it);
        `on_batch(k)` when k more prompts have all their samples. `progress` is unused.
        `weights`: called before each decode segment; None, or (v, state) to decode from then on
        with `state` (an `nnx.split` state of the same model, e.g. a newer version v of its
        weights); `version`: the version of the model's own weights. With a hook the output's
        `versions` holds each token's version. `turns`: multi-turn episodes (`turns.py`): a
        sample that ends a turn is parked until `turns` answers, then resumes with the
        environment's tokens fed into its cache; the output's `action_mask` marks them 0.
        `return_routing` (a mixture of experts): the output's `routing` holds each fed token's
        experts (`sampling/routing.py`), an environment's tokens included."""
        del progress
        if return_routing:
            check_routing_model(self.model)
        prompts = self.checked_prompts(prompts, params)
        ids = self.checked_ids(prompt_ids, len(prompts))
        n, max_new, count = params.n, params.max_new_tokens, len(prompts)
        size = self.layout(prompts, n)
        width, k_rows, p_rows = size["width"], size["rows"], size["staging"]
        lay = self.decode_layout
        graphdef, state = nnx.split(self.model)
        # The weights in the decode layout and the sampling dtype (one copy).
        state = lay.place_state(state, sampling_dtype(self.model))
        layer_params = self._layer_params(graphdef, state)
        vocab = int(getattr(self.model.config, "vocab_size", 0)) if return_logits else 0
        cache_dtype = self._cache_dtype()
        figure = dict(itemsize=cache_dtype.itemsize, prompt_width=width, max_new_tokens=max_new,
                      slots=self.slots, prompt_rows=k_rows, staging_rows=p_rows)
        self.kv_bytes_per_sequence = kv_bytes_per_sequence(self.model.config, **figure)
        self.kv_bytes_per_sequence_copied = kv_bytes_per_sequence(self.model.config, **figure,
                                                                  shared=False)
        traced = dict(temperature=np.float32(params.temperature if not params.greedy else 1.0),
                      top_p=np.float32(params.top_p),
                      stop_ids=np.asarray(tuple(params.stop_token_ids) + tuple(
                          turns.stop_ids if turns is not None else ()) or (-1,), np.int32))
        static = dict(program=Program.of(params, routing=return_routing),
                      pad_token_id=self.pad_token_id, return_logits=return_logits)
        ends = window_ends(max_new, self.cache_windows)
        carry = lay.make(lambda key: init_slots(
            self.model, slots=self.slots, gen_len=ends[0], cache_dtype=cache_dtype,
            max_new=max_new, vocab=vocab, pad_token_id=self.pad_token_id, key=key,
            return_logits=return_logits, routing=return_routing,
            staging=init_staging(self.model, p_rows, width, cache_dtype)), key)
        store = lay.make(lambda: init_store(self.model, k_rows, width, cache_dtype))
        static["layout"] = lay
        host = dict(tokens=np.full((count * n, max_new), self.pad_token_id, np.int32),
                    versions=np.full((count * n, max_new), version, np.int64),
                    logprobs=np.zeros((count * n, max_new), np.float32),
                    raw_logprobs=np.zeros((count * n, max_new), np.float32),
                    lengths=np.zeros(count * n, np.int32), stopped=np.zeros(count * n, bool))
        if return_logits:
            host["logits"] = np.zeros((count * n, max_new, vocab), np.float32)
        if return_routing:
            host["routing"] = np.array(routing_buffer(self.model.config, count * n, max_new))
        parked = ParkedSlots(self.slots, max_new) if turns is not None else None
        if parked is not None:
            host["action_mask"] = np.ones((count * n, max_new), np.uint8)
        held = [-1] * k_rows  # the prompt in each store row (-1: none)
        given = [n] * k_rows  # how many of its samples have had a slot
        staged: dict[int, int] = {}  # the prompt in each used staging row
        ready = True  # the staged prompts are prefilled
        done_per_prompt = np.zeros(count, np.int32)
        busy = np.zeros(self.slots, bool)
        slot_row = np.zeros(self.slots, np.int64)  # the output row of each slot's sample
        t_now = np.zeros(self.slots, np.int64)  # each slot's generated tokens
        # the version of the weights that sampled each slot's tokens; of each stored prompt's
        # prefill (its first token's); of the staged prompts' prefill
        slot_versions = np.full((self.slots, max_new), version, np.int64)
        row_version = [version] * k_rows
        staged_version = version
        next_prompt = 0
        longest = max_new if not (params.stop_token_ids or turns) else (
            self.segment_steps or max(8, math.ceil(max_new / 8)))
        if on_segment is not None:
            on_segment(0, 0)

        def collect(finished: np.ndarray) -> None:
            """Slots `finished` hold ended samples: copy them out and free the slots."""
            out = {name: host_array(v) for name, v in carry["out"].items()}
            stopped = host_array(carry["state"]["stopped"])
            rows = slot_row[finished]
            for name, value in out.items():
                host[name][rows] = value[finished]
            host["lengths"][rows] = t_now[finished]
            host["versions"][rows] = slot_versions[finished]
            host["stopped"][rows] = stopped[finished]
            if parked is not None:
                for slot_index, row in zip(finished, rows, strict=True):
                    host["action_mask"][row, :t_now[slot_index]] = parked.action_mask(
                        slot_index, int(t_now[slot_index]))
            busy[finished] = False
            before = int(np.sum(done_per_prompt == n))
            np.add.at(done_per_prompt, rows // n, 1)
            if on_batch is not None and np.sum(done_per_prompt == n) > before:
                on_batch(int(np.sum(done_per_prompt == n)) - before)

        def answer(answers: list[tuple[int, list[int] | None]]) -> dict:
            """Resume the parked slots whose environment answered; collect ended episodes."""
            over = np.asarray([s for s, ids in answers if ids is None], np.int64)
            if len(over):
                collect(over)
            go = [s for s, ids in answers if ids is not None]
            for s, ids in answers:
                if ids is not None:
                    parked.feed_observation(s, int(t_now[s]), ids)
            if not go:
                return carry
            take = np.zeros(len(busy), bool)
            take[go] = True
            return resume_slots(carry, lay.put(take), lay.put(parked.feed), layout=lay)

        while True:
            if parked is not None and len(parked):
                carry = answer(parked.answered(block=False))
            for r in range(k_rows):  # a prompt whose samples have all ended frees its row
                if held[r] >= 0 and done_per_prompt[held[r]] == n:
                    held[r] = -1
            if staged and ready:
                free_rows = commit_rows(held, staged, staging=p_rows, groups=lay.groups)
                if free_rows is not None:
                    dest = np.full(p_rows, k_rows, np.int32)
                    dest[list(staged)] = free_rows
                    store = commit_staging(store, carry["staging"], lay.put(dest), layout=lay)
                    for r, prompt in zip(free_rows, staged.values()):
                        held[r], given[r], row_version[r] = prompt, 0, staged_version
                    staged = {}
            if not staged and next_prompt < count:
                new = range(next_prompt, min(count, next_prompt + p_rows))
                staged = dict(zip(staging_rows(len(new), p_rows, lay.groups), new))
                next_prompt += len(staged)
                carry = self._stage(carry, prompts, staged, size)
                ready = False
            plan = [(slot_index, r, int(ids[held[r]]), sample) for slot_index, r, sample
                    in assignments(busy, held, given, n, lay.groups)]
            if plan:
                carry = self._assign(carry, store, plan, key, traced, static, len(busy))
                for slot_index, r, _, sample in plan:
                    if parked is not None:
                        parked.assigned(slot_index)
                    slot_row[slot_index] = held[r] * n + sample
                    t_now[slot_index] = 1
                    slot_versions[slot_index, 0] = row_version[r]
                busy[[p[0] for p in plan]] = True
            if weights is not None and (newer := weights()) is not None:
                version, state = newer  # PipelineRL's in-flight update (module docstring)
                state = lay.place_state(state, sampling_dtype(self.model))
                layer_params = self._layer_params(graphdef, state)
            running = busy & ~parked.parked(len(busy)) if parked is not None else busy
            if not running.any():
                if staged and not ready:  # nothing decodes: the whole prefill now
                    carry = dict(carry, staging=prefill_staging(
                        graphdef, state, layer_params, carry["staging"], chunk=size["chunk"],
                        layout=lay))
                    ready, staged_version = True, version
                    continue
                if parked is not None and len(parked):  # only environments are working
                    carry = answer(parked.answered(block=True))
                    continue
                if staged:  # every row is free when no slot runs
                    raise RuntimeError("continuous sampler: staged prompts found no store row")
                break
            more = bool(staged) or any(g < n for g, h in zip(given, held) if h >= 0)
            steps = longest if self.segment_s is None else min(longest, self._timed_steps)
            if not more and busy.sum() <= len(busy) // 2 and len(busy) > self.min_rows:
                keep = tail_rows(busy, lay.groups, self.min_rows)  # the tail: fewer rows
                carry = select_slots(carry, lay.put(keep.astype(np.int32)), layout=lay)
                if parked is not None:
                    parked.keep(keep)
                busy, slot_row, t_now = busy[keep], slot_row[keep], t_now[keep]
                running = running[keep]
                slot_versions = slot_versions[keep]
            # The smallest window every running sample's next write (slot t - 1) fits in.
            top = int(t_now[busy].max())
            gen_len = next(e for e in ends if e >= top)
            if gen_len != jax.tree.leaves(carry["state"]["own"]["v"])[0].shape[-2]:
                carry = resize_slots(carry, gen_len, layout=lay)
            steps = min(steps, gen_len - top + 1)
            chunks_before = int(host_array(carry["staging"]["chunk"]))
            start = time.perf_counter()
            # episodes: back to the host as soon as one more slot stops (a turn's end goes to
            # its environment at once); else when `refill_slots` more are free to refill
            refill_at = (int((~running).sum()) + 1 if parked is not None else
                         self.refill_slots if more else len(busy) + 1)
            carry = decode_slots(graphdef, state, layer_params, carry, store, np.int32(steps),
                                 np.int32(refill_at),
                                 **traced, **static, chunk=size["chunk"])
            slot = {name: host_array(carry["state"][name]) for name in ("active", "t", "stopped")}
            chunk_now, chunks = (int(host_array(carry["staging"][f])) for f in ("chunk", "chunks"))
            self.overlapped_chunks += chunk_now - chunks_before
            if not ready and chunk_now >= chunks:
                staged_version = version  # its last chunk (the first token's logits) ran now
            ready = chunk_now >= chunks
            t_new = slot["t"].astype(np.int64)
            if weights is not None:  # without a hook every token is `version`'s
                for i in np.flatnonzero(busy & (t_new > t_now)):
                    slot_versions[i, t_now[i]:t_new[i]] = version
            t_now = t_new
            done = int(host_array(carry["steps"]))
            self.steps += done
            self.rows_decoded += len(busy) * done
            self.slots_attended += len(busy) * done * (width + gen_len)
            if self.segment_s is not None and done:
                rate = done / max(time.perf_counter() - start, 1e-6)
                self._timed_steps = max(1, int(self.segment_s * rate))
            longest_t = int(np.max(slot["t"], where=busy, initial=1))  # (busy is not empty)
            finished = np.flatnonzero(running & ~slot["active"])
            if len(finished) and parked is not None:  # a turn ended: its environment answers
                tokens, logprobs = (host_array(carry["out"][f]) for f in ("tokens", "logprobs"))
                for s in finished:
                    parked.park(turns, int(s), int(slot_row[s]), tokens[s], logprobs[s],
                                int(t_now[s]), bool(slot["stopped"][s]))
            elif len(finished):
                collect(finished)
            if on_segment is not None:
                on_segment(0, longest_t)
        return GenerationOutput(
            prompt_index=np.repeat(np.arange(count), n), sample_index=np.tile(np.arange(n), count),
            tokens=host["tokens"], logprobs=host["logprobs"], raw_logprobs=host["raw_logprobs"],
            lengths=host["lengths"],
            finish_reason=np.where(host["stopped"], FINISH_STOP, FINISH_LENGTH),
            temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
            logits=host.get("logits"), versions=host["versions"] if weights is not None else None,
            action_mask=host.get("action_mask"), routing=host.get("routing"))

    def _layer_params(self, graphdef: Any, state: Any) -> Any:
        """The decode copy of the layer weights (`fused_layer_params`); unfused under tensor
        parallelism, where concatenating head-split projections would scatter each shard's
        columns (the model then reads its own per-layer params)."""
        return None if self.decode_layout.tensor > 1 else fused_layer_params(graphdef, state)

    def _stage(self, carry: dict, prompts: list[list[int]], staged: dict[int, int],
               size: dict[str, int]) -> dict:
        """Put prompts `staged` (staging row → prompt; right-padded) in the staging area, its
        chunks to run: as many as its longest prompt needs."""
        staging = carry["staging"]
        rows, width = staging["tokens"].shape
        tokens = np.full((rows, width), self.pad_token_id, np.int32)
        lengths = np.ones(rows, np.int32)
        for row, index in staged.items():
            tokens[row, :len(prompts[index])] = prompts[index]
            lengths[row] = len(prompts[index])
        self.prefills += 1
        self.prefilled_prompts += len(staged)
        chunks = -(-int(lengths.max()) // size["chunk"])
        put = self.decode_layout.put
        return dict(carry, staging=dict(staging, tokens=put(tokens), lengths=put(lengths),
                                        chunk=put(np.int32(0)), chunks=put(np.int32(chunks))))

    def _assign(self, carry: dict, store: dict, plan: list[tuple[int, int, int, int]],
                key: Array, traced: dict, static: dict, slots: int) -> dict:
        """Run `assign_slots` for `plan` [(slot, store row, prompt id, sample)]: a table of one
        entry per slot (a slot without one keeps its state; its row is its group's first)."""
        groups = self.decode_layout.groups
        k_rows = store["lengths"].shape[0]
        table = np.zeros((4, slots), np.int32)
        table[1] = np.arange(slots) // (slots // groups) * (k_rows // groups)
        for slot_index, row, prompt, sample in plan:
            table[:, slot_index] = (1, row, prompt, sample)
        put = self.decode_layout.put
        return assign_slots(carry, store, put(table[0].astype(bool)),
                            *(put(row) for row in table[1:]), key, **traced, **static)
