"""The staleness queue: a FIFO of sampled batches (docs/online.md § Staleness).

Each round appends the batches it sampled; an update takes the oldest batch once the queue
holds more than `staleness` of them, so update u trains on samples drawn by the policy of
update u − staleness (the first `staleness` batches come from the initial policy). The queue
is saved with the checkpoint as its own item (`QUEUE_ITEM`, committed with the step) in the
record codec of the exchange's round shards (`records.pack_batches`: every field, metadata
such as in-flight `weight_versions` included), so a resumed run trains on the very records
it would have, bit for bit. Checkpoints written before that hold the queue as JSON number
lists in their meta (`to_json`: the fields training reads, no text or metadata); they still
resume (`from_checkpoint`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl_llm.data.records import Record, pack_batches, unpack_batches

QUEUE_ITEM = "queue"  # the checkpoint item (train/checkpoint.py `blobs`) holding the queue

_ARRAYS = ("prompt_ids", "completion_ids", "behavior_logprobs", "raw_logprobs", "mu_logprobs")
_INTS = ("prompt_ids", "completion_ids")
_SCALARS = ("reward", "raw_reward", "correct", "invalid", "group_id")


def record_to_json(record: Record) -> dict[str, Any]:
    """The fields training reads, as JSON values (the queue's format in checkpoints before
    `QUEUE_ITEM`: read back by `from_checkpoint`, and the benchmark's baseline)."""
    out: dict[str, Any] = {name: getattr(record, name) for name in _SCALARS}
    for name in _ARRAYS:
        value = getattr(record, name)
        out[name] = None if value is None else np.asarray(value).tolist()
    return out


def record_from_json(row: dict[str, Any]) -> Record:
    kwargs = {name: row[name] for name in _SCALARS}
    for name in _ARRAYS:
        value = row[name]
        dtype = np.int32 if name in _INTS else np.float32
        kwargs[name] = None if value is None else np.asarray(value, dtype)
    return Record(**kwargs)


class StalenessQueue:
    """FIFO of batches (lists of records) with the staleness rule of the module docstring."""

    def __init__(self, staleness: int, batches: Sequence[Sequence[Record]] = ()) -> None:
        if staleness < 0:
            raise ValueError(f"online.staleness={staleness} must be >= 0")
        self.staleness = staleness
        self._batches: deque[list[Record]] = deque(list(b) for b in batches)

    def __len__(self) -> int:
        return len(self._batches)

    def push(self, batch: Sequence[Record]) -> None:
        self._batches.append(list(batch))

    def ready(self) -> bool:
        """An update is due: more than `staleness` batches are waiting."""
        return len(self._batches) > self.staleness

    def pop(self) -> list[Record]:
        if not self.ready():
            raise IndexError(f"{len(self)} queued batches: none is due at staleness "
                             f"{self.staleness}")
        return self._batches.popleft()

    def batches(self) -> list[list[Record]]:
        """The queued batches, oldest first (copies of the lists, the same records)."""
        return [list(b) for b in self._batches]

    def to_bytes(self) -> bytes:
        """The queued batches in the record codec (`records.pack_batches`), bit for bit."""
        return pack_batches(self._batches)

    @classmethod
    def from_bytes(cls, staleness: int, payload: bytes, *, where: str) -> StalenessQueue:
        return cls(staleness, unpack_batches(payload, where=where))

    @classmethod
    def from_checkpoint(cls, staleness: int, payload: bytes | None, meta: dict[str, Any], *,
                        where: str) -> StalenessQueue:
        """The queue a checkpoint saved: its `QUEUE_ITEM` bytes (`payload`), or, for a
        checkpoint from before that item, the JSON lists in its online meta."""
        if payload is not None:
            return cls.from_bytes(staleness, payload, where=where)
        if "queue" in meta:
            return cls.from_json(staleness, meta["queue"])
        raise ValueError(f"{where}: the checkpoint holds no staleness queue (neither the "
                         f"{QUEUE_ITEM!r} item nor a JSON queue in its meta): it was not "
                         "written by `jaxrl-llm online`, or was copied without that item")

    def to_json(self) -> list[list[dict[str, Any]]]:
        return [[record_to_json(r) for r in batch] for batch in self._batches]

    @classmethod
    def from_json(cls, staleness: int, rows: list[list[dict[str, Any]]]) -> StalenessQueue:
        return cls(staleness, [[record_from_json(r) for r in batch] for batch in rows])
