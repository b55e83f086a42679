"""The training batch: a frozen pytree with explicit names (docs/architecture.md § Contracts).

Token arrays are [B, T] rows, aligned to *targets*: position t holds the token predicted at t,
so `log π(targets[:, t] | inputs[:, :t+1])` is the per-token log-prob and `loss_mask[:, t]` is
1 exactly on the completion's model tokens (docs/kernels.md notation): every completion token
of a single-turn record, the `Record.action_mask` ones of a multi-turn episode, whose
environment tokens are context only. Per-token log-prob arrays follow the same alignment.

Two layouts, told apart by the static `records_per_row` k = len(rewards) / B:

- k = 1 (unpacked): one row is one record (prompt + completion), left-aligned and
  right-padded; per-record arrays are [B].
- k > 1 (packed, `data.pack`): a row holds up to k records one after the other, record j+1
  of row i on the tokens with `segment_ids[i] == j+1` (0 = padding) and `positions`
  restarting at 0 in each segment. Per-record arrays are [B·k]: slot `i·k + j` is the record
  with segment id j+1 of row i (`record_mask` 0 for empty slots). Contiguous row blocks
  therefore own contiguous record blocks, so micro-batch splitting and batch sharding keep
  rows and their records together. `records_view` gives the loss kernels a per-record
  [B·k, T] view of any per-token array.

Preference losses use the rows: `pair_index[p] = (chosen_row, rejected_row)` (unpacked only:
`LossSpec.needs_pairs` in losses/registry.py refuse packing).

Token order, the static `context_order` c (pytree aux data, not an array: a batch in another
order is another jit signature, never mixed into one program): 1 = each row's tokens in their
natural order, c > 1 = in the load-balanced order of c context shards
(`parallel.context.load_balance_order`), the order a mesh with `mesh.context` = c trains on.
`collate` builds natural batches; `parallel.context.reorder_batch` (through
`parallel.distributed.global_batch*`, `Policy.batch`) puts one in a mesh's order and records
it here; the train step refuses a batch whose order is not its mesh's (`check_order`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

# The [B, T] per-token fields (the rest are per-record [B·k], or `pair_index`): split over
# "context" as well as the rows under context parallelism (parallel/context.py).
TOKEN_FIELDS = ("inputs", "targets", "positions", "segment_ids", "loss_mask",
                "behavior_logprobs", "mu_logprobs", "ref_logprobs")


@struct.dataclass
class Batch:
    inputs: jax.Array  # [B, T] int32 model input tokens
    targets: jax.Array  # [B, T] int32 next tokens (inputs shifted left by one)
    positions: jax.Array  # [B, T] int32 RoPE positions (restart at 0 in each packed segment)
    segment_ids: jax.Array  # [B, T] int32, 0 = padding, 1.. = record within the row
    loss_mask: jax.Array  # [B, T] float32, 1 on completion targets the model sampled
    behavior_logprobs: jax.Array  # [B, T] float32, what the sampler reported (0 where masked)
    mu_logprobs: jax.Array  # [B, T] float32, re-scored behaviour log-probs (docs/architecture.md § Why μ is re-scored)
    ref_logprobs: jax.Array  # [B, T] float32, frozen reference model (0 when unused)
    rewards: jax.Array  # [B·k] float32 (k = records_per_row; slot i·k+j = segment j+1 of row i)
    correct: jax.Array  # [B·k] bool
    group_ids: jax.Array  # [B·k] int32, records of one prompt share it
    record_mask: jax.Array  # [B·k] float32, 0 for padding rows / empty record slots
    pair_index: jax.Array  # [P, 2] int32 (chosen row, rejected row); P may be 0
    # [B, T, L, k] int16: the experts each input token is routed to (a mixture of experts'
    # routing replay, data/routing.py; -1: the model's own routing); None: no replay
    routing: jax.Array | None = None
    # static: 1 = natural token order, c > 1 = load-balanced for c context shards (docstring)
    context_order: int = struct.field(pytree_node=False, default=1)

    @property
    def batch_size(self) -> int:
        """Rows B (not records: see `records_per_row`)."""
        return int(self.inputs.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.inputs.shape[1])

    @property
    def records_per_row(self) -> int:
        """k: record slots per row (static: a shape ratio); 1 = unpacked."""
        return int(self.rewards.shape[0]) // self.batch_size

    def check_shapes(self) -> None:
        """chex shape/dtype checks; call outside jit on host batches and inside on tracers."""
        b, t = self.inputs.shape
        chex.assert_shape(
            [self.targets, self.positions, self.segment_ids, self.loss_mask,
             self.behavior_logprobs, self.mu_logprobs, self.ref_logprobs],
            (b, t),
        )
        n = self.rewards.shape[0] if jnp.ndim(self.rewards) == 1 else -1
        if n <= 0 or n % b:
            raise ValueError(
                f"Batch.rewards has shape {jnp.shape(self.rewards)}: per-record arrays must be "
                f"[B·k] with B = {b} rows and k ≥ 1 records per row"
            )
        chex.assert_shape([self.rewards, self.correct, self.group_ids, self.record_mask], (n,))
        chex.assert_rank(self.pair_index, 2)
        chex.assert_type([self.inputs, self.targets, self.positions, self.segment_ids], jnp.int32)
        if self.routing is not None:
            chex.assert_rank(self.routing, 4)
            chex.assert_shape(self.routing, (b, t, None, None))


def array_fields(batch: Any) -> tuple[str, ...]:
    """The array fields of a `Batch` (or any flax struct, instance or class), in order: every
    field but the static ones (`context_order`) and, on an instance, those it leaves None (a
    batch without `routing`)."""
    is_class = isinstance(batch, type)
    return tuple(f.name for f in dataclasses.fields(batch)
                 if f.metadata.get("pytree_node", True)
                 and (is_class or getattr(batch, f.name) is not None))


def records_view(x: jax.Array, segment_ids: jax.Array, records_per_row: int) -> jax.Array:
    """Per-record view [B·k, T] of a per-token array `x [B, T]` over packed rows.

    `view[i·k + j, t] = x[i, t] · [segment_ids[i, t] == j+1]`: record slot i·k+j sees only its
    own segment's tokens, so a loss kernel's masked sums over a view row are exactly that
    record's sums (`log π(y|x)`, `|y|` of docs/kernels.md notation). Pure and jit-able; the gradient of `x` is
    the views' gradients summed back into their segments.
    """
    b, t = x.shape
    chex.assert_shape(segment_ids, (b, t))
    ids = jnp.arange(1, records_per_row + 1, dtype=segment_ids.dtype)
    own = segment_ids[:, None, :] == ids[None, :, None]  # [B, k, T]
    # `where`, not a product: padding may hold inf/NaN, which must not leak into other slots.
    view = jnp.where(own, x[:, None, :], jnp.zeros((), x.dtype))
    return view.reshape(b * records_per_row, t)


def token_record_mask(batch: Batch) -> jax.Array:
    """[B, T]: each token's record weight `record_mask[slot of its segment]` (0 on padding).

    Unpacked (k = 1) this is `record_mask[:, None]` broadcast over the row, as before.
    """
    k = batch.records_per_row
    if k == 1:
        return jnp.broadcast_to(batch.record_mask[:, None], batch.segment_ids.shape)
    per_row = batch.record_mask.reshape(batch.batch_size, k)
    slot = jnp.clip(batch.segment_ids - 1, 0, k - 1)
    weight = jnp.take_along_axis(per_row, slot, axis=1)
    return jnp.where(batch.segment_ids > 0, weight, jnp.zeros((), weight.dtype))


def empty_pairs() -> np.ndarray:
    """A `pair_index` with no pairs (non-preference batches)."""
    return np.zeros((0, 2), np.int32)
