"""Baselines, group-relative advantages and dataset-composition math (docs/kernels.md § Advantages).

Group representation (one for the whole module): a flat batch of records with
`group_ids [B]` (any int32 ids; the records of one prompt share an id — exactly
`Batch.group_ids`) and `record_mask [B]` (0 for padding rows, which belong to no group).
Ids are compacted with `jnp.unique(..., size=B)` and reduced with `jax.ops.segment_sum`
(`num_segments = B`, static), so groups may be ragged, unsorted and arbitrarily numbered,
and everything stays jit-able with no Python loop over groups.

Group statistics need whole groups: compute advantages on the full batch before splitting
it into micro-batches (or keep each group inside one micro-batch).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def _check_group_inputs(rewards: Array, group_ids: Array, record_mask: Array | None) -> Array:
    """Shape/dtype checks naming the argument; returns the float record mask."""
    rewards = jnp.asarray(rewards)
    group_ids = jnp.asarray(group_ids)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must have shape [B], got {rewards.shape}")
    if group_ids.shape != rewards.shape:
        raise ValueError(
            f"group_ids must have the shape of rewards {rewards.shape}, got {group_ids.shape}"
        )
    if not jnp.issubdtype(group_ids.dtype, jnp.integer):
        raise ValueError(f"group_ids must be integers, got dtype {group_ids.dtype}")
    if not jnp.issubdtype(rewards.dtype, jnp.floating):
        raise ValueError(f"rewards must be floating point, got dtype {rewards.dtype}")
    if record_mask is None:
        return jnp.ones(rewards.shape, rewards.dtype)
    record_mask = jnp.asarray(record_mask)
    if record_mask.shape != rewards.shape:
        raise ValueError(
            f"record_mask must have the shape of rewards {rewards.shape}, got {record_mask.shape}"
        )
    return record_mask.astype(rewards.dtype)


def group_segments(group_ids: Array) -> Array:
    """Dense segment index in [0, B) for each record, from arbitrary int group ids (static
    size: jit-able), for `jax.ops.segment_*` with `num_segments = B`."""
    b = group_ids.shape[0]
    _, inverse = jnp.unique(group_ids, return_inverse=True, size=b, fill_value=0)
    return inverse.reshape(b)


def _group_sum(values: Array, seg: Array) -> Array:
    """Σ over each record's group, broadcast back to the records."""
    sums = jax.ops.segment_sum(values, seg, num_segments=seg.shape[0])
    return sums[seg]


def group_sizes(group_ids: Array, record_mask: Array | None = None) -> Array:
    """Number of (unmasked) records in each record's group, per record [B]."""
    rm = _check_group_inputs(jnp.zeros(jnp.shape(group_ids), jnp.float32), group_ids, record_mask)
    return _group_sum(rm, group_segments(jnp.asarray(group_ids)))


def constant_baseline_advantages(rewards: Array, baseline: float | Array = 0.0) -> Array:
    """`A = R − c` (TOPR arXiv:2503.14286 eq. 9). `baseline` is a scalar or a per-record [B] array."""
    rewards = jnp.asarray(rewards)
    return rewards - jnp.asarray(baseline, rewards.dtype)


def rloo_advantages(
    rewards: Array,
    group_ids: Array,
    record_mask: Array | None = None,
    *,
    singleton_baseline: float | None = None,
) -> Array:
    """Leave-one-out advantages `A_i = R_i − mean_{j≠i, j∈g(i)} R_j` (RLOO, Ahmadian et al. arXiv:2402.14740).

    A group of size 1 has no leave-one-out baseline. With `singleton_baseline=c` such
    records get `R − c`; otherwise concrete (host) inputs raise a ValueError naming the
    group, and traced inputs give NaN for those records — validate with
    `check_group_sizes` at the host boundary before jitting. Padding rows (record_mask 0)
    get advantage 0 and do not enter any baseline.
    """
    rm = _check_group_inputs(rewards, group_ids, record_mask)
    rewards = jnp.asarray(rewards)
    group_ids = jnp.asarray(group_ids)
    if singleton_baseline is None and not isinstance(rewards, jax.core.Tracer):
        check_group_sizes(group_ids, record_mask, min_size=2, why="RLOO leave-one-out")
    seg = group_segments(group_ids)
    r = jnp.where(rm > 0, rewards, 0.0) * rm
    total = _group_sum(r, seg)
    count = _group_sum(rm, seg)
    others = count - rm
    loo_mean = (total - r) / jnp.where(others > 0, others, 1.0)
    fallback = jnp.nan if singleton_baseline is None else singleton_baseline
    adv = jnp.where(others > 0, rewards - loo_mean, rewards - fallback)
    return jnp.where(rm > 0, adv, 0.0)


def grpo_advantages(
    rewards: Array,
    group_ids: Array,
    record_mask: Array | None = None,
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
    ddof: int = 0,
) -> Array:
    """Group-normalised advantages `(R − mean_g R) / (std_g R + eps)` (FPA arXiv:2509.19893 eq. 34).

    `scale_by_std=False` is Dr.GRPO (centring only). **(choice)** `std` is the population
    standard deviation (`ddof=0`, `sqrt(Σ(R − mean)²/n)`); `ddof=1` is the sample std
    `sqrt(Σ(R − mean)²/(n − 1))` that verl, Tunix and TRL use (`torch.std` / `jnp.std(ddof=1)`).
    A single-record group gets advantage 0 with either (its centred reward is 0; the peers
    differ here: torch's std of one value is NaN, and verl sets mean 0, std 1 for it).
    Padding rows get advantage 0 and do not enter the statistics.
    """
    check_ddof(ddof)
    rm = _check_group_inputs(rewards, group_ids, record_mask)
    rewards = jnp.asarray(rewards)
    seg = group_segments(jnp.asarray(group_ids))
    r = jnp.where(rm > 0, rewards, 0.0) * rm
    count = _group_sum(rm, seg)
    safe_count = jnp.maximum(count, 1.0)
    mean = _group_sum(r, seg) / safe_count
    centred = jnp.where(rm > 0, rewards - mean, 0.0)
    if scale_by_std:
        sq = _group_sum(rm * centred**2, seg)
        var = sq / jnp.maximum(count - ddof, 1.0)
        centred = centred / (jnp.sqrt(var) + eps)
    return jnp.where(rm > 0, centred, 0.0)


def check_ddof(ddof: int) -> None:
    """The std's delta degrees of freedom: 0 (population) or 1 (sample, verl/TRL/Tunix)."""
    if isinstance(ddof, bool) or ddof not in (0, 1):
        raise ValueError(f"ddof (loss.std_ddof) must be 0 (population std) or 1 (sample std), "
                         f"got {ddof!r}")


def dr_grpo_advantages(
    rewards: Array, group_ids: Array, record_mask: Array | None = None
) -> Array:
    """Dr.GRPO advantages: group-mean centring without the std division (docs/kernels.md § TOPR family, PPO, GRPO, Off-RL, FPA, KL)."""
    return grpo_advantages(rewards, group_ids, record_mask, scale_by_std=False)


def check_group_sizes(
    group_ids: Array,
    record_mask: Array | None = None,
    *,
    min_size: int = 2,
    why: str = "this advantage estimator",
) -> None:
    """Host-side check: every group with a real record has at least `min_size` records.

    Raises a ValueError naming the offending group ids (the caller-facing guard for RLOO's
    `k = 1` case, docs/kernels.md § TOPR family, PPO, GRPO, Off-RL, FPA, KL).
    """
    ids = np.asarray(group_ids)
    rm = np.ones(ids.shape, bool) if record_mask is None else np.asarray(record_mask) > 0
    uniq, counts = np.unique(ids[rm], return_counts=True)
    small = uniq[counts < min_size]
    if small.size:
        shown = ", ".join(str(int(g)) for g in small[:10])
        raise ValueError(
            f"group_ids: {small.size} group(s) have fewer than {min_size} records ({why} needs "
            f"{min_size}); first ids: {shown}. Configure a constant baseline "
            f"(singleton_baseline) or drop these groups"
        )


def effective_positive_fraction(p: float | Array, c: float | Array) -> Array:
    """Effective fraction of positives under baseline `c`, rewards ±1 (TOPR eq. 12).

    `p̃ = p(1−c) / (1 + (1−2p)c)`; `c = 0` gives `p`, `c = −1` gives 1 (positives only),
    `c = 1` gives 0.
    """
    p = jnp.asarray(p, jnp.float32)
    c = jnp.asarray(c, jnp.float32)
    return p * (1.0 - c) / (1.0 + (1.0 - 2.0 * p) * c)


def baseline_for_fraction(p: float | Array, target: float | Array) -> Array:
    """Baseline `c` giving effective positive fraction `target` (inverse of TOPR eq. 12).

    `c = (p − p̃) / (p + p̃ − 2 p p̃)`; defined for `0 < p < 1` and `0 ≤ p̃ ≤ 1`.
    """
    p = jnp.asarray(p, jnp.float32)
    t = jnp.asarray(target, jnp.float32)
    return (p - t) / (p + t - 2.0 * p * t)
