"""`plan` for the sampler: the continuous sampler's own programs (`sampling/slot_program.py`:
`decode_slots`, one decode segment with a prefill chunk beside each step, and
`prefill_staging`) compiled for the sampler's devices in the decode layout the sampler itself
derives (`sampling/layout.py`), on abstract inputs, by the target's real compiler (libtpu for
a TPU topology). Nothing here builds its own sharding: the weights take
`DecodeLayout.place_state`'s shardings and dtype, the carry and the prompt store
`DecodeLayout.shardings`, their sizes `ContinuousSampler.layout` for `generate.batch_size` ×
`generate.n` slots, prompts of `plan.sampler_prompt_len` tokens (default train.max_seq_len −
generate.max_new_tokens) and `generate.max_new_tokens` new tokens.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxrl_llm.models.attention import attention_mesh
from jaxrl_llm.models.decoder import Decoder
from jaxrl_llm.parallel.memory import ProgramMemory
from jaxrl_llm.parallel.rules import state_shardings
from jaxrl_llm.sampling.continuous import ContinuousSampler
from jaxrl_llm.sampling.decode_program import Program, fused_layer_params
from jaxrl_llm.sampling.layout import DECODE_PARAM_RULES, DecodeLayout, castable, from_mesh
from jaxrl_llm.sampling.prompt_cache import init_staging, init_store
from jaxrl_llm.sampling.sampler import window_ends
from jaxrl_llm.sampling.slot_program import decode_slots, init_slots, prefill_staging

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class SamplerPlan:
    """Per-chip figures of the sampler's compiled programs (module docstring)."""

    devices: int
    layout: str  # `DecodeLayout.describe`
    groups: int
    tensor: int
    slots: int
    prompt_width: int
    max_new_tokens: int
    prompt_rows: int
    staging_rows: int
    kv_bytes_per_chip: int  # the slots' generated cache + the prompt store + staging, per chip
    weight_bytes_per_chip: int  # the placed weights + the fused decode copy, per chip
    resident_bytes_per_chip: int  # weights + the carry and store (every buffer the loop keeps)
    decode: dict[str, int]  # memory_analysis of decode_slots (argument/output/alias/temp/peak)
    prefill: dict[str, int]
    decode_flops_per_chip: float  # one decode step's loop body, as the compiler counts it
    compile_seconds: float
    chip_memory_bytes: int | None

    @property
    def peak_bytes(self) -> int:
        """What stays resident plus the larger program's own addition (jit leaves the unused
        weights out of a program's arguments: they are resident all the same)."""
        added = max(p["peak"] - p["argument"] for p in (self.decode, self.prefill))
        return self.resident_bytes_per_chip + added

    @property
    def fits(self) -> bool | None:
        return None if self.chip_memory_bytes is None else self.peak_bytes <= self.chip_memory_bytes


def _memory(compiled: Any) -> dict[str, int]:
    m = compiled.memory_analysis()
    mem = ProgramMemory(int(m.argument_size_in_bytes), int(m.output_size_in_bytes),
                        int(m.alias_size_in_bytes), int(m.temp_size_in_bytes))
    return dict(argument=mem.argument, output=mem.output, alias=mem.alias, temp=mem.temp,
                peak=mem.peak)


def _abstract(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        tree, shardings)


def _chip_bytes(tree: Any) -> int:
    """Bytes of `tree`'s shards on one chip (a typed PRNG key counts its key data)."""
    def item(a: Any) -> int:
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            return 4 * int(math.prod(jax.eval_shape(jax.random.key_data, jax.random.key(0)).shape))
        return np.dtype(a.dtype).itemsize
    return sum(int(math.prod(a.sharding.shard_shape(a.shape))) * item(a)
               for a in jax.tree.leaves(tree))


def make_sampler_plan(config: Any, decoder: Any, mesh: Any, chip_memory: int | None, *,
                      layout: DecodeLayout | None = None, prompt_rows: int | None = None,
                      refill_slots: int | None = None) -> SamplerPlan:
    """Compile the sampler's decode and prefill programs for `mesh` (the sampler's devices)
    and the model `decoder` (a `DecoderConfig`); `config` gives the generate/plan keys.
    `layout` (default: the sampler's own, `layout.from_mesh`), `prompt_rows` and
    `refill_slots` (`ContinuousSampler`'s) are for benchmarks that compare layouts."""
    g = config.generate
    if layout is None:
        layout = from_mesh(mesh, decoder.num_kv_heads, data=g.decode_data,
                           tensor=g.decode_tensor, placed=True)
    prompt_len = config.plan.sampler_prompt_len or max(
        1, config.train.max_seq_len - g.max_new_tokens)
    slots = -(-g.batch_size * g.n // layout.groups) * layout.groups
    dtype = decoder.compute_jnp_dtype
    with attention_mesh(layout.mesh):  # "auto" choices resolve for the target's platform
        with nnx.use_eager_sharding(False):
            model = nnx.eval_shape(lambda: Decoder(decoder, rngs=nnx.Rngs(0)))
        graphdef, state = nnx.split(model)
        state = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(
                a.shape, dtype if castable(a, jax.numpy.dtype(dtype)) else a.dtype, sharding=s),
            state, state_shardings(state, layout.mesh, DECODE_PARAM_RULES))
        model = nnx.merge(graphdef, state)
        sampler = ContinuousSampler(model, slots=slots, batch_size=g.batch_size,
                                    prefill_chunk=g.prefill_chunk, decode_layout=layout,
                                    prompt_rows=prompt_rows, refill_slots=refill_slots)
        size = sampler.layout([[0] * prompt_len], g.n)
        width, cache_dtype = size["width"], jax.numpy.dtype(dtype)
        gen = window_ends(g.max_new_tokens, sampler.cache_windows)[-1]  # the widest window
        start = time.perf_counter()
        layer_params = None
        if layout.tensor == 1:
            fused = fused_layer_params.lower(graphdef, state).compile()
            layer_params = _abstract(jax.eval_shape(fused_layer_params, graphdef, state),
                                     fused.output_shardings)
        key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
        init = lambda key: init_slots(
            model, slots=slots, gen_len=gen, cache_dtype=cache_dtype,
            max_new=g.max_new_tokens, vocab=0, pad_token_id=0, key=key, return_logits=False,
            staging=init_staging(model, size["staging"], width, cache_dtype))
        carry_shape = jax.eval_shape(init, key)
        carry = _abstract(carry_shape, layout.shardings(carry_shape))
        store_shape = jax.eval_shape(lambda: init_store(model, size["rows"], width, cache_dtype))
        store = _abstract(store_shape, layout.shardings(store_shape))
        scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype)
        program = Program(g.max_new_tokens, g.n, g.temperature == 0, g.top_k, g.top_p < 1)
        decode = decode_slots.lower(
            graphdef, state, layer_params, carry, store, scalar(np.int32), scalar(np.int32),
            scalar(np.float32), scalar(np.float32), jax.ShapeDtypeStruct((1,), np.int32),
            program=program, pad_token_id=0, return_logits=False, chunk=size["chunk"],
            layout=layout).compile()
        prefill = prefill_staging.lower(graphdef, state, layer_params, carry["staging"],
                                        chunk=size["chunk"], layout=layout).compile()
        seconds = time.perf_counter() - start
    cost = decode.cost_analysis()
    cost = (cost[0] if cost else {}) if isinstance(cost, (list, tuple)) else cost
    kv = _chip_bytes([carry["state"]["own"], carry["staging"]["cache"].k,
                      carry["staging"]["cache"].v, store["k"], store["v"]])
    weights = _chip_bytes(state) + (0 if layer_params is None else _chip_bytes(layer_params))
    return SamplerPlan(
        devices=layout.devices, layout=layout.describe(), groups=layout.groups,
        tensor=layout.tensor, slots=slots, prompt_width=width, max_new_tokens=g.max_new_tokens,
        prompt_rows=size["rows"], staging_rows=size["staging"], kv_bytes_per_chip=kv,
        weight_bytes_per_chip=weights,
        resident_bytes_per_chip=weights + _chip_bytes(carry) + _chip_bytes(store),
        decode=_memory(decode), prefill=_memory(prefill),
        decode_flops_per_chip=float(cost.get("flops", float("nan"))), compile_seconds=seconds,
        chip_memory_bytes=chip_memory)


def format_sampler_plan(plan: SamplerPlan) -> str:
    """The report's sampler section."""
    gib = lambda b: f"{b / GIB:.2f} GiB"
    lines = [
        "sampler (the continuous sampler's own decode and prefill programs):",
        f"  layout             {plan.layout}",
        f"  slots              {plan.slots} ({plan.slots // plan.groups} per slot group), "
        f"prompt width {plan.prompt_width}, {plan.max_new_tokens} new tokens, "
        f"{plan.prompt_rows} store rows, {plan.staging_rows} staged",
        f"  KV cache per chip  {gib(plan.kv_bytes_per_chip)}",
        f"  weights per chip   {gib(plan.weight_bytes_per_chip)} (decode layout and dtype"
        + (", with the fused copy)" if plan.tensor == 1 else ")"),
        f"  peak per chip      {gib(plan.peak_bytes)} (resident {gib(plan.resident_bytes_per_chip)}"
        f"; decode temporaries {gib(plan.decode['temp'])}, prefill temporaries "
        f"{gib(plan.prefill['temp'])})",
        f"  compile            {plan.compile_seconds:.1f} s",
    ]
    if plan.chip_memory_bytes is not None:
        room = plan.chip_memory_bytes - plan.peak_bytes
        lines.append(f"  headroom           {gib(room)} of {gib(plan.chip_memory_bytes)} per chip"
                     + ("" if room >= 0 else "  DOES NOT FIT"))
    return "\n".join(lines) + "\n"
