"""The continuous sampler's host-side schedule over slot groups (`layout.DecodeLayout`): which
staging row a staged prompt takes, which store row it is committed to, which slot takes which
sample, and which slots go on in the tail. Pure functions of the driver's bookkeeping.

Every table is group-major: slots [g·R/G, (g+1)·R/G), store rows [g·K/G, (g+1)·K/G) and staging
rows [g·P/G, (g+1)·P/G) belong to group g, and a group's slots only read its own store rows,
which only take its own staged prompts, so no decode step reads across slot shards. With one
group every function is the single-device schedule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def group_of(index: int, total: int, groups: int) -> int:
    """The group of row `index` of a `total`-row group-major table."""
    return index // (total // groups)


def staging_rows(count: int, rows: int, groups: int) -> list[int]:
    """The staging rows of `count` ≤ `rows` staged prompts: dealt round-robin over the groups
    (prompt k to group k mod G), so a short last stage still spreads over every device."""
    per = rows // groups
    if count > rows:
        raise ValueError(f"{count} prompts do not fit {rows} staging rows")
    return [(k % groups) * per + k // groups for k in range(count)]


def commit_rows(held: Sequence[int], staged: dict[int, int], *, staging: int,
                groups: int) -> list[int] | None:
    """A free store row (held[r] < 0) for each staged prompt (staging row → prompt, in order
    of `staged`), in the staging row's own group; None when a group has too few free rows."""
    k_rows = len(held)
    free = [[r for r in range(g * k_rows // groups, (g + 1) * k_rows // groups) if held[r] < 0]
            for g in range(groups)]
    out = []
    for row in staged:
        own = free[group_of(row, staging, groups)]
        if not own:
            return None
        out.append(own.pop(0))
    return out


def assignments(busy: np.ndarray, held: Sequence[int], given: list[int], n: int,
                groups: int) -> list[tuple[int, int, int]]:
    """(slot, store row, sample) for the free slots: in each group, its free slots take the
    next samples of its stored prompts in prompt order (`given[r]`, the samples of row r that
    have had a slot, is advanced)."""
    slots, k_rows = len(busy), len(held)
    plan = []
    for g in range(groups):
        free = [int(s) for s in np.flatnonzero(~busy[g * slots // groups:(g + 1) * slots // groups])]
        free = [g * slots // groups + s for s in free]
        rows = [r for r in range(g * k_rows // groups, (g + 1) * k_rows // groups) if held[r] >= 0]
        taken = 0
        for r in sorted(rows, key=held.__getitem__):
            while given[r] < n and taken < len(free):
                plan.append((free[taken], r, given[r]))
                given[r] += 1
                taken += 1
    return plan


def tail_rows(busy: np.ndarray, groups: int, min_rows: int) -> np.ndarray:
    """The slots to keep once no work waits (group-major, each group's from itself): every
    group keeps its busy slots, padded with its free ones to the same power of two, with at
    least `min_rows` slots in all (few compiled sizes)."""
    per = len(busy) // groups
    parts = [busy[g * per:(g + 1) * per] for g in range(groups)]
    most = max(int(p.sum()) for p in parts)
    size = max(-(-min_rows // groups), 1 << max(0, math.ceil(math.log2(max(most, 1)))))
    size = min(size, per)
    keep = [g * per + np.concatenate([np.flatnonzero(p), np.flatnonzero(~p)])[:size]
            for g, p in enumerate(parts)]
    return np.concatenate(keep)


def default_prompt_rows(slots: int, n: int, staging_rows: int) -> int:
    """Store rows: 3 × the ceil(R/n) prompts that fill the slots, but at most R/2 (the store
    then holds at most half the prompt copies that per-slot caches would) and never fewer
    than ceil(R/n) (so n = 1 gets R rows); plus room for the staged prompts.

    A prompt holds its row until its last sample ends, about H_n (the n-th harmonic number,
    2.7 at n = 8) mean lengths after its first began, so with fewer rows the freed slots wait
    for a row: at 16 slots and n = 8 (SmolLM2, T = 1 until EOS) 4 rows left 27 % of the
    slot-steps idle; 6 to 8 rows ran 13–17 % faster (benchmarks/continuous_batching.py)."""
    full = math.ceil(slots / n)
    return min(3 * full, max(full, slots // 2)) + staging_rows


def version_runs(versions: Sequence[int]) -> list[list[int]]:
    """A sample's per-token weight versions as [version, first token index] at each change
    (JSON-able, short): [3, 3, 7, 7, 7] → [[3, 0], [7, 2]]."""
    runs: list[list[int]] = []
    for t, v in enumerate(int(x) for x in versions):
        if not runs or runs[-1][0] != v:
            runs.append([v, t])
    return runs
