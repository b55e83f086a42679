"""The staleness queue: a FIFO of sampled batches (docs/online.md § Staleness).

Each round appends the batches it sampled; an update takes the oldest batch once the queue
holds more than `staleness` of them, so update u trains on samples drawn by the policy of
update u − staleness (the first `staleness` batches come from the initial policy). The queue
is saved with the checkpoint as JSON (float32 values round-trip exactly through JSON's
shortest float64 repr), so a resumed run trains on the very samples it would have.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl_llm.data.records import Record

_ARRAYS = ("prompt_ids", "completion_ids", "behavior_logprobs", "raw_logprobs", "mu_logprobs")
_INTS = ("prompt_ids", "completion_ids")
_SCALARS = ("reward", "raw_reward", "correct", "invalid", "group_id")


def record_to_json(record: Record) -> dict[str, Any]:
    """The fields training reads, as JSON values."""
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

    def to_json(self) -> list[list[dict[str, Any]]]:
        return [[record_to_json(r) for r in batch] for batch in self._batches]

    @classmethod
    def from_json(cls, staleness: int, rows: list[list[dict[str, Any]]]) -> StalenessQueue:
        return cls(staleness, [[record_from_json(r) for r in batch] for batch in rows])
