"""A weight version as one part per trainer process (docs/online.md § Pipeline): each process
writes only shards it holds (each shard by one of the processes holding a replica, the
bytes spread over them: every element is written exactly once across the job), in the
sampling dtype; a reader assembles whole arrays from every part.
No process gathers the whole model, the way Orbax/tensorstore checkpoints are written.

A part is a list of leaves `[name, dtype, global shape, [[index, ...], ...]]` (an index is one
`[start, stop]` per dimension) and the shards' raw bytes, concatenated in that order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np

from jaxrl_llm.sampling.layout import castable

Leaf = list[Any]  # [name, dtype, shape, [index, ...]]


def expected_leaves(tree: Any, dtype: Any) -> list[tuple[str, str, list[int]]]:
    """(name, dtype, shape) of every leaf of `tree` as `cast_for_sampling` publishes it."""
    out = []
    for path, a in jax.tree_util.tree_leaves_with_path(tree):
        dt = np.dtype(dtype) if dtype is not None and castable(a, np.dtype(dtype)) else a.dtype
        out.append((jax.tree_util.keystr(path), np.dtype(dt).name, list(a.shape)))
    return out


def _index(index: tuple[slice, ...], shape: Sequence[int]) -> list[list[int]]:
    return [list(s.indices(n)[:2]) for s, n in zip(index, shape, strict=True)]


def _writers(leaves: Sequence[jax.Array]) -> list[dict[str, int]]:
    """Per leaf, {shard index: the process that writes it}: of the processes holding a
    replica, the one with the fewest bytes so far (every process computes the same plan
    from the global sharding, so each shard is written once and the bytes spread over the
    hosts, not all to the hosts of the first data-parallel row)."""
    load: dict[int, int] = {}
    plans = []
    for a in leaves:
        holders: dict[str, set[int]] = {}
        sizes: dict[str, int] = {}
        for device, index in a.sharding.devices_indices_map(a.shape).items():
            box = _index(index, a.shape)
            key = str(box)
            holders.setdefault(key, set()).add(device.process_index)
            sizes[key] = int(np.prod([b - c for c, b in box], dtype=np.int64))
        plan = {}
        for key in sorted(holders):
            writer = min(holders[key], key=lambda p: (load.get(p, 0), p))
            plan[key] = writer
            load[writer] = load.get(writer, 0) + sizes[key] * a.dtype.itemsize
        plans.append(plan)
    return plans


def local_part(tree: Any) -> tuple[list[Leaf], bytes]:
    """This process's part of `tree` (module docstring): the shards `_writers` gives it."""
    flat = jax.tree_util.tree_leaves_with_path(tree)
    me = jax.process_index()
    arrays = [a if isinstance(a, jax.Array) else jax.numpy.asarray(a) for _, a in flat]
    leaves: list[Leaf] = []
    chunks: list[bytes] = []
    for (path, leaf), a, plan in zip(flat, arrays, _writers(arrays), strict=True):
        indices = []
        # a host value (not a global array) is the same on every process: process 0 writes it
        host = not isinstance(leaf, jax.Array)
        for shard in a.addressable_shards if me == 0 or not host else []:
            box = _index(shard.index, a.shape)
            if (host or plan.get(str(box)) == me) and box not in indices:  # once, not per replica
                indices.append(box)
                chunks.append(np.ascontiguousarray(np.asarray(shard.data)).tobytes())
        leaves.append([jax.tree_util.keystr(path), np.dtype(a.dtype).name, list(a.shape),
                       indices])
    return leaves, b"".join(chunks)


def _dtype(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name, name))  # bfloat16 is ml_dtypes'


def assemble(parts: Sequence[tuple[list[Leaf], bytes]], where: str) -> list[np.ndarray]:
    """Whole arrays from every part of a version; `ValueError` (naming `where`, the leaf and
    the cause) when the parts disagree, write a shard twice, or leave elements unwritten.
    Shards are boxes of a sharding's grid, so distinct in-bounds boxes whose sizes add up to
    the array's are exactly a cover (no element mask). A leaf written as one whole shard is
    a view of the payload, not a copy."""
    if not parts:
        raise ValueError(f"{where}: no parts")
    first = parts[0][0]
    offsets = [0] * len(parts)
    out: list[np.ndarray] = []
    for i, (name, dtype, shape, _) in enumerate(first):
        dt = _dtype(dtype)
        pieces: list[tuple[tuple[slice, ...], np.ndarray]] = []
        for p, (leaves, payload) in enumerate(parts):
            if leaves[i][:3] != [name, dtype, shape]:
                raise ValueError(f"{where}: part {p} lists other arrays than part 0 ({name})")
            for index in leaves[i][3]:
                extent = [b - a for a, b in index]
                if len(index) != len(shape) or any(
                        not 0 <= a <= b <= n for (a, b), n in zip(index, shape, strict=True)):
                    raise ValueError(f"{where}: {name} has a shard {index} outside {shape}")
                size = int(np.prod(extent, dtype=np.int64))
                if offsets[p] + size * dt.itemsize > len(payload):
                    raise ValueError(f"{where}: part {p} ends inside {name}")
                data = np.frombuffer(payload, dt, count=size, offset=offsets[p]).reshape(extent)
                offsets[p] += size * dt.itemsize
                pieces.append((tuple(slice(a, b) for a, b in index), data))
        boxes = {tuple((s.start, s.stop) for s in box) for box, _ in pieces}
        if len(boxes) != len(pieces):
            raise ValueError(f"{where}: {name} has an element in two parts' shards")
        covered = sum(d.size for _, d in pieces)
        total = int(np.prod(shape, dtype=np.int64))
        if covered != total:
            raise ValueError(f"{where}: {name} has {total - covered} elements no part wrote "
                             "(a trainer process's part is missing)")
        if len(pieces) == 1:
            out.append(pieces[0][1])
            continue
        array = np.empty(shape, dt)
        for box, data in pieces:
            array[box] = data
        out.append(array)
    for p, (_, payload) in enumerate(parts):
        if offsets[p] != len(payload):
            raise ValueError(f"{where}: part {p} holds {len(payload) - offsets[p]} bytes past "
                             "its last shard")
    return out
