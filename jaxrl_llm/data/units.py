"""Shuffle units of the loader: single records, DPO pairs, or whole prompt groups.

A unit is a fixed-width row of record indices (−1 = a padding row) that the loader shuffles
and places into a batch as one piece, so what a loss computes over (a pair, a group) is never
split across batches:

- records: width 1;
- pairs (`LossSpec.needs_pairs`): width 2, rows (2i, 2i+1) of a `curate` dpo directory;
- groups (`LossSpec.needs_groups`: GRPO, Dr.GRPO, A*-PO compute group statistics inside the
  batch): one unit per distinct `group_id`, width = the largest group, smaller groups padded.
  The batch (per process) must then be a multiple of that width.

Packing places units atomically too (`pack_batches(..., unit_sizes=)`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class BatchShapeError(ValueError):
    """The batch cannot hold the units whole (batch size vs group size)."""


def record_units(num_records: int, width: int = 1) -> np.ndarray:
    """[N / width, width] consecutive record indices (width 2: the pairs of a dpo directory)."""
    return np.arange(num_records).reshape(-1, width)


def group_units(group_ids: np.ndarray) -> np.ndarray:
    """[G, n_max] record indices of each distinct group id (storage order inside a group,
    groups in order of first appearance), −1-padded to the largest group."""
    group_ids = np.asarray(group_ids)
    _, first, inverse, sizes = np.unique(group_ids, return_index=True, return_inverse=True,
                                         return_counts=True)
    order = np.argsort(first, kind="stable")  # groups in order of first appearance
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    g = rank[inverse.reshape(-1)]
    units = np.full((order.size, int(sizes.max(initial=0))), -1, np.int64)
    by_group = np.argsort(g, kind="stable")
    col = np.arange(group_ids.size) - np.concatenate([[0], np.cumsum(sizes[order])])[g[by_group]]
    units[g[by_group], col] = by_group
    return units


def check_group_batch(batch_size: int, units: np.ndarray) -> None:
    """Refuse a batch size that cannot hold whole groups of `units`' width."""
    width = units.shape[1]
    if width and batch_size % width:
        sizes = np.unique((units >= 0).sum(axis=1))
        raise BatchShapeError(
            f"a batch of {batch_size} rows cannot hold whole groups of {width} records (group "
            f"sizes in the data: {sizes.tolist()}); make the batch a multiple of {width}")


def unit_padding(units: np.ndarray) -> float:
    """Fraction of unit slots that are padding rows (groups smaller than the largest)."""
    return float((units < 0).mean()) if units.size else 0.0


def group_counts(group_ids: np.ndarray, record_mask: np.ndarray,
                 sizes: dict[int, int]) -> tuple[int, int]:
    """(whole, partial): groups of a batch's real records that hold all of their `sizes[g]`
    records of the data set, and those that hold fewer (a split group)."""
    real = np.asarray(record_mask) > 0
    ids, counts = np.unique(np.asarray(group_ids)[real], return_counts=True)
    whole = sum(int(c == sizes.get(int(g), -1)) for g, c in zip(ids, counts))
    return whole, int(ids.size) - whole


def _first_fit(lengths: Sequence[int], free: list[int], count: list[int], k: int
               ) -> list[int] | None:
    """Rows for `lengths` placed one after another first-fit (mutating `free`/`count`), or
    None when one does not fit (then `free`/`count` are left as they were)."""
    free_, count_ = list(free), list(count)
    placed = []
    for n in lengths:
        r = next((r for r in range(len(free_)) if count_[r] < k and free_[r] >= n), None)
        if r is None:
            return None
        placed.append(r)
        count_[r] += 1
        free_[r] -= n
    free[:], count[:] = free_, count_
    return placed


def pack_batches(lengths: Sequence[int] | np.ndarray, *, rows: int, max_len: int,
                 records_per_row: int, unit_sizes: Sequence[int] | None = None) -> np.ndarray:
    """Greedy first-fit packing of a record stream into batches, in stream order.

    `lengths[s]` is the row length of the stream's s-th record (each ≤ `max_len`). Record s
    goes to the first row of the open batch with fewer than `records_per_row` records and at
    least `lengths[s]` free tokens; when no row fits, the batch is closed and s opens the next
    one. With `unit_sizes` (consecutive stream records forming one unit, e.g. a group), a
    unit goes whole into the open batch or whole into the next one. Returns
    `[n_batches, rows, records_per_row]` stream positions in segment order (−1 = empty
    slot). Pure numpy/python, deterministic.
    """
    k = records_per_row
    lengths = [int(x) for x in lengths]
    sizes = [1] * len(lengths) if unit_sizes is None else [int(x) for x in unit_sizes]
    if sum(sizes) != len(lengths):
        raise ValueError(f"pack_batches: unit sizes sum to {sum(sizes)}, not {len(lengths)} records")
    batches: list[np.ndarray] = []
    current = np.full((rows, k), -1, np.int64)
    free, count = [max_len] * rows, [0] * rows
    start = 0
    for size in sizes:
        unit = list(range(start, start + size))
        start += size
        for s in unit:
            if lengths[s] > max_len:
                raise ValueError(f"pack_batches: record {s} has {lengths[s]} tokens > max_len={max_len}")
        placed = _first_fit([lengths[s] for s in unit], free, count, k)
        if placed is None and any(count):
            batches.append(current)
            current = np.full((rows, k), -1, np.int64)
            free, count = [max_len] * rows, [0] * rows
            placed = _first_fit([lengths[s] for s in unit], free, count, k)
        if placed is None:
            raise BatchShapeError(
                f"pack_batches: a unit of {size} records ({[lengths[s] for s in unit]} tokens) "
                f"does not fit one batch of {rows} rows × {k} records × {max_len} tokens")
        for s, r in zip(unit, placed):
            current[r, (current[r] >= 0).sum()] = s
    if any(count):
        batches.append(current)
    return np.stack(batches) if batches else np.zeros((0, rows, k), np.int64)
