"""The shared prompt cache of the continuous sampler (`slot_program.py`, `continuous.py`).

A prompt's keys and values are stored once, in one row of a prompt store (K rows × W slots,
right-padded: slot s holds position s), however many of its n samples are decoding. A decode
slot holds only its own generated tokens' keys and values (G slots: generated token g at slot
g) and the index of its prompt's store row. A decode step's attention for slot r runs over
[its prompt's store row ; its own generated slots] with one softmax (`shared_attention`).

The prompt part reads each store row once for all its samples: the slots' queries are
scattered into a [K, n] grid by (store row, sample index) — a (prompt, sample) pair is in at
most one running slot — so the scores are one batched product of each row's n samples'
queries with that row's keys, and the weighted sum one product with its values; slot r then
takes back its cell of the grid. The grid has K·n cells for R slots (some empty: a few idle
products of n query rows), so the prompt's keys and values are read K times per step instead
of R times, and stored K times instead of R.

Prefill runs in chunks of C tokens (`prefill_chunk`): P prompts are staged in a [P, W] cache
(the model's own cache and masks) and chunk c runs positions [cC, cC + C); the decode loop
runs one chunk per step while the other slots keep decoding, and the staged rows are copied
into free store rows once (`slot_program.commit_staging`). Keys and values of a chunk attend
to every earlier slot of their row, as an unchunked prefill's do: the same numbers up to the
float rounding of other matmul shapes.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_llm.models.decoder_block import layer_forward
from jaxrl_llm.models.kv_cache import per_layer
from jaxrl_llm.models.layers import (
    _group_queries,
    _masked_probs,
    _ungroup,
    rms_norm,
    rope_attention_scale,
    rope_cos_sin,
    rope_inv_freq,
)
from jaxrl_llm.sampling.decode_program import _layer_kwargs
from jaxrl_llm.sampling.layout import DecodeLayout

Array = jax.Array


def kv_bytes_per_token(config: Any, itemsize: int) -> int:
    """Keys and values of one token in every layer."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize


def kv_bytes_per_sequence(config: Any, *, itemsize: int, prompt_width: int,
                          max_new_tokens: int, slots: int, prompt_rows: int,
                          staging_rows: int, shared: bool = True) -> float:
    """KV-cache bytes per concurrent sequence (per decode slot) of the continuous sampler.

    shared: each slot holds max_new_tokens generated slots, and the prompts are stored once in
    `prompt_rows` store rows of `prompt_width` slots plus the `staging_rows` being prefilled,
    shared by the `slots` slots. Copied (shared=False, the layout before the shared cache):
    each slot holds its own copy of its prompt (prompt_width + max_new_tokens slots), plus its
    share of the staging rows."""
    rows = (prompt_rows if shared else 0) + staging_rows
    own = max_new_tokens + (0 if shared else prompt_width)
    return kv_bytes_per_token(config, itemsize) * (own + rows * prompt_width / slots)


def init_store(model: Any, rows: int, width: int, dtype: Any) -> dict:
    """An empty prompt store: keys/values (the `KVCache` layouts) of `rows` prompts of up to
    `width` tokens, each prompt's length and its last position's logits."""
    cache = model.init_cache(rows, width, dtype)
    return dict(k=cache.k, v=cache.v, lengths=jnp.zeros((rows,), jnp.int32),
                logits=jnp.zeros((rows, model.config.vocab_size), jnp.float32))


def init_staging(model: Any, rows: int, width: int, dtype: Any) -> dict:
    """An empty staging area: `rows` prompts (tokens, lengths) prefilled chunk by chunk into
    the model's cache; `chunk` of `chunks` done (equal: nothing to run)."""
    return dict(cache=model.init_cache(rows, width, dtype),
                tokens=jnp.zeros((rows, width), jnp.int32), lengths=jnp.ones((rows,), jnp.int32),
                chunk=jnp.int32(0), chunks=jnp.int32(0),
                logits=jnp.zeros((rows, model.config.vocab_size), jnp.float32))


def prefill_chunk(model: Any, layer_params: Any, staging: dict, size: int) -> dict:
    """Run chunk `staging["chunk"]` (tokens [P, size] at slots [c·size, (c+1)·size)) of the
    staged right-padded prompts; a row whose last token is in the chunk keeps its logits."""
    start = staging["chunk"] * size
    rows = staging["tokens"].shape[0]
    tokens = jax.lax.dynamic_slice_in_dim(staging["tokens"], start, size, axis=1)
    slot = jnp.broadcast_to(start + jnp.arange(size, dtype=jnp.int32), (rows, size))
    lengths = staging["lengths"]
    mask = (slot < lengths[:, None]).astype(jnp.int32)  # padding: segment 0, never attended
    cache = staging["cache"].replace(index=start)
    hidden, cache = model(tokens, positions=slot, segment_ids=mask, cache=cache,
                          **_layer_kwargs(layer_params))
    local = jnp.clip(lengths - 1 - start, 0, size - 1)
    last = jnp.take_along_axis(hidden, local[:, None, None], axis=1)
    logits = model.logits(last)[:, 0, :].astype(jnp.float32)
    here = (lengths - 1 >= start) & (lengths - 1 < start + size)
    return dict(staging, cache=cache, chunk=staging["chunk"] + 1,
                logits=jnp.where(here[:, None], logits, staging["logits"]))


def shared_attention(q: Array, prompt: tuple[Array, Array], prompt_mask: Array,
                     own: tuple[Array, Array], own_mask: Array, rows: Array, samples: Array,
                     n: int, *, scale: float, logit_softcap: float | None,
                     layout: DecodeLayout | None = None) -> Array:
    """Attention of one query per slot, q [R, 1, Hq, D], over its store row's keys and values
    prompt = (keys_t [K, Hkv, D, W], values [K, Hkv, W, D]) where prompt_mask [R, W] and its
    own own = (keys_t [R, Hkv, D, G], values [R, Hkv, G, D]) where own_mask [R, G]: one softmax
    over both. rows [R]: each slot's store row (≥ K: an idle slot, which gets garbage);
    samples [R] < n: its sample index. Returns [R, 1, Hq, D].

    With a `layout` of several slot groups, slot s reads a store row of its own group (the
    driver's rule) and each group attends on its own: no data crosses the slot shards."""
    if layout is not None and layout.groups > 1:
        sp = layout.split
        one = functools.partial(shared_attention, n=n, scale=scale, logit_softcap=logit_softcap)
        out = jax.vmap(one)(sp(q), (sp(prompt[0]), sp(prompt[1])), sp(prompt_mask),
                            (sp(own[0]), sp(own[1])), sp(own_mask),
                            sp(layout.local(rows, prompt[0].shape[0])), sp(samples))
        return layout.merge(out)
    pk, pv = prompt
    gk, gv = own
    k_rows, hkv, _, width = pk.shape
    qg = _group_queries(q, hkv)  # [R, Hkv, g, D]
    g = qg.shape[2]
    cell = jnp.clip(rows, 0, k_rows - 1)
    grid = jnp.zeros((k_rows, n) + qg.shape[1:], qg.dtype).at[rows, samples].set(
        qg, mode="drop")  # [K, n, Hkv, g, D]
    grid = grid.transpose(0, 2, 1, 3, 4).reshape(k_rows, hkv, n * g, -1)
    scores = jnp.einsum("bkqd,bkds->bkqs", grid, pk, preferred_element_type=jnp.float32)
    scores = scores.reshape(k_rows, hkv, n, g, width)[cell, :, samples]  # [R, Hkv, g, W]
    own_scores = jnp.einsum("bkqd,bkds->bkqs", qg, gk, preferred_element_type=jnp.float32)
    mask = jnp.concatenate([prompt_mask, own_mask], axis=-1)[:, None, :]  # [R, 1, W + G]
    probs = _masked_probs(jnp.concatenate([scores, own_scores], axis=-1), mask, 1, scale,
                          logit_softcap, pv.dtype)
    p_probs, g_probs = probs[..., :width], probs[..., width:]
    grid = jnp.zeros((k_rows, hkv, n, g, width), pv.dtype).at[rows, :, samples].set(
        p_probs, mode="drop").reshape(k_rows, hkv, n * g, width)
    out = jnp.einsum("bkqs,bksd->bkqd", grid, pv).reshape(k_rows, hkv, n, g, -1)
    out = out[cell, :, samples] + jnp.einsum("bkqs,bksd->bkqd", g_probs, gv)
    return _ungroup(out, 1)


def _layer(buffers: Any, index: Any) -> Array:
    """One layer's buffer of a cache field: the tuple's entry, or the stack's slice."""
    if isinstance(buffers, tuple):
        return buffers[index]
    return jax.lax.dynamic_index_in_dim(buffers, index, 0, keepdims=False)


def write_generated(buf: Array, value: Array, write: Array, *, row_axis: int,
                    slot_axis: int, layer: Array | None = None) -> Array:
    """`buf` with each row r's generated slot `write[r]` set to `value[r]` (value [R, ...]: one
    row of `buf` without its slot axis and, when `layer` is given, without its leading layer
    axis: that layer's slot is set). One dynamic_update_slice per row under vmap: compiled
    in place, where the equivalent scatter into the minor slot axis (`buf.at[..., r, ...,
    write]`) makes the TPU compiler copy the whole cache every step (7 GiB per chip for an 8B
    model at 256 × 8,192; benchmarks/decode_v5e.py). The index is clamped: an idle slot's
    (write ≥ G) lands in its own last generated slot, which no sequence reads before writing
    it (a slot reads its own slots < t only, all written by its current sequence; a slot
    parked between an episode's turns has written slots < t − 1 only, and the window G ≥ t)."""
    axis = slot_axis - (slot_axis > row_axis)  # in one row's buffer

    def one(row: Array, x: Array, at: Array) -> Array:
        start = [jnp.int32(0)] * row.ndim
        start[axis] = at
        x = jnp.expand_dims(x.astype(row.dtype), axis - (layer is not None))
        if layer is not None:
            start[0] = layer
            x = x[None]
        return jax.lax.dynamic_update_slice(row, x, start)

    return jax.vmap(one, in_axes=(row_axis, 0, 0), out_axes=row_axis)(buf, value, write)


def slot_forward(model: Any, layer_params: Any, tokens: Array, positions: Array, own: dict,
                 store: dict, rows: Array, samples: Array, t: Array, n: int,
                 layout: DecodeLayout | None = None) -> tuple[Array, dict, Array | None]:
    """One decode step of R slots: token [R] at position [R] (its prompt's length + t − 1),
    written to generated slot t − 1 of `own` (k, v: `KVCache` layouts of R rows × G slots; an
    idle slot, rows ≥ K, writes nothing); attention over the store row `rows[r]`
    (`shared_attention`). Returns hidden [R, d] after the final norm, the new `own` and, for
    a mixture of experts, each slot's token's experts [L, R, 1, k] (else None)."""
    c = model.config
    dt = c.compute_jnp_dtype
    x = jnp.take(model.embed[...], tokens[:, None], axis=0).astype(dt)
    if c.is_gemma:
        x = x * jnp.asarray(math.sqrt(c.hidden_size), dtype=dt)
    cos, sin = rope_cos_sin(positions[:, None], rope_inv_freq(c), rope_attention_scale(c))
    k_rows, width = store["lengths"].shape[0], jax.tree.leaves(store["v"])[0].shape[-2]
    gen = jax.tree.leaves(own["v"])[0].shape[-2]
    slot_ids = jnp.arange(width, dtype=jnp.int32)
    prompt_len = (store["lengths"][jnp.clip(rows, 0, k_rows - 1)] if layout is None
                  else layout.take(store["lengths"], rows))
    prompt_mask = slot_ids[None, :] < prompt_len[:, None]
    own_ids = jnp.arange(gen, dtype=jnp.int32)
    own_mask = own_ids[None, :] < t[:, None]
    masks = {False: (prompt_mask, own_mask)}
    if c.sliding_window is not None and any(c.sliding_layers):  # by position, as the model
        w = c.sliding_window
        masks[True] = (prompt_mask & (positions[:, None] - slot_ids[None, :] < w),
                       own_mask & ((t - 1)[:, None] - own_ids[None, :] < w))
    write = jnp.where(rows < k_rows, t - 1, gen)  # an idle slot: clamped (write_generated)

    def layer(p, x, is_sliding, index, gk, gv):
        """gk / gv: layer `index`'s own-cache buffers [R, Hkv, D, G] / [R, Hkv, G, D], or the
        whole stacks [L, R, Hkv, D, G] / [L, R, Hkv, G, D] (`stacked_decode`)."""
        new = {}
        stacked = not isinstance(index, int)
        if isinstance(is_sliding, bool) or True not in masks:
            p_mask, g_mask = masks[True in masks and is_sliding is True]
        else:
            p_mask, g_mask = (jnp.where(is_sliding, masks[True][i], masks[False][i])
                              for i in range(2))

        def attend(q, k, v):
            nk = k[:, 0].astype(gk.dtype)  # [R, Hkv, D]
            nv = v[:, 0].astype(gv.dtype)
            if stacked:
                new["k"] = write_generated(gk, nk, write, row_axis=1, slot_axis=4, layer=index)
                new["v"] = write_generated(gv, nv, write, row_axis=1, slot_axis=3, layer=index)
            else:
                new["k"] = write_generated(gk, nk, write, row_axis=0, slot_axis=3)
                new["v"] = write_generated(gv, nv, write, row_axis=0, slot_axis=2)
            layer_k, layer_v = (_layer(new[f], index) if stacked else new[f] for f in "kv")
            prompt = (_layer(store["k"], index).astype(q.dtype),
                      _layer(store["v"], index).astype(q.dtype))
            return shared_attention(q, prompt, p_mask, (layer_k.astype(q.dtype),
                                                        layer_v.astype(q.dtype)),
                                    g_mask, rows, samples, n, scale=c.attn_scale,
                                    logit_softcap=c.attn_logit_softcap, layout=layout)

        x, _, stats = layer_forward(p, x, cos, sin, attend, None, None, c)
        return x, new["k"], new["v"], None if stats is None else stats.ids

    params = model.pure_layer_params() if layer_params is None else layer_params
    if not isinstance(own["k"], tuple):  # `stacked_decode`: under the layer scan
        def body(carry, xs):
            x, gk, gv = carry
            p, is_sliding, index = xs
            x, gk, gv, ids = layer(p, x, is_sliding, index, gk, gv)
            return (x, gk, gv), ids

        xs = (params, jnp.asarray(c.sliding_layers), jnp.arange(c.num_layers, dtype=jnp.int32))
        (x, gk, gv), routing = jax.lax.scan(body, (x, own["k"], own["v"]), xs)
        own = dict(own, k=gk, v=gv)
    else:
        if not isinstance(params, (list, tuple)):  # a scanned model's stack, decoded unrolled
            params = per_layer(params, c.num_layers)
        ks, vs, ids = [], [], []
        for i, p in enumerate(params):
            x, gk, gv, layer_ids = layer(p, x, c.sliding_layers[i], i, own["k"][i], own["v"][i])
            ks.append(gk)
            vs.append(gv)
            ids.append(layer_ids)
        own = dict(own, k=tuple(ks), v=tuple(vs))
        routing = jnp.stack(ids) if c.is_moe else None
    hidden = rms_norm(x, model.final_norm.scale[...], eps=c.rms_norm_eps, gemma=c.is_gemma)
    return hidden[:, 0], own, routing

