"""`Record.routing` (schema version 4, data/routing.py): compact storage, the version rules,
validation naming the record and field, and its place in batch rows (the row alignment
written out by hand here: input position P + j is completion token j)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from jaxrl_llm.data.collate import collate, collate_packed, record_row
from jaxrl_llm.data.records import Record, RecordError, validate_record
from jaxrl_llm.data.routing import routing_dtype


def _record(experts: int = 8, completion: int = 5, seed: int = 0) -> Record:
    rng = np.random.default_rng(seed)
    ids = np.stack([np.stack([rng.permutation(experts)[:2] for _ in range(3)])
                    for _ in range(completion - 1)])  # [C - 1, layers 3, k 2]
    return Record([4, 5, 6], list(range(10, 10 + completion)), reward=1.0,
                  routing=ids.astype(routing_dtype(experts)))


@pytest.mark.parametrize("experts, dtype, itemsize", [(8, np.int8, 1), (127, np.int8, 1),
                                                      (128, np.int16, 2), (300, np.int16, 2)])
def test_routing_round_trips_bit_for_bit_in_its_compact_dtype(experts, dtype, itemsize):
    r = _record(experts)
    payload = msgpack.unpackb(r.to_bytes(), raw=False)
    assert payload["v"] == 4
    stored = payload["routing"]
    assert stored["shape"] == [4, 3, 2] and len(stored["data"]) == 4 * 3 * 2 * itemsize
    back = Record.from_bytes(r.to_bytes())
    assert back.routing.dtype == dtype
    np.testing.assert_array_equal(back.routing, r.routing)
    validate_record(back, where="r")


def test_versions_1_to_3_still_read_and_routing_needs_version_4():
    payload = msgpack.unpackb(_record().to_bytes(), raw=False)
    for version in (3, 2, 1):
        old = {k: v for k, v in payload.items() if k not in ("routing", "action_mask")}
        old["v"] = version
        assert Record.from_bytes(msgpack.packb(old, use_bin_type=True)).routing is None
    payload["v"] = 3  # a version-3 writer never wrote routing: refuse, naming the field
    with pytest.raises(RecordError, match=r"^old\[0\]: field 'routing' in a schema version 3"):
        Record.from_bytes(msgpack.packb(payload, use_bin_type=True), where="old[0]")


@pytest.mark.parametrize("change, message", [
    ({"shape": [4, 3]}, r"field 'routing' has shape \[4, 3\], expected \[tokens, layers, k\]"),
    ({"dtype": "i4"}, r"field 'routing' has dtype 'i4'"),
    ({"data": b"\x00"}, r"field 'routing' holds 1 bytes for shape \[4, 3, 2\]"),
])
def test_a_malformed_routing_payload_is_named(change, message):
    payload = msgpack.unpackb(_record().to_bytes(), raw=False)
    payload["routing"] = {**payload["routing"], **change}
    with pytest.raises(RecordError, match=r"^shard-0\[3\]: " + message):
        Record.from_bytes(msgpack.packb(payload, use_bin_type=True), where="shard-0[3]")


@pytest.mark.parametrize("edit, message", [
    (lambda a: a[:3], r"field 'routing' has shape \(3, 3, 2\); expected \[4, layers, k\]"),
    (lambda a: np.where(np.arange(4)[:, None, None] == 2, -1, a),
     "field .routing. has a negative expert id at completion token 2"),
    (lambda a: np.concatenate([a[..., :1], a[..., :1]], axis=-1),
     "field .routing. routes completion token 0 to one expert twice in layer 0"),
])
def test_validation_names_a_broken_routing(edit, message):
    r = _record()
    bad = r.replace(routing=edit(r.routing).astype(np.int8))
    with pytest.raises(RecordError, match=r"^records\[1\]: " + message):
        validate_record(bad, where="records[1]")


def test_batch_rows_carry_routing_at_the_completion_inputs_only():
    a, b = _record(seed=1), _record(completion=3, seed=2)
    rows = [record_row(r, routing=True) for r in (a, b)]
    batch = collate(rows, 3, (16,))
    assert batch.routing.shape == (3, 16, 3, 2) and batch.routing.dtype == np.int16
    for i, r in enumerate((a, b)):
        p, c = r.prompt_ids.size, r.completion_ids.size
        # inputs = prompt + completion[:-1]; input P + j is completion token j (j < C − 1)
        np.testing.assert_array_equal(batch.inputs[i, p:p + c - 1], r.completion_ids[:-1])
        np.testing.assert_array_equal(batch.routing[i, p:p + c - 1], r.routing)
        assert (batch.routing[i, :p] == -1).all() and (batch.routing[i, p + c - 1:] == -1).all()
    assert (batch.routing[2] == -1).all()  # a padding row
    packed = collate_packed([rows], 1, 16, 2)  # both records in one row, back to back
    start = a.prompt_ids.size + a.completion_ids.size - 1
    np.testing.assert_array_equal(packed.routing[0, :start], batch.routing[0, :start])
    np.testing.assert_array_equal(packed.routing[0, start:start + 7], batch.routing[1, :7])
    # without replay the batch has no routing at all
    assert collate([record_row(a)], 1, (16,)).routing is None


def test_replay_of_a_record_without_routing_names_the_record_and_key():
    plain = Record([1, 2], [3, 4], reward=0.0)
    with pytest.raises(RecordError, match=r"^records\[7\]: no routing .*"
                       r"model.routing_replay=sampler"):
        record_row(plain, routing=True, where="records[7]")
