"""Host-side pair sampling for the pairwise preference losses (DPO, RPO).

`make_pairs` builds `Batch.pair_index` from a batch's (or a dataset's) group ids and
correctness with NumPy on the host; the kernels in `losses/preference.py` only read it.
Pairs follow TOPR arXiv:2503.14286 §4.3 (correct × incorrect per prompt, capped at 16).
"""

from __future__ import annotations

import numpy as np

from jaxrl_llm.losses.preference import MAX_PAIRS_PER_PROMPT

__all__ = ["MAX_PAIRS_PER_PROMPT", "make_pairs"]


def make_pairs(
    group_ids,
    correct,
    *,
    max_pairs_per_prompt: int = MAX_PAIRS_PER_PROMPT,
    seed: int = 0,
    record_mask=None,
    pad_to: int | None = None,
) -> np.ndarray:
    """All (correct, incorrect) row pairs within each prompt, capped per prompt.

    **(choice)** of docs/kernels.md § Preference losses, after TOPR §4.3: every correct × incorrect pair of a group, and when a
    group has more than `max_pairs_per_prompt` (16) a uniform sample of that many without
    replacement, drawn from a generator seeded by `(seed, group id)` so a prompt's pairs do not
    depend on the rest of the batch. Groups appear in order of first row; pairs are in row
    order. Returns `int32 [P, 2]` (chosen row, rejected row); with `pad_to` the result has
    exactly `pad_to` rows, padded with `-1` (more pairs than `pad_to` is an error).
    """
    group_ids = np.asarray(group_ids)
    correct = np.asarray(correct)
    if group_ids.ndim != 1:
        raise ValueError(f"make_pairs: group_ids must have shape [B], got {group_ids.shape}")
    if correct.shape != group_ids.shape:
        raise ValueError(
            f"make_pairs: correct must have the shape of group_ids {group_ids.shape}, "
            f"got {correct.shape}"
        )
    if not np.issubdtype(group_ids.dtype, np.integer):
        raise ValueError(f"make_pairs: group_ids must be integers, got dtype {group_ids.dtype}")
    if int(max_pairs_per_prompt) < 1:
        raise ValueError(f"make_pairs: max_pairs_per_prompt must be ≥ 1, got {max_pairs_per_prompt}")
    if int(seed) < 0:
        raise ValueError(f"make_pairs: seed must be a non-negative integer, got {seed}")
    valid = np.ones(group_ids.shape, bool)
    if record_mask is not None:
        record_mask = np.asarray(record_mask)
        if record_mask.shape != group_ids.shape:
            raise ValueError(
                f"make_pairs: record_mask must have shape {group_ids.shape}, got {record_mask.shape}"
            )
        valid = record_mask > 0
    correct = correct.astype(bool)
    rows = np.flatnonzero(valid)
    ids, first, inverse = np.unique(group_ids[rows], return_index=True, return_inverse=True)
    chunks = []
    for g in np.argsort(first, kind="stable"):
        members = rows[inverse == g]
        good, bad = members[correct[members]], members[~correct[members]]
        if good.size == 0 or bad.size == 0:
            continue
        pairs = np.stack(np.meshgrid(good, bad, indexing="ij"), axis=-1).reshape(-1, 2)
        if len(pairs) > max_pairs_per_prompt:
            rng = np.random.default_rng([int(seed), int(ids[g]) & 0xFFFFFFFF])
            keep = np.sort(rng.choice(len(pairs), int(max_pairs_per_prompt), replace=False))
            pairs = pairs[keep]
        chunks.append(pairs)
    out = np.concatenate(chunks).astype(np.int32) if chunks else np.zeros((0, 2), np.int32)
    if pad_to is not None:
        if len(out) > pad_to:
            raise ValueError(
                f"make_pairs: {len(out)} pairs do not fit pad_to={pad_to}; raise pad_to or lower "
                f"max_pairs_per_prompt ({max_pairs_per_prompt})"
            )
        out = np.concatenate([out, np.full((pad_to - len(out), 2), -1, np.int32)])
    return out
