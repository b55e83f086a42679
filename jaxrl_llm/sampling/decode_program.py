"""The compiled programs behind `sampling.sampler.Sampler`: prefill, a decode segment, and the
row selection that drops finished rows between segments, and the cache growth between windows.

A prompt batch is prefilled once (`prefill`); its n samples per prompt then share that prefill
(each prompt's cache rows are repeated n times). Decoding runs in segments
(`decode_segment`: a `lax.while_loop` up to a given step, exiting early when every row has
stopped). Between segments the driver may keep only the rows still running (`select_rows`,
a gather along the row axis of the cache and of every loop buffer), so finished rows stop
costing compute. Sampling is invariant under that selection, and under any batch, slot or
process a sample lands in: the uniform of the token at position t of sample j of prompt i is
`uniform(fold_in(sample_key(key, i, j), t))` (`sample_key`, `step_uniforms`), and its token
is the inverse CDF of softmax(processed_logits) at that uniform (`inverse_cdf_token`).

The cache holds only the slots the current window of steps can fill (`prefill(cache_len=)`,
then `grow_cache` pads the slot axis with empty slots): a decode step's attention reads every
slot of the cache it is given, so early steps of a long generation do not pay for the last
step's context. Empty slots have segment id 0 and are never attended to, so growth changes
no sample.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_llm.models.kv_cache import KVCache
from jaxrl_llm.sampling.routing import routing_buffer, step_routing

Array = jax.Array
Carry = dict[str, Any]  # {"loop": per-row decode state, "out": the output buffers}


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
class Program:
    """The parts of `SamplingParams` that change the compiled program (temperature, top_p
    values and stop ids are traced, so changing them does not recompile). `routing`: record
    each generated token's experts (a mixture of experts, `sampling/routing.py`); off, the
    programs are the ones without it."""

    max_new_tokens: int
    n: int
    greedy: bool
    top_k: int
    use_top_p: bool
    routing: bool = False

    @classmethod
    def of(cls, params: Any, *, routing: bool = False) -> Program:
        return cls(params.max_new_tokens, params.n, params.greedy, params.top_k,
                   params.top_p < 1.0, routing)


def first_argmax(x: Array) -> Array:
    """`jnp.argmax(x, axis=-1)` (the first maximal index; the first NaN if a row has one) from
    vectorised reductions (any, max, min). x [B, V] -> [B] int32.

    Why: XLA:CPU lowers argmax to a variadic (value, index) reduce that does not vectorise;
    over a 49k vocabulary at batch 32 it took 3.5 ms of a ~95 ms decode step, this ~1 ms."""
    nan = jnp.isnan(x)
    # XLA's max may skip NaN, so a row with a NaN is matched on the NaN, not on its max.
    hit = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan,
                    x == jnp.max(x, axis=-1, keepdims=True))
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(hit, index, x.shape[-1]), axis=-1)


_CDF_BLOCK = 256  # tokens per block of the two-level inverse CDF


def _last_true(mask: Array, upto: Array) -> Array:
    """Per row, the last index i <= upto[row] with mask[row, i] (else the first true index):
    mask [B, N] bool, upto [B] int32 -> [B] int32."""
    index = jax.lax.broadcasted_iota(jnp.int32, mask.shape, 1)
    below = jnp.max(jnp.where(mask & (index <= upto[:, None]), index, -1), axis=-1)
    first = jnp.min(jnp.where(mask, index, mask.shape[1] - 1), axis=-1)
    return jnp.where(below >= 0, below, first)


def inverse_cdf_token(u: Array, logits: Array) -> tuple[Array, Array]:
    """A draw from softmax(logits) given u ~ U[0, 1) per row: the token whose interval of the
    cumulative distribution holds u. logits [B, V] float32 (-inf: excluded), u [B] ->
    (token [B] int32, logsumexp(logits) [B]).

    Why not Gumbel-max (`argmax(logits + gumbel)`): it draws B×V numbers per step, and
    threefry on XLA:CPU took as long as the 49k-vocabulary output product at batch 32. This
    draws B: one exp over [B, V], block sums, and two short cumsums (a [B, V] cumsum is slow on
    XLA:CPU). Rounding can never pick an excluded token: a pick without mass moves to the
    nearest token before it that has some (`_last_true`)."""
    b, v = logits.shape
    chex.assert_shape(u, (b,))
    blocks = -(-v // _CDF_BLOCK)
    x = jnp.pad(logits, ((0, 0), (0, blocks * _CDF_BLOCK - v)), constant_values=-jnp.inf)
    top = jnp.max(x, axis=-1)
    p = jnp.exp(x - top[:, None]).reshape(b, blocks, _CDF_BLOCK)
    mass = jnp.sum(p, axis=-1)  # [B, blocks]
    upto = jnp.cumsum(mass, axis=-1)
    target = u * upto[:, -1]
    block = _last_true(mass > 0, jnp.sum(upto <= target[:, None], axis=-1))
    before = jnp.take_along_axis(upto - mass, block[:, None], axis=-1)[:, 0]
    row = jnp.take_along_axis(p, block[:, None, None], axis=1)[:, 0, :]  # [B, block]
    within = jnp.cumsum(row, axis=-1)
    j = _last_true(row > 0, jnp.sum(within <= (target - before)[:, None], axis=-1))
    return block * _CDF_BLOCK + j, top + jnp.log(upto[:, -1])


def chosen_logprob(x: Array, token: Array) -> Array:
    """`log_softmax(x)[token]` per row of sampler logits x [B, V], without materialising the
    [B, V] log-softmax (the trainer's `losses.logprobs.token_logprobs` starts from hidden
    states and the unembedding instead, chunked over the vocabulary)."""
    picked = jnp.take_along_axis(x, token[:, None], axis=-1)[:, 0]
    return picked - jax.nn.logsumexp(x, axis=-1)


def sample_key(key: Array, prompt_ids: Array, sample_ids: Array) -> Array:
    """Per-row keys [B] for (prompt i, sample j): `fold_in(fold_in(key, i), j)`. They depend on
    the ids only, never on the row, batch or slot a sample is decoded in."""
    return jax.vmap(lambda i, j: jax.random.fold_in(jax.random.fold_in(key, i), j))(
        prompt_ids, sample_ids)


def step_uniforms(row_keys: Array, positions: Array) -> Array:
    """u ~ U[0, 1) per row for the completion token at `positions` [B] (0 = the first new
    token) of the samples whose keys are `row_keys` [B] (`sample_key`)."""
    return jax.vmap(lambda k, t: jax.random.uniform(jax.random.fold_in(k, t), (),
                                                    jnp.float32))(row_keys, positions)


def sample_step(row_keys: Array, positions: Array, logits: Array, temperature: Array,
                top_p: Array, *, greedy: bool, top_k: int,
                use_top_p: bool) -> tuple[Array, Array, Array]:
    """One token per row and its (processed, raw) log-probs. logits [B, V] -> 3 × [B].

    row_keys [B] (`sample_key`), positions [B]: the completion position of each row's token;
    the noise depends on nothing else (the module docstring's invariance)."""
    logits = logits.astype(jnp.float32)
    if greedy:
        token = first_argmax(logits)
        raw_lp = chosen_logprob(logits, token)
        return token, jnp.zeros_like(raw_lp), raw_lp
    processed = process_logits(logits, temperature, top_p, top_k=top_k, use_top_p=use_top_p)
    token, lse = inverse_cdf_token(step_uniforms(row_keys, positions), processed)
    lp = jnp.take_along_axis(processed, token[:, None], axis=-1)[:, 0] - lse
    filtered = use_top_p or 0 < top_k < logits.shape[-1]
    # Without top-k/top-p the processed logits are logits / temperature: the same log-prob.
    raw_lp = chosen_logprob(logits / temperature, token) if filtered else lp
    return token, lp, raw_lp


def _last_logits(model: Any, hidden: Array) -> Array:
    """Logits [B, V] of the last position (prompts are left-padded: it is the last real one)."""
    return model.logits(hidden[:, -1:, :])[:, 0, :].astype(jnp.float32)


def _map_slots(cache: KVCache, fn) -> KVCache:
    """`fn(array, axis)` applied to every per-slot buffer of the cache (the slot axis is the
    last of each key buffer, the second to last of each value buffer: `KVCache`)."""
    return cache.replace(
        k=jax.tree.map(lambda a: fn(a, a.ndim - 1), cache.k),
        v=jax.tree.map(lambda a: fn(a, a.ndim - 2), cache.v),
        segment_ids=fn(cache.segment_ids, 1),
        positions=fn(cache.positions, 1),
    )


def _map_rows(cache: KVCache, fn) -> KVCache:
    """`fn(array, axis)` applied to every per-row buffer of the cache (in each k/v buffer,
    stacked or per layer, the row axis is the fourth from the end)."""
    return cache.replace(
        k=jax.tree.map(lambda a: fn(a, a.ndim - 4), cache.k),
        v=jax.tree.map(lambda a: fn(a, a.ndim - 4), cache.v),
        segment_ids=fn(cache.segment_ids, 0),
        positions=fn(cache.positions, 0),
        lengths=fn(cache.lengths, 0),
    )


@functools.partial(jax.jit, static_argnames=("graphdef",))
def fused_layer_params(graphdef, state) -> Any:
    """The model's layer params with q/k/v and gate/up fused (`Decoder.decode_layer_params`),
    or None for a model without them. Built once per `generate` call and passed to every
    program below: loop-invariant inputs of every step."""
    model = nnx.merge(graphdef, state)
    return model.decode_layer_params() if hasattr(model, "decode_layer_params") else None


def _layer_kwargs(layer_params: Any) -> dict[str, Any]:
    return {} if layer_params is None else dict(layer_params=layer_params)


_STATIC = ("graphdef", "program", "pad_token_id", "return_logits")


@functools.partial(jax.jit, static_argnames=(*_STATIC, "cache_dtype", "cache_len"))
def prefill(graphdef, state, layer_params: Any, prompt_tokens: Array, prompt_mask: Array,
            prompt_ids: Array, key: Array, temperature: Array, top_p: Array, stop_ids: Array, *,
            program: Program, pad_token_id: int, cache_dtype, return_logits: bool,
            cache_len: int) -> Carry:
    """Prefill B left-padded prompts once and sample the first token of each of their n
    samples (prompt-major rows). prompt_tokens, prompt_mask [B, P] (mask 0 on left padding).
    cache_len ≥ P: the cache's slots (decode step s writes slot P + s - 1; `grow_cache`).

    Returns the carry: "loop" (step, cache, last token, stopped, lengths, next position,
    row_keys) and "out" (tokens / logprobs / raw_logprobs [B·n, max_new] and, with
    `return_logits`, every step's unprocessed logits [B·n, max_new, V])."""
    model = nnx.merge(graphdef, state)
    chex.assert_equal_shape([prompt_tokens, prompt_mask])
    n, max_new = program.n, program.max_new_tokens
    batch, prompt_len = prompt_tokens.shape
    if cache_len < prompt_len:
        raise ValueError(f"cache_len={cache_len} < the prompt's {prompt_len} slots")
    mask = prompt_mask.astype(jnp.int32)
    positions = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)
    cache = model.init_cache(batch, cache_len, cache_dtype)
    # Left padding has segment id 0 and is never attended to.
    hidden, cache = model(prompt_tokens, positions=positions, segment_ids=mask, cache=cache,
                          **_layer_kwargs(layer_params))
    cache = _map_rows(cache, lambda a, axis: jnp.repeat(a, n, axis=axis))
    logits = jnp.repeat(_last_logits(model, hidden), n, axis=0)
    rows = batch * n
    row_keys = sample_key(key, jnp.repeat(prompt_ids, n),
                          jnp.tile(jnp.arange(n, dtype=jnp.int32), batch))
    token, lp, raw_lp = sample_step(row_keys, jnp.zeros((rows,), jnp.int32), logits,
                                    temperature, top_p, greedy=program.greedy, top_k=program.top_k,
                                    use_top_p=program.use_top_p)
    out = dict(
        tokens=jnp.full((rows, max_new), pad_token_id, jnp.int32).at[:, 0].set(token),
        logprobs=jnp.zeros((rows, max_new), jnp.float32).at[:, 0].set(lp),
        raw_logprobs=jnp.zeros((rows, max_new), jnp.float32).at[:, 0].set(raw_lp),
    )
    if return_logits:
        out["logits"] = jnp.zeros((rows, max_new, logits.shape[-1]), jnp.float32)
        out["logits"] = out["logits"].at[:, 0].set(logits)
    if program.routing:  # the prompt's own experts are the trainer's to recompute
        out["routing"] = routing_buffer(model.config, rows, max_new)
    loop = dict(step=jnp.int32(1), cache=cache, last=token,
                stopped=jnp.isin(token, stop_ids), lengths=jnp.ones((rows,), jnp.int32),
                next_position=jnp.repeat(positions[:, -1] + 1, n, axis=0), row_keys=row_keys)
    return dict(loop=loop, out=out)


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("carry",))
def decode_segment(graphdef, state, layer_params: Any, carry: Carry, until: Array,
                   temperature: Array, top_p: Array, stop_ids: Array, *, program: Program,
                   pad_token_id: int, return_logits: bool) -> Carry:
    """Decode steps `carry.loop.step .. until-1` (or until every row has stopped). Finished
    rows emit `pad_token_id` with log-probs 0; a row's length counts its stop token."""
    model = nnx.merge(graphdef, state)
    layer_kwargs = _layer_kwargs(layer_params)
    sample = functools.partial(sample_step, greedy=program.greedy, top_k=program.top_k,
                               use_top_p=program.use_top_p)

    def cond(state_):
        loop, _ = state_
        return (loop["step"] < until) & ~jnp.all(loop["stopped"])

    def body(state_):
        loop, out = state_
        step = loop["step"]
        pos = (loop["next_position"] + step - 1)[:, None]
        moe = dict(return_moe=True) if program.routing else {}
        hidden, cache, *aux = model(loop["last"][:, None], positions=pos,
                                    segment_ids=jnp.ones_like(pos), cache=loop["cache"],
                                    **layer_kwargs, **moe)
        logits = _last_logits(model, hidden)
        token, lp, raw_lp = sample(loop["row_keys"], jnp.broadcast_to(step, loop["last"].shape),
                                   logits, temperature, top_p)
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
        if program.routing:  # the experts of the token fed in: completion token step − 1
            ids = step_routing(aux[0].routing, out["routing"].dtype)
            ids = jnp.where(live[:, None, None], ids, jnp.asarray(-1, ids.dtype))  # a stop's
            out["routing"] = jax.lax.dynamic_update_slice(out["routing"], ids[:, None],
                                                          (0, step - 1, 0, 0))
        loop = dict(loop, step=step + 1, cache=cache, last=token,
                    stopped=loop["stopped"] | (live & jnp.isin(token, stop_ids)),
                    lengths=loop["lengths"] + live.astype(jnp.int32))
        return loop, out

    loop, out = jax.lax.while_loop(cond, body, (carry["loop"], carry["out"]))
    return dict(loop=loop, out=out)


@jax.jit
def select_rows(carry: Carry, rows: Array) -> Carry:
    """Keep rows `rows` [R'] (indices into the carry's current rows) of every per-row buffer:
    the cache, the loop state and the outputs."""
    take = lambda a, axis: jnp.take(a, rows, axis=axis)
    loop = carry["loop"]
    per_row = ("last", "stopped", "lengths", "next_position", "row_keys")
    loop = dict(loop, cache=_map_rows(loop["cache"], take),
                **{name: take(loop[name], 0) for name in per_row})
    return dict(loop=loop, out={name: take(buf, 0) for name, buf in carry["out"].items()})


@functools.partial(jax.jit, static_argnames=("cache_len",))  # new shapes: nothing to donate
def grow_cache(carry: Carry, cache_len: int) -> Carry:
    """The carry with its cache padded to `cache_len` slots (≥ today's) by empty slots."""
    cache = carry["loop"]["cache"]
    extra = cache_len - cache.max_len
    if extra < 0:
        raise ValueError(f"cannot shrink a cache of {cache.max_len} slots to {cache_len}")
    pad = lambda a, axis: jnp.pad(a, [(0, extra if i == axis else 0) for i in range(a.ndim)])
    return dict(carry, loop=dict(carry["loop"], cache=_map_slots(cache, pad)))
