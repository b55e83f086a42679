"""The compiled programs behind `sampling.continuous.ContinuousSampler`: a fixed number of
decode slots that are refilled as their samples finish.

* `prefill_store`: prefill K right-padded prompts (fixed shape [K, W]) into a prompt store
  (a K-row KV cache of W slots and each prompt's last logits).
* `assign_slots`: copy a store row into each slot that takes a (prompt i, sample j), reset the
  slot's cache row, and sample its first token from the stored logits with the sample's own
  key. A prompt is prefilled once; its n samples copy its keys and values into n slots.
* `decode_slots`: a `lax.while_loop` of decode steps over all slots, until a step count, until
  no slot runs, or until `refill_at` slots are free (then the driver refills them).

Every slot has its own cache write index and next position (the model's `KVCache.index` is
one scalar, so the decode step runs the model on each row with `jax.vmap`; the index becomes
a per-row scatter). Shapes are static per call: slots R, store rows K, prompt width W and
cache slots W + max_new_tokens; what changes per step is data. A sample's noise depends only
on (key, i, j, t) (`decode_program.sample_key`), so its tokens and log-probs do not depend
on the slot it lands in nor on what the other slots decode.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_llm.models.decoder import KVCache
from jaxrl_llm.sampling.decode_program import (
    Program,
    _last_logits,
    _layer_kwargs,
    _map_rows,
    _map_slots,
    sample_key,
    sample_step,
)

Array = jax.Array
_STATIC = ("graphdef", "program", "pad_token_id", "return_logits")


def _row_axes(cache: KVCache) -> KVCache:
    """vmap axes of the row of every cache buffer (`decode_program._map_rows`' axes)."""
    return KVCache(k=jax.tree.map(lambda a: a.ndim - 4, cache.k),
                   v=jax.tree.map(lambda a: a.ndim - 4, cache.v),
                   segment_ids=0, positions=0, index=0, lengths=0)


def _one_row(cache: KVCache) -> KVCache:
    """Inside the vmap: a one-row cache (the row axis put back, a scalar write index)."""
    add = lambda a: jnp.expand_dims(a, a.ndim - 3)
    return cache.replace(k=jax.tree.map(add, cache.k), v=jax.tree.map(add, cache.v),
                         segment_ids=cache.segment_ids[None], positions=cache.positions[None],
                         lengths=cache.lengths[None])


def _drop_row(cache: KVCache) -> KVCache:
    take = lambda a: jnp.squeeze(a, a.ndim - 4)
    return cache.replace(k=jax.tree.map(take, cache.k), v=jax.tree.map(take, cache.v),
                         segment_ids=cache.segment_ids[0], positions=cache.positions[0],
                         lengths=cache.lengths[0])


def forward_rows(model: Any, layer_params: Any, tokens: Array, positions: Array,
                 cache: KVCache) -> tuple[Array, KVCache]:
    """The model on tokens [R, T] at `positions` [R, T], each row writing its own cache row at
    its own `cache.index[row]` (index [R]). Returns hidden [R, T, d] and the cache."""
    kwargs = _layer_kwargs(layer_params)

    def one(tok, pos, row_cache):
        hidden, row_cache = model(tok[None], positions=pos[None], cache=_one_row(row_cache),
                                  **kwargs)
        return hidden[0], _drop_row(row_cache)

    axes = _row_axes(cache)
    return jax.vmap(one, in_axes=(0, 0, axes), out_axes=(0, axes))(tokens, positions, cache)


def init_slots(model: Any, *, slots: int, cache_len: int, cache_dtype: Any, max_new: int,
               vocab: int, pad_token_id: int, key: Array, return_logits: bool) -> dict:
    """Empty slots: every slot free (`active` False)."""
    cache = model.init_cache(slots, cache_len, cache_dtype)
    cache = cache.replace(index=jnp.zeros((slots,), jnp.int32))
    zeros = lambda dtype=jnp.int32: jnp.zeros((slots,), dtype)  # distinct buffers (donated)
    state = dict(cache=cache, last=zeros(), position=zeros(), t=zeros(), prompt=zeros() - 1,
                 sample=zeros(), active=zeros(bool), stopped=zeros(bool),
                 row_keys=sample_key(key, zeros(), zeros()))
    out = dict(tokens=jnp.full((slots, max_new), pad_token_id, jnp.int32),
               logprobs=jnp.zeros((slots, max_new), jnp.float32),
               raw_logprobs=jnp.zeros((slots, max_new), jnp.float32))
    if return_logits:
        out["logits"] = jnp.zeros((slots, max_new, vocab), jnp.float32)
    return dict(state=state, out=out, steps=jnp.int32(0))


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("store",))
def prefill_store(graphdef, state, layer_params: Any, store: dict, tokens: Array,
                  lengths: Array, replace: Array) -> dict:
    """Prefill right-padded prompts tokens [K, W] (lengths [K]) into the store rows where
    `replace` [K] is set. store: cache (K rows × W slots), logits [K, V], lengths [K]."""
    model = nnx.merge(graphdef, state)
    k, width = tokens.shape
    slot = jnp.arange(width, dtype=jnp.int32)[None, :]
    mask = (slot < lengths[:, None]).astype(jnp.int32)
    old = store["cache"]
    fresh = model.init_cache(k, width, jax.tree.leaves(old.v)[0].dtype)
    hidden, fresh = model(tokens, positions=jnp.broadcast_to(slot, (k, width)),
                          segment_ids=mask, cache=fresh, **_layer_kwargs(layer_params))
    last = jnp.take_along_axis(hidden, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)
    logits = _last_logits(model, last)
    pick = lambda new, prev, axis: jnp.where(
        replace.reshape((1,) * axis + (k,) + (1,) * (new.ndim - axis - 1)), new, prev)
    cache = jax.tree.map(lambda n_, o_: pick(n_, o_, n_.ndim - 4), fresh.k, old.k)
    cache_v = jax.tree.map(lambda n_, o_: pick(n_, o_, n_.ndim - 4), fresh.v, old.v)
    return dict(cache=old.replace(k=cache, v=cache_v,
                                  segment_ids=pick(fresh.segment_ids, old.segment_ids, 0),
                                  positions=pick(fresh.positions, old.positions, 0)),
                logits=pick(logits, store["logits"], 0),
                lengths=jnp.where(replace, lengths, store["lengths"]))


def _put_rows(dst: Array, src: Array, rows: Array, axis: int) -> Array:
    """dst with rows `rows` [M] along `axis` set to src (whose slot axes may be shorter: the
    rest of those rows is zeroed); rows out of range are dropped."""
    dst_m = jnp.moveaxis(dst, axis, 0)
    src_m = jnp.moveaxis(src, axis, 0).astype(dst.dtype)
    src_m = jnp.pad(src_m, [(0, 0)] + [(0, d - s) for d, s in zip(dst_m.shape[1:],
                                                                    src_m.shape[1:])])
    return jnp.moveaxis(dst_m.at[rows].set(src_m, mode="drop"), 0, axis)


def _first_column(value: Array, fill: Any = 0, *, max_new: int) -> Array:
    """[M, max_new, ...] of `fill` with column 0 set to value [M, ...]."""
    buf = jnp.full((value.shape[0], max_new) + value.shape[1:], fill, value.dtype)
    return buf.at[:, 0].set(value)


@functools.partial(jax.jit, static_argnames=_STATIC[1:], donate_argnames=("carry",))
def assign_slots(carry: dict, store: dict, slots: Array, rows: Array, prompt_ids: Array,
                 sample_ids: Array, key: Array, temperature: Array, top_p: Array,
                 stop_ids: Array, *, program: Program, pad_token_id: int,
                 return_logits: bool) -> dict:
    """Slot `slots[m]` takes sample `sample_ids[m]` of prompt `prompt_ids[m]`, whose prompt is
    store row `rows[m]` (m < M; a slot index ≥ R is no assignment). Its first token is drawn
    from the stored logits at completion position 0."""
    state, out = carry["state"], carry["out"]
    src, cache = store["cache"], state["cache"]
    take = lambda a, axis: jnp.take(a, rows, axis=axis)
    put = lambda dst, s, axis: _put_rows(dst, take(s, axis), slots, axis)
    cache = cache.replace(
        k=jax.tree.map(lambda d, s: put(d, s, d.ndim - 4), cache.k, src.k),
        v=jax.tree.map(lambda d, s: put(d, s, d.ndim - 4), cache.v, src.v),
        segment_ids=put(cache.segment_ids, src.segment_ids, 0),
        positions=put(cache.positions, src.positions, 0),
        index=put(cache.index, store["lengths"], 0),
        lengths=put(cache.lengths, store["lengths"], 0))
    logits = take(store["logits"], 0)
    row_keys = sample_key(key, prompt_ids, sample_ids)
    token, lp, raw_lp = sample_step(row_keys, jnp.zeros_like(prompt_ids), logits, temperature,
                                    top_p, greedy=program.greedy, top_k=program.top_k,
                                    use_top_p=program.use_top_p)
    stop = jnp.isin(token, stop_ids)
    set_ = lambda dst, value: dst.at[slots].set(value, mode="drop")
    first = functools.partial(_first_column, max_new=program.max_new_tokens)
    out = dict(out, tokens=set_(out["tokens"], first(token, pad_token_id)),
               logprobs=set_(out["logprobs"], first(lp)),
               raw_logprobs=set_(out["raw_logprobs"], first(raw_lp)))
    if return_logits:
        out["logits"] = set_(out["logits"], first(logits))
    state = dict(state, cache=cache, last=set_(state["last"], token),
                 position=set_(state["position"], take(store["lengths"], 0)),
                 t=set_(state["t"], jnp.ones_like(token)), prompt=set_(state["prompt"], prompt_ids),
                 sample=set_(state["sample"], sample_ids),
                 active=set_(state["active"], ~stop & (program.max_new_tokens > 1)),
                 stopped=set_(state["stopped"], stop), row_keys=set_(state["row_keys"], row_keys))
    return dict(carry, state=state, out=out)


@functools.partial(jax.jit, static_argnames=("graphdef", *_STATIC),
                   donate_argnames=("carry",))
def decode_slots(graphdef, state, layer_params: Any, carry: dict, steps: Array,
                 refill_at: Array, temperature: Array, top_p: Array, stop_ids: Array, *,
                 program: Program, pad_token_id: int, return_logits: bool) -> dict:
    """Up to `steps` decode steps of every slot; stops early when no slot runs or when
    `refill_at` slots or more are free. A slot ends after a stop token or max_new_tokens."""
    model = nnx.merge(graphdef, state)
    max_new = program.max_new_tokens
    sample = functools.partial(sample_step, greedy=program.greedy, top_k=program.top_k,
                               use_top_p=program.use_top_p)

    def cond(loop):
        i, slot, _ = loop
        free = jnp.sum(~slot["active"])
        return (i < steps) & jnp.any(slot["active"]) & (free < refill_at)

    def body(loop):
        i, slot, out = loop
        active = slot["active"]
        cache = slot["cache"]
        hidden, new_cache = forward_rows(model, layer_params, slot["last"][:, None],
                                         slot["position"][:, None], cache)
        # A free slot's write is harmless (assignment rewrites its whole row); keep its index.
        new_cache = new_cache.replace(index=jnp.where(active, new_cache.index, cache.index))
        logits = _last_logits(model, hidden)
        t = slot["t"]
        token, lp, raw_lp = sample(slot["row_keys"], t, logits, temperature, top_p)
        token = jnp.where(active, token, pad_token_id)
        rows = jnp.arange(token.shape[0])
        col = jnp.where(active, t, max_new)  # out of range: dropped
        put = lambda buf, value: buf.at[rows, col].set(value.astype(buf.dtype), mode="drop")
        out = dict(out, tokens=put(out["tokens"], token), logprobs=put(out["logprobs"], lp),
                   raw_logprobs=put(out["raw_logprobs"], raw_lp))
        if return_logits:
            out["logits"] = put(out["logits"], logits)
        stop = active & jnp.isin(token, stop_ids)
        t = t + active.astype(jnp.int32)
        slot = dict(slot, cache=new_cache, last=token, t=t,
                    position=slot["position"] + active.astype(jnp.int32),
                    active=active & ~stop & (t < max_new), stopped=slot["stopped"] | stop)
        return i + 1, slot, out

    steps, slot, out = jax.lax.while_loop(cond, body,
                                          (jnp.int32(0), carry["state"], carry["out"]))
    return dict(state=slot, out=out, steps=steps)


@functools.partial(jax.jit, static_argnames=("width",))  # new shapes: nothing to donate
def resize_slots(carry: dict, width: int) -> dict:
    """The carry with its cache cut or padded to `width` slots per row. Cutting drops only
    slots no running sample has reached (the driver's rule); a free row is rewritten whole
    when it is assigned, and empty slots (segment id 0) are never attended to."""
    cache = carry["state"]["cache"]
    extra = width - cache.max_len
    fit = lambda a, axis: (jax.lax.slice_in_dim(a, 0, width, axis=axis) if extra < 0 else
                           jnp.pad(a, [(0, extra if i == axis else 0) for i in range(a.ndim)]))
    return dict(carry, state=dict(carry["state"], cache=_map_slots(cache, fit)))


@jax.jit
def select_slots(carry: dict, rows: Array) -> dict:
    """Keep slots `rows` [R'] of every per-slot buffer (cache, state, outputs)."""
    take = lambda a, axis=0: jnp.take(a, rows, axis=axis)
    state = carry["state"]
    cache = _map_rows(state["cache"], take).replace(index=take(state["cache"].index))
    state = {name: cache if name == "cache" else take(value) for name, value in state.items()}
    return dict(carry, state=state, out={name: take(buf) for name, buf in carry["out"].items()})
