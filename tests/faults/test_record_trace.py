"""`train.record_trace`'s digests identify the records a batch holds, in both batch layouts:
one epoch of batches, digested, is exactly the record files' own digests (computed from the
records' tokens, not from the loader)."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from jaxrl_llm.data.loader import make_loader
from jaxrl_llm.data.shards import read_records, write_records
from jaxrl_llm.train.record_trace import TRACE_FILE, RecordTrace, batch_digests
from tests.faults.stages import train_records


def by_hand(record) -> str:
    tokens = list(record.prompt_ids) + list(record.completion_ids)
    return hashlib.sha1(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()[:16]


@pytest.mark.parametrize("layout", [{}, {"pack": True, "records_per_row": 3}])
def test_one_epoch_digests_are_the_records(tmp_path, layout):
    train_records(tmp_path / "recs", 20)
    want = sorted(by_hand(r) for r in read_records(tmp_path / "recs"))
    loader = make_loader(str(tmp_path / "recs"), batch_size=4, max_len=32, num_epochs=1, seed=1,
                         prefetch=0, **layout)
    got = [d for batch in loader for d in batch_digests(batch)]
    assert sorted(got) == want and len(set(got)) == 20


def test_trace_appends_one_line_per_step_then_calls_on(tmp_path):
    train_records(tmp_path / "recs", 8)
    records = read_records(tmp_path / "recs")
    write_records(tmp_path / "one", records[:4], vocab_size=128)
    batch = next(iter(make_loader(str(tmp_path / "one"), batch_size=8, max_len=16, shuffle=False, num_epochs=1,
                                  prefetch=0)))
    seen = []
    trace = RecordTrace(tmp_path / "run", then=lambda step, b: seen.append(step))
    (tmp_path / "run").mkdir()
    trace(1, batch)
    trace(1, batch)  # a replayed step logs again
    rows = [json.loads(x) for x in (tmp_path / "run" / TRACE_FILE).read_text().splitlines()]
    assert rows == [{"step": 1, "records": [by_hand(r) for r in records[:4]]}] * 2  # padding left out
    assert seen == [1, 1]
