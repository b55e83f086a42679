"""The training batch: a frozen pytree with explicit names (DESIGN "Batches").

One row is one record (prompt + completion), left-aligned and right-padded to a static length.
Token arrays are aligned to *targets*: position t holds the token predicted at t, so
`log π(targets[:, t] | inputs[:, :t+1])` is the per-token log-prob and `loss_mask[:, t]` is 1
exactly on completion tokens (SPEC §0). Per-token log-prob arrays follow the same alignment.

Preference losses use the same rows: `pair_index[p] = (chosen_row, rejected_row)`.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class Batch:
    inputs: jax.Array  # [B, T] int32 model input tokens
    targets: jax.Array  # [B, T] int32 next tokens (inputs shifted left by one)
    positions: jax.Array  # [B, T] int32 RoPE positions (restart at 0 in each packed segment)
    segment_ids: jax.Array  # [B, T] int32, 0 = padding, 1.. = record within the row
    loss_mask: jax.Array  # [B, T] float32, 1 on completion-token targets
    behavior_logprobs: jax.Array  # [B, T] float32, what the sampler reported (0 where masked)
    mu_logprobs: jax.Array  # [B, T] float32, re-scored behaviour log-probs (SPEC §0)
    ref_logprobs: jax.Array  # [B, T] float32, frozen reference model (0 when unused)
    rewards: jax.Array  # [B] float32
    correct: jax.Array  # [B] bool
    group_ids: jax.Array  # [B] int32, records of one prompt share it
    record_mask: jax.Array  # [B] float32, 0 for padding rows added to fill a batch
    pair_index: jax.Array  # [P, 2] int32 (chosen row, rejected row); P may be 0

    @property
    def batch_size(self) -> int:
        return int(self.inputs.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.inputs.shape[1])

    def check_shapes(self) -> None:
        """chex shape/dtype checks; call outside jit on host batches and inside on tracers."""
        b, t = self.inputs.shape
        chex.assert_shape(
            [self.targets, self.positions, self.segment_ids, self.loss_mask,
             self.behavior_logprobs, self.mu_logprobs, self.ref_logprobs],
            (b, t),
        )
        chex.assert_shape([self.rewards, self.correct, self.group_ids, self.record_mask], (b,))
        chex.assert_rank(self.pair_index, 2)
        chex.assert_type([self.inputs, self.targets, self.positions, self.segment_ids], jnp.int32)


def empty_pairs() -> np.ndarray:
    """A `pair_index` with no pairs (non-preference batches)."""
    return np.zeros((0, 2), np.int32)
