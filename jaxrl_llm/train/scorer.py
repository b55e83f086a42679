"""The sharded scorer of the score pass (`train.score`): per-token log-probs of this process's
rows at the sampling temperature (μ) and at T = 1 (π_ref), from one forward pass of the train
step's own `forward` on the training mesh (docs/architecture.md § Why μ is re-scored)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm.core.errors import ConfigError
from jaxrl_llm.data.collate import collate, record_row
from jaxrl_llm.data.records import Record
from jaxrl_llm.losses.logprobs import token_logprobs
from jaxrl_llm.parallel.context import load_balance_order, padded_length, restore_order
from jaxrl_llm.parallel.memory import (
    InsufficientMemory,
    available_memory,
    describe,
    fits,
    program_memory,
)
from jaxrl_llm.parallel.mesh import AxisSizes, batch_axes, batch_shards, context_shards, make_mesh
from jaxrl_llm.parallel.rules import batch_spec, state_shardings
from jaxrl_llm.sampling.sampler import default_bucket  # the sampler's padded-length buckets
from jaxrl_llm.train.forward import forward
from jaxrl_llm.train.state import split_model

BATCH_SIZE_KEY = "generate.score_batch_size"
# π_ref's log-probs are the policy's own distribution: DPO (arXiv:2305.18290), KTO
# (arXiv:2402.01306), A*-PO (arXiv:2505.20686) and FPA's KL term compare log π and log π_ref
# at temperature 1, whatever temperature sampled the data.
REF_TEMPERATURE = 1.0


def default_mesh(devices: Sequence[Any] | None = None) -> Mesh:
    """A data-parallel ("data", "fsdp", "tensor") = (n, 1, 1) mesh over `devices`.

    Default: one device in a single-process run (the score pass's historical behaviour), every
    device of the job in a multi-process one (a mesh must span all processes).
    """
    if devices is None:
        devices = jax.devices() if jax.process_count() > 1 else jax.devices()[:1]
    return make_mesh(AxisSizes(data=-1, fsdp=1, tensor=1), list(devices))


def _local_rows(array: jax.Array) -> np.ndarray:
    """This process's rows of a row-sharded global array, in global row order."""
    parts: dict[int, Any] = {}
    for shard in array.addressable_shards:
        parts.setdefault(shard.index[0].start or 0, shard.data)  # "tensor" replicas: keep one
    return np.concatenate([np.asarray(parts[start]) for start in sorted(parts)])


def process_rows(mesh: Mesh, batch_size: int) -> int:
    """Rows this process feeds per call of a global batch of `batch_size` rows on `mesh`.

    Raises `ConfigError` naming `generate.score_batch_size` / `mesh.*` when the rows do not
    split over the mesh, or when processes would share rows (a "tensor" axis across hosts).
    """
    shards = batch_shards(mesh)
    if batch_size % shards:
        raise ConfigError(
            f"{BATCH_SIZE_KEY}={batch_size} must be a multiple of the mesh's "
            f"{'×'.join(batch_axes(mesh))} = "
            f"{shards} (mesh {dict(mesh.shape)}): the score pass splits each batch's rows over "
            "those axes like the train step")
    index_map = NamedSharding(mesh, P(batch_axes(mesh))).devices_indices_map((batch_size, 1))
    owned = {index[0].indices(batch_size) for device, index in index_map.items()
             if device.process_index == jax.process_index()}
    rows = sum(len(range(*s)) for s in owned)
    if rows * jax.process_count() != batch_size:
        raise ConfigError(
            f"mesh {dict(mesh.shape)}: this process holds {rows} of {batch_size} rows over "
            f"{jax.process_count()} processes; multi-process scoring needs every process to own "
            "distinct rows (keep mesh.tensor within one host)")
    return rows


class Scorer:
    """`(inputs, targets, positions, segment_ids) -> (mu, ref)` log-probs of this process's rows.

    `mu` is at the scoring `temperature` (μ, docs/architecture.md § Why μ is re-scored) and `ref` at temperature 1 — the model
    scored is the initial policy, i.e. the reference π_ref of the KL/preference losses —
    both from the same forward pass (the same hidden states, two log-softmaxes; one when
    the temperature is 1). The parameters live on `mesh` with the trainer's sharding rules
    (`self.params`), the other variables too (a LoRA model's frozen base), as in
    `train.state.create_train_state`; a LoRA model's `ref` is its base (adapters off). Each
    call takes this process's rows `[local_rows, T]` of a global batch of `batch_size` rows
    and returns their float32 log-probs; all processes must call it together with the same T.
    `routing` (a mixture of experts' routing replay, `model.routing_replay: sampler`): each
    call also takes the rows' experts [local_rows, T, L, k] (`Batch.routing`), which μ's
    forward replays; π_ref's (a LoRA base's) routes by its own routers.
    """

    def __init__(self, model: Any, *, temperature: float, chunk_size: int, mesh: Mesh,
                 routing: bool = False) -> None:
        graphdef, params, rest = split_model(model)
        self.mesh = mesh
        self.model_config = getattr(model, "config", None)  # routing shapes (L, k)
        self.params = jax.tree.map(jax.device_put, params, state_shardings(params, mesh))
        # Sharded like parameters: with LoRA the frozen base weights are in `rest`.
        self.model_state = jax.tree.map(jax.device_put, rest, state_shardings(rest, mesh))
        lora = getattr(getattr(model, "config", None), "lora", None) is not None
        self.rows = NamedSharding(mesh, P(batch_axes(mesh)))
        # inputs: rows over the batch axes and, on a "context" axis, tokens over it (in the
        # load-balanced order, `parallel/context.py`); outputs come back whole along T
        self.tokens = NamedSharding(mesh, batch_spec("inputs", 2, mesh))
        self.context = context_shards(mesh)
        self.routing = routing
        if routing and self.context > 1:
            raise ConfigError("model.routing_replay=sampler cannot score with mesh.context > 1 "
                              "(the replayed experts ride in the natural token order)")

        def score(params, model_state, inputs, targets, positions, segment_ids, routing=None):
            hidden, unembed, softcap = forward(graphdef, params, model_state, inputs, positions,
                                               segment_ids, mesh, routing=routing)
            # No-op whenever the trainer itself runs (it requires equal dtypes).
            unembed = unembed.astype(hidden.dtype)

            def logprobs(t: float) -> jax.Array:
                return token_logprobs(hidden, unembed, targets, chunk_size=chunk_size,
                                      temperature=t, softcap=softcap)

            mu = logprobs(temperature)
            if lora:  # π_ref of a LoRA policy is its base: the adapters off (B = 0)
                ref_h, ref_u, _ = forward(graphdef, jax.tree.map(jax.numpy.zeros_like, params),
                                          model_state, inputs, positions, segment_ids, mesh)
                return mu, token_logprobs(ref_h, ref_u.astype(ref_h.dtype), targets,
                                          chunk_size=chunk_size, temperature=REF_TEMPERATURE,
                                          softcap=softcap)
            return mu, (mu if temperature == REF_TEMPERATURE else logprobs(REF_TEMPERATURE))

        self._score = jax.jit(score, out_shardings=(self.rows, self.rows))  # T whole

    def check_memory(self, batch_size: int, length: int) -> None:
        """Compile the pass for its largest batch (`batch_size` global rows of `length`
        tokens: jit's cache keeps it for the calls) and refuse it when it would not fit in the
        memory left (`parallel/memory.py`), naming `generate.score_batch_size`."""
        length = padded_length(length, self.context)
        spec = jax.ShapeDtypeStruct((batch_size, length), np.int32, sharding=self.tokens)
        routing = None
        if self.routing:
            c = self.model_config
            routing = jax.ShapeDtypeStruct((batch_size, length, c.num_layers,
                                            c.num_experts_per_tok), np.int16, sharding=self.rows)
        compiled = self._score.lower(self.params, self.model_state, *[spec] * 4,
                                     routing).compile()
        memory = program_memory(compiled, self.mesh)
        available = available_memory(self.mesh.devices.flat[0])
        if not fits(memory, available):
            raise InsufficientMemory(
                f"{describe('the score pass', memory, available)}. It would be killed for lack "
                f"of memory, so it was not started: lower {BATCH_SIZE_KEY} (now {batch_size})")

    def __call__(self, inputs: np.ndarray, targets: np.ndarray, positions: np.ndarray,
                 segment_ids: np.ndarray, routing: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
        local, length = inputs.shape
        if (routing is None) == self.routing:
            raise ValueError(f"Scorer(routing={self.routing}) called with"
                             f"{'out' if routing is None else ''} routing")
        rows = _context_rows([inputs, targets, positions, segment_ids], self.context)
        global_shape = (local * jax.process_count(), rows[0].shape[1])
        arrays = [jax.make_array_from_process_local_data(self.tokens, a, global_shape)
                  for a in rows]
        if routing is not None:
            arrays.append(jax.make_array_from_process_local_data(
                self.rows, routing, (global_shape[0], *routing.shape[1:])))
        mu, ref = self._score(self.params, self.model_state, *arrays)
        return tuple(restore_order(_local_rows(x), self.context)[:, :length] for x in (mu, ref))


def _context_rows(arrays: list[np.ndarray], context: int) -> list[np.ndarray]:
    """Token rows padded (segment 0) to a multiple of 2c and put in the load-balanced order of
    c context shards (`parallel/context.py`); unchanged for c = 1."""
    if context == 1:
        return [np.asarray(a) for a in arrays]
    length = arrays[0].shape[1]
    order = load_balance_order(padded_length(length, context), context)
    return [np.pad(np.asarray(a), ((0, 0), (0, order.size - length)))[:, order] for a in arrays]


def make_scorer(model: Any, *, temperature: float, chunk_size: int = 4096, mesh: Mesh | None = None,
                devices: Sequence[Any] | None = None, routing: bool = False) -> Scorer:
    """A `Scorer` for `model` on `mesh` (docs/architecture.md § Why μ is re-scored).

    `mesh` is normally the training mesh (`parallel.mesh.make_mesh(config.mesh)`); without
    one, `devices` gives a data-parallel mesh over them, and neither gives `default_mesh()`.
    """
    if mesh is not None and devices is not None:
        raise ValueError("make_scorer: pass mesh or devices, not both")
    if mesh is None:
        mesh = default_mesh(devices)
    return Scorer(model, temperature=temperature, chunk_size=chunk_size, mesh=mesh,
                  routing=routing)


def score_batch(scorer: Any, records: Sequence[Record], batch_size: int,
                length: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """(μ, π_ref) log-probs of each record (`Scorer`), each aligned with its completion.

    `records` (possibly none: an all-padding batch keeps processes in lockstep) are padded to
    `batch_size` rows of `length` tokens (default: the power-of-two bucket of the longest).
    The forward pass reads every token, so an episode's environment tokens are context for the
    model tokens after them; the log-probs are kept at model tokens only (`action_mask` 1),
    0.0 at environment tokens, which are never actions (data/records.py).
    """
    replay = getattr(scorer, "routing", False)  # the records' experts, replayed in μ's forward
    rows = [record_row(r, routing=replay, where=f"records[{i}]") for i, r in enumerate(records)]
    if length is None:
        length = default_bucket(max(r["inputs"].size for r in rows))
    batch = collate(rows, batch_size, (length,))
    if replay and batch.routing is None:  # no records (a lockstep padding batch)
        c = scorer.model_config
        batch = batch.replace(routing=np.full((batch_size, length, c.num_layers,
                                               c.num_experts_per_tok), -1, np.int16))
    routing = {"routing": batch.routing} if replay else {}
    mu, ref = scorer(batch.inputs, batch.targets, batch.positions, batch.segment_ids,
                     **routing)
    out = []
    for i, r in enumerate(records):
        span = slice(r.prompt_ids.size - 1, r.prompt_ids.size - 1 + r.completion_ids.size)
        model = r.model_tokens()
        out.append(tuple(np.where(model, x[i, span], 0.0).astype(np.float32) for x in (mu, ref)))
    return out
