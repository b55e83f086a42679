"""The compiled programs behind `sampling.continuous.ContinuousSampler`: a fixed number of
decode slots that are refilled as their samples finish, over a shared prompt cache
(`prompt_cache.py`: a prompt's keys and values are stored once for its n samples).

* `prefill_staging`: run the chunks left of the staged prompts (`prompt_cache.prefill_chunk`)
  when no slot is decoding; otherwise `decode_slots` runs one chunk per decode step.
* `commit_staging`: copy the prefilled staged prompts into free rows of the prompt store.
* `assign_slots`: slot s takes (prompt i, sample j) whose prompt is store row r: it records r
  and draws its first token from the stored logits with the sample's own key. Nothing is
  copied: its generated slots start empty (`t` = 1: the first token is not yet in the cache).
* `decode_slots`: a `lax.while_loop` of decode steps over all slots (and of prefill chunks),
  until a step count, until no slot runs, or until `refill_at` slots are free and the staged
  prompts are ready (then the driver refills them). It runs at least one step.
* `resume_slots`: multi-turn episodes (`turns.py`): a slot parked at a turn boundary runs
  again, its `feed` row holding the environment's tokens at the completion positions they
  take. A fed position is written to the cache like a sampled token (the next step reads it)
  but is not sampled (log-prob 0, never a stop): the observation is prefilled into the slot's
  own cache token by token while the other slots decode, and nothing is recomputed.

Shapes are static per call: slots R, store rows K, staged prompts P, prompt width W (a
multiple of the chunk), generated slots G; what changes per step is data. A sample's noise
depends only on (key, i, j, t) (`decode_program.sample_key`), and a slot's attention reads only
its store row and its own slots, so its tokens and log-probs do not depend on the slot it
lands in nor on what the other slots decode.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_llm.sampling.decode_program import Program, _last_logits, sample_key, sample_step
from jaxrl_llm.sampling.layout import DecodeLayout
from jaxrl_llm.sampling.prompt_cache import prefill_chunk, slot_forward
from jaxrl_llm.sampling.routing import routing_buffer, step_routing

Array = jax.Array
_STATIC = ("graphdef", "program", "pad_token_id", "return_logits")
UNPLACED = DecodeLayout()


def _own_map(own: dict, fn) -> dict:
    """`fn(array, slot axis, row axis)` on each generated-slot buffer (`KVCache` layouts)."""
    return dict(k=jax.tree.map(lambda a: fn(a, a.ndim - 1, a.ndim - 4), own["k"]),
                v=jax.tree.map(lambda a: fn(a, a.ndim - 2, a.ndim - 4), own["v"]))


def init_slots(model: Any, *, slots: int, gen_len: int, cache_dtype: Any, max_new: int,
               vocab: int, pad_token_id: int, key: Array, return_logits: bool,
               staging: dict, routing: bool = False) -> dict:
    """Empty slots (every slot free: `active` False), G = gen_len generated slots each, and
    the staging area `staging` (`prompt_cache.init_staging`); `routing`: a buffer for each
    generated token's experts (`sampling/routing.py`)."""
    cache = model.init_cache(slots, gen_len, cache_dtype)
    zeros = lambda dtype=jnp.int32: jnp.zeros((slots,), dtype)  # distinct buffers (donated)
    state = dict(own=dict(k=cache.k, v=cache.v), last=zeros(), position=zeros(), t=zeros(),
                 row=zeros(), prompt=zeros() - 1, sample=zeros(), active=zeros(bool),
                 stopped=zeros(bool), row_keys=sample_key(key, zeros(), zeros()),
                 feed=jnp.full((slots, max_new), -1, jnp.int32))  # -1: sample this position
    out = dict(tokens=jnp.full((slots, max_new), pad_token_id, jnp.int32),
               logprobs=jnp.zeros((slots, max_new), jnp.float32),
               raw_logprobs=jnp.zeros((slots, max_new), jnp.float32))
    if return_logits:
        out["logits"] = jnp.zeros((slots, max_new, vocab), jnp.float32)
    if routing:
        out["routing"] = routing_buffer(model.config, slots, max_new)
    return dict(state=state, out=out, steps=jnp.int32(0), staging=staging)


@functools.partial(jax.jit, static_argnames=("graphdef", "chunk", "layout"),
                   donate_argnames=("staging",))
def prefill_staging(graphdef, state, layer_params: Any, staging: dict, *, chunk: int,
                    layout: DecodeLayout = UNPLACED) -> dict:
    """Every chunk left of the staged prompts (no slot is decoding)."""
    model = nnx.merge(graphdef, state)
    return layout.constrain(jax.lax.while_loop(
        lambda s: s["chunk"] < s["chunks"], lambda s: prefill_chunk(model, layer_params, s, chunk),
        staging))


def _put_rows(dst: Array, src: Array, rows: Array, axis: int) -> Array:
    """dst with rows `rows` [M] along `axis` set to src [M, ...] (rows out of range dropped)."""
    dst_m = jnp.moveaxis(dst, axis, 0)
    src_m = jnp.moveaxis(src, axis, 0).astype(dst.dtype)
    return jnp.moveaxis(dst_m.at[rows].set(src_m, mode="drop"), 0, axis)


def _put_grouped(layout: DecodeLayout, dst: Array, src: Array, rows: Array, axis: int) -> Array:
    """`_put_rows` where staged row p (group-major) goes to a row of its own group."""
    if layout.groups == 1:
        return _put_rows(dst, src, rows, axis)
    local = layout.split(layout.local(rows, dst.shape[axis]))
    put = jax.vmap(lambda d, s, r: _put_rows(d, s, r, axis), in_axes=(axis, axis, 0),
                   out_axes=axis)
    return layout.merge(put(layout.split(dst, axis), layout.split(src, axis), local), axis)


@functools.partial(jax.jit, static_argnames=("layout",), donate_argnames=("store",))
def commit_staging(store: dict, staging: dict, rows: Array, *,
                   layout: DecodeLayout = UNPLACED) -> dict:
    """Store row rows[p] takes staged prompt p (rows[p] ≥ K: none; a store row of staged row
    p's own slot group): keys, values, length, last logits."""
    cache = staging["cache"]
    put = lambda dst, src, axis=None: _put_grouped(layout, dst, src, rows,
                                                   dst.ndim - 4 if axis is None else axis)
    return layout.constrain(dict(
        k=jax.tree.map(put, store["k"], cache.k), v=jax.tree.map(put, store["v"], cache.v),
        lengths=put(store["lengths"], staging["lengths"], 0),
        logits=put(store["logits"], staging["logits"], 0)))


def _first_column(value: Array, fill: Any = 0, *, max_new: int) -> Array:
    """[M, max_new, ...] of `fill` with column 0 set to value [M, ...]."""
    buf = jnp.full((value.shape[0], max_new) + value.shape[1:], fill, value.dtype)
    return buf.at[:, 0].set(value)


@functools.partial(jax.jit, static_argnames=(*_STATIC[1:], "layout"),
                   donate_argnames=("carry",))
def assign_slots(carry: dict, store: dict, take: Array, rows: Array, prompt_ids: Array,
                 sample_ids: Array, key: Array, temperature: Array, top_p: Array,
                 stop_ids: Array, *, program: Program, pad_token_id: int,
                 return_logits: bool, layout: DecodeLayout = UNPLACED) -> dict:
    """Each slot s with `take[s]` takes sample `sample_ids[s]` of prompt `prompt_ids[s]`, whose
    prompt is store row `rows[s]` (a row of its own slot group); the others keep theirs. Its
    first token is drawn from the stored logits at completion position 0. All [R]."""
    state, out = carry["state"], carry["out"]
    logits = layout.take(store["logits"], rows)
    row_keys = sample_key(key, prompt_ids, sample_ids)
    token, lp, raw_lp = sample_step(row_keys, jnp.zeros_like(prompt_ids), logits, temperature,
                                    top_p, greedy=program.greedy, top_k=program.top_k,
                                    use_top_p=program.use_top_p)
    stop = jnp.isin(token, stop_ids)
    set_ = lambda dst, value: jnp.where(take.reshape(take.shape + (1,) * (dst.ndim - 1)),
                                        value.astype(dst.dtype), dst)
    first = functools.partial(_first_column, max_new=program.max_new_tokens)
    out = dict(out, tokens=set_(out["tokens"], first(token, pad_token_id)),
               logprobs=set_(out["logprobs"], first(lp)),
               raw_logprobs=set_(out["raw_logprobs"], first(raw_lp)))
    if return_logits:
        out["logits"] = set_(out["logits"], first(logits))
    if program.routing:  # nothing fed yet (a slot's previous sample wrote its own columns)
        out["routing"] = set_(out["routing"], jnp.full_like(out["routing"], -1))
    state = dict(state, last=set_(state["last"], token), row=set_(state["row"], rows),
                 position=set_(state["position"], layout.take(store["lengths"], rows)),
                 t=set_(state["t"], jnp.ones_like(token)), prompt=set_(state["prompt"], prompt_ids),
                 sample=set_(state["sample"], sample_ids),
                 active=set_(state["active"], ~stop & (program.max_new_tokens > 1)),
                 stopped=set_(state["stopped"], stop),
                 row_keys=jnp.where(take, row_keys, state["row_keys"]),
                 feed=jnp.where(take[:, None], -1, state["feed"]))
    return layout.constrain(dict(carry, state=state, out=out))


@functools.partial(jax.jit, static_argnames=("layout",), donate_argnames=("carry",))
def resume_slots(carry: dict, take: Array, feed: Array, *,
                 layout: DecodeLayout = UNPLACED) -> dict:
    """Slots `take` [R] (parked at a turn boundary) run again with feed rows `feed`
    [R, max_new] (-1: sample; a token id: the environment's token at that position); the
    others keep theirs."""
    state = carry["state"]
    state = dict(state, feed=jnp.where(take[:, None], feed, state["feed"]),
                 active=state["active"] | take, stopped=state["stopped"] & ~take)
    return layout.constrain(dict(carry, state=state))


@functools.partial(jax.jit, static_argnames=("graphdef", *_STATIC, "chunk", "layout"),
                   donate_argnames=("carry",))
def decode_slots(graphdef, state, layer_params: Any, carry: dict, store: dict, steps: Array,
                 refill_at: Array, temperature: Array, top_p: Array, stop_ids: Array, *,
                 program: Program, pad_token_id: int, return_logits: bool, chunk: int,
                 layout: DecodeLayout = UNPLACED) -> dict:
    """Up to `steps` decode steps of every slot, each with the next prefill chunk of the staged
    prompts if any is left; stops early when no slot runs, or when `refill_at` slots or more
    are free and no chunk is left. A slot ends after a stop token or max_new_tokens."""
    model = nnx.merge(graphdef, state)
    max_new = program.max_new_tokens
    k_rows = store["lengths"].shape[0]
    sample = functools.partial(sample_step, greedy=program.greedy, top_k=program.top_k,
                               use_top_p=program.use_top_p)

    def cond(loop):
        i, slot, _, staged = loop
        ready = staged["chunk"] >= staged["chunks"]
        refill = (jnp.sum(~slot["active"]) >= refill_at) & ready
        return (i < steps) & jnp.any(slot["active"]) & ((i == 0) | ~refill)

    def body(loop):
        i, slot, out, staged = loop
        active = slot["active"]
        t = slot["t"]
        rows = jnp.where(active, slot["row"], k_rows)  # a free slot reads and writes nothing
        hidden, own, routing = slot_forward(model, layer_params, slot["last"],
                                            slot["position"], slot["own"], store, rows,
                                            slot["sample"], t, program.n, layout=layout)
        staged = jax.lax.cond(staged["chunk"] < staged["chunks"],
                              lambda s: prefill_chunk(model, layer_params, s, chunk),
                              lambda s: s, staged)
        logits = _last_logits(model, hidden[:, None])
        token, lp, raw_lp = sample(slot["row_keys"], t, logits, temperature, top_p)
        index = jnp.arange(token.shape[0])
        forced = slot["feed"][index, jnp.minimum(t, max_new - 1)]  # an environment token?
        fed = active & (forced >= 0)
        token = jnp.where(fed, forced, jnp.where(active, token, pad_token_id))
        lp, raw_lp = jnp.where(fed, 0.0, lp), jnp.where(fed, 0.0, raw_lp)
        col = jnp.where(active, t, max_new)  # out of range: dropped
        put = lambda buf, value: buf.at[index, col].set(value.astype(buf.dtype), mode="drop")
        out = dict(out, tokens=put(out["tokens"], token), logprobs=put(out["logprobs"], lp),
                   raw_logprobs=put(out["raw_logprobs"], raw_lp))
        if return_logits:
            out["logits"] = put(out["logits"], logits)
        if program.routing:  # the token fed in is completion token t − 1 (routing.py)
            ids = step_routing(routing, out["routing"].dtype)
            out["routing"] = out["routing"].at[index, jnp.where(active, t - 1, max_new)].set(
                ids, mode="drop")
        stop = active & ~fed & jnp.isin(token, stop_ids)
        t = t + active.astype(jnp.int32)
        # an idle slot keeps its last token: a parked one feeds it when it resumes
        slot = dict(slot, own=own, last=jnp.where(active, token, slot["last"]), t=t,
                    position=slot["position"] + active.astype(jnp.int32),
                    active=active & ~stop & (t < max_new), stopped=slot["stopped"] | stop)
        return i + 1, slot, out, staged

    steps, slot, out, staged = jax.lax.while_loop(
        cond, body, (jnp.int32(0), carry["state"], carry["out"], carry["staging"]))
    return layout.constrain(dict(state=slot, out=out, steps=steps, staging=staged))


@functools.partial(jax.jit, static_argnames=("width", "layout"))  # new shapes: no donation
def resize_slots(carry: dict, width: int, layout: DecodeLayout = UNPLACED) -> dict:
    """The carry with each slot's generated slots cut or padded to `width`. Cutting drops only
    slots no running sample has reached (the driver's rule); a slot's generated slots at or
    past its `t` are never attended to."""
    def fit(a, axis, _):
        extra = width - a.shape[axis]
        return (jax.lax.slice_in_dim(a, 0, width, axis=axis) if extra < 0 else
                jnp.pad(a, [(0, extra if i == axis else 0) for i in range(a.ndim)]))
    state = carry["state"]
    return layout.constrain(dict(carry, state=dict(state, own=_own_map(state["own"], fit))))


@functools.partial(jax.jit, static_argnames=("layout",))
def select_slots(carry: dict, rows: Array, layout: DecodeLayout = UNPLACED) -> dict:
    """Keep slots `rows` [R'] of every per-slot buffer (generated slots, state, outputs); R' a
    multiple of the slot groups, and each group keeps slots of its own (group-major)."""
    def take(a, axis=0):
        if layout.groups == 1:
            return jnp.take(a, rows, axis=axis)
        local = layout.split(layout.local(rows, a.shape[axis]))
        pick = jax.vmap(lambda x, r: jnp.take(x, r, axis=axis), in_axes=(axis, 0), out_axes=axis)
        return layout.merge(pick(layout.split(a, axis), local), axis)

    state = carry["state"]
    state = {name: _own_map(value, lambda a, _, axis: take(a, axis)) if name == "own"
             else take(value) for name, value in state.items()}
    return layout.constrain(dict(carry, state=state,
                                 out={name: take(buf) for name, buf in carry["out"].items()}))
