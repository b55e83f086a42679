"""`train.record_trace`: which records each train step consumed, one JSON line per step.

A debug option for data-order audits (the fault-injection tests read it): before step s is
trained, `run_dir/record_trace.jsonl` gets `{"step": s, "records": [digest, ...]}`, one
digest per real record slot of the host batch in slot order (padding slots left out). A
record's digest is `record_digest(prompt_ids ++ completion_ids)`, so a reader identifies the
records from the record files themselves, without trusting the loader's own plan. A run
killed after logging step s but before checkpointing it logs s again when it resumes: the
last line of each step is the one the final parameters saw.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

from jaxrl_llm.core.paths import PathLike, append_text, as_path

TRACE_FILE = "record_trace.jsonl"


def record_digest(tokens: Any) -> str:
    """Digest of one record's tokens (prompt then completion), as int32."""
    return hashlib.sha1(np.asarray(tokens, np.int32).tobytes()).hexdigest()[:16]


def batch_digests(batch: Any) -> list[str]:
    """`record_digest` of every real record slot of a host `Batch` (either layout): slot
    i·k+j is segment j+1 of row i, whose tokens are its inputs plus its last target."""
    inputs, targets = np.asarray(batch.inputs), np.asarray(batch.targets)
    segments, mask = np.asarray(batch.segment_ids), np.asarray(batch.record_mask)
    k = mask.size // inputs.shape[0]
    out = []
    for slot in np.flatnonzero(mask > 0).tolist():
        row, seg = divmod(slot, k)
        where = segments[row] == seg + 1
        out.append(record_digest(np.concatenate([inputs[row][where], targets[row][where][-1:]])))
    return out


class RecordTrace:
    """A `Trainer` batch hook appending each step's record digests to `run_dir/TRACE_FILE`
    (flushed per step, so a killed run keeps what it logged), then calling `then`."""

    def __init__(self, run_dir: PathLike, then: Any = None) -> None:
        self.path = as_path(run_dir) / TRACE_FILE
        self.then = then

    def __call__(self, step: int, batch: Any) -> None:
        append_text(self.path, json.dumps({"step": int(step), "records": batch_digests(batch)}) + "\n")
        if self.then is not None:
            self.then(step, batch)
