"""Records -> shards -> grain -> Batches: nothing lost or duplicated, exact resume, alignment."""

from __future__ import annotations

import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxrl_llm.data.loader import make_loader
from jaxrl_llm.data.records import RecordError
from jaxrl_llm.data.shards import write_records
from tests.data.helpers import make_records

NUM = 29  # not a multiple of batch size or process count


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("records")
    write_records(d, make_records(NUM), records_per_shard=7, vocab_size=50)
    return str(d)


def ids_of(batch) -> list[int]:
    """Record ids (stored in the reward) of the real rows."""
    return [int(r) for r, m in zip(batch.rewards, batch.record_mask) if m > 0]


def test_rows_are_aligned_as_batch_py_documents(shard_dir):
    records = make_records(NUM)
    loader = make_loader(shard_dir, batch_size=4, max_len=16, shuffle=False, num_epochs=1, prefetch=0)
    for batch in loader:
        batch.check_shapes()
        for row in range(batch.batch_size):
            if batch.record_mask[row] == 0:
                assert batch.loss_mask[row].sum() == 0 and batch.segment_ids[row].sum() == 0
                continue
            r = records[int(batch.rewards[row])]
            tokens = np.concatenate([r.prompt_ids, r.completion_ids])
            n, p, c = tokens.size - 1, r.prompt_ids.size, r.completion_ids.size
            np.testing.assert_array_equal(batch.inputs[row, :n], tokens[:-1])
            np.testing.assert_array_equal(batch.targets[row, :n], tokens[1:])
            # loss_mask[t] = 1 exactly when targets[t] is a completion token.
            np.testing.assert_array_equal(np.flatnonzero(batch.loss_mask[row]), np.arange(p - 1, p - 1 + c))
            np.testing.assert_array_equal(batch.targets[row][batch.loss_mask[row] > 0], r.completion_ids)
            np.testing.assert_allclose(batch.behavior_logprobs[row][batch.loss_mask[row] > 0], r.behavior_logprobs)
            np.testing.assert_allclose(batch.mu_logprobs[row][batch.loss_mask[row] > 0], r.mu_logprobs)
            np.testing.assert_array_equal(batch.positions[row, :n], np.arange(n))
            assert (batch.segment_ids[row, :n] == 1).all() and (batch.segment_ids[row, n:] == 0).all()
            assert batch.group_ids[row] == r.group_id and batch.correct[row] == r.correct


def test_two_processes_partition_each_epoch(shard_dir):
    per_process = []
    for pidx in range(2):
        loader = make_loader(shard_dir, batch_size=4, max_len=16, seed=3, num_epochs=2,
                             process_index=pidx, process_count=2)
        batches = list(loader)
        assert loader.per_process == 15  # ceil(29 / 2): the shorter process gets a padding row
        assert len(batches) == -(-2 * loader.per_process // 4)  # epochs run on without a gap
        ids = [i for b in batches for i in ids_of(b)]
        planned = np.concatenate([loader.slot_indices(0), loader.slot_indices(1)])
        assert ids == [int(i) for i in planned if i >= 0]  # the iterator walks epoch 0, then epoch 1
        rows = sum(b.batch_size for b in batches)
        per_process.append((ids, rows, loader.per_process))
    # Lockstep: both processes produce the same number of rows.
    assert per_process[0][1] == per_process[1][1]
    for epoch in range(2):
        seen = []
        for pidx in range(2):
            loader = make_loader(shard_dir, batch_size=4, max_len=16, seed=3, process_index=pidx, process_count=2)
            seen += [int(i) for i in loader.slot_indices(epoch) if i >= 0]
        assert sorted(seen) == list(range(NUM))  # every record exactly once per epoch
    all_ids = per_process[0][0] + per_process[1][0]
    assert sorted(all_ids) == sorted(list(range(NUM)) * 2)
    # A new epoch is a different permutation.
    loader = make_loader(shard_dir, batch_size=4, max_len=16, seed=3, process_count=1)
    assert list(loader.slot_indices(0)) != list(loader.slot_indices(1))


def test_get_state_set_state_resumes_at_the_exact_next_record(shard_dir):
    kwargs = dict(batch_size=3, max_len=16, seed=1, num_epochs=2, buckets=(8, 16))
    loader = make_loader(shard_dir, **kwargs)
    for _ in range(4):
        next(loader)
    state = loader.get_state()
    rest = [ids_of(b) for b in loader]
    resumed = make_loader(shard_dir, **kwargs)
    resumed.set_state(state)
    assert [ids_of(b) for b in resumed] == rest
    assert len(rest) > 0


def test_orbax_checkpoint_of_the_iterator(shard_dir, tmp_path):
    kwargs = dict(batch_size=4, max_len=16, seed=2, num_epochs=1)
    loader = make_loader(shard_dir, **kwargs)
    first = [ids_of(next(loader)) for _ in range(3)]
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(3, args=ocp.args.Composite(data=loader.checkpoint_save()))
        manager.wait_until_finished()
    rest = [ids_of(b) for b in loader]
    resumed = make_loader(shard_dir, **kwargs)
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.restore(3, args=ocp.args.Composite(data=resumed.checkpoint_restore()))
    assert [ids_of(b) for b in resumed] == rest
    assert sorted(i for b in first + rest for i in b) == list(range(NUM))


def test_buckets_give_a_few_static_shapes(shard_dir):
    loader = make_loader(shard_dir, batch_size=2, max_len=16, buckets=(4, 8, 16), num_epochs=1)
    shapes = {b.inputs.shape for b in loader}
    assert shapes <= {(2, 4), (2, 8), (2, 16)} and len(shapes) >= 2


def test_too_long_records_error_or_counted_drop(shard_dir):
    records = make_records(NUM)
    row_len = np.asarray([r.length - 1 for r in records])
    limit = 8
    with pytest.raises(RecordError, match=r"records-\d{5}\.array_record\[\d+\]: record needs a row of"):
        make_loader(shard_dir, batch_size=4, max_len=limit)
    loader = make_loader(shard_dir, batch_size=4, max_len=limit, too_long="drop", num_epochs=1)
    assert loader.dropped_too_long == int((row_len > limit).sum()) > 0
    assert sorted(i for b in loader for i in ids_of(b)) == list(np.flatnonzero(row_len <= limit))


def test_require_mu_names_the_unscored_record(tmp_path):
    records = make_records(3)
    records[1].mu_logprobs = None
    write_records(tmp_path, records, vocab_size=50)
    loader = make_loader(str(tmp_path), batch_size=4, max_len=16, shuffle=False, require_mu=True, prefetch=0)
    with pytest.raises(RecordError, match=r"records-00000\.array_record\[1\]: no mu_logprobs"):
        next(loader)


def test_loader_from_config_splits_the_global_batch_over_processes(shard_dir):
    from jaxrl_llm.config import load_config
    from jaxrl_llm.data.loader import loader_from_config

    config = load_config(None, [f"data.records={shard_dir}", "train.batch_size=6", "train.max_seq_len=16",
                                "data.buckets=[8,16]", "loss.name=topr"])
    seen = []
    for pidx in range(2):
        loader = loader_from_config(config, process_index=pidx, process_count=2, num_epochs=1)
        assert loader.options.require_mu and loader.options.batch_size == 3
        seen += [i for b in loader for i in ids_of(b)]
    assert sorted(seen) == list(range(NUM))


# ---------------------------------------------------------------------------------- packing

PACK = dict(pack=True, records_per_row=3, batch_size=2, max_len=16)


def slot_ids(batch) -> list[int]:
    """Record ids (rewards) of the real record slots, in slot order."""
    return [int(r) for r, m in zip(batch.rewards, batch.record_mask) if m > 0]


def test_packed_rows_hold_whole_records_in_consecutive_segments(shard_dir):
    records = make_records(NUM)
    loader = make_loader(shard_dir, seed=4, num_epochs=1, prefetch=0, **PACK)
    k, seen = 3, []
    for batch in loader:
        batch.check_shapes()
        assert batch.inputs.shape == (2, 16) and batch.rewards.shape == (2 * k,)
        assert batch.records_per_row == k
        for row in range(2):
            seg = batch.segment_ids[row]
            ids = [int(batch.rewards[row * k + j]) for j in range(k) if batch.record_mask[row * k + j] > 0]
            # Slots are filled from j = 0 with no gap; empty slots are all padding.
            n_real = len(ids)
            assert (batch.record_mask[row * k : row * k + n_real] == 1).all()
            assert (batch.record_mask[row * k + n_real : (row + 1) * k] == 0).all()
            assert (batch.group_ids[row * k + n_real : (row + 1) * k] == -1).all()
            start = 0
            for j, rid in enumerate(ids):
                r = records[rid]
                tokens = np.concatenate([r.prompt_ids, r.completion_ids])
                n, p, c = tokens.size - 1, r.prompt_ids.size, r.completion_ids.size
                span = slice(start, start + n)
                # Segment j+1 is exactly this record's row, positions restart at 0.
                assert (seg[span] == j + 1).all()
                np.testing.assert_array_equal(batch.positions[row, span], np.arange(n))
                np.testing.assert_array_equal(batch.inputs[row, span], tokens[:-1])
                np.testing.assert_array_equal(batch.targets[row, span], tokens[1:])
                np.testing.assert_array_equal(np.flatnonzero(batch.loss_mask[row, span]), np.arange(p - 1, p - 1 + c))
                np.testing.assert_allclose(batch.mu_logprobs[row, span][p - 1 :], r.mu_logprobs)
                slot = row * k + j
                assert batch.group_ids[slot] == r.group_id and batch.correct[slot] == r.correct
                start += n
            assert start <= 16  # ≤ max_len tokens per row
            assert (seg[start:] == 0).all() and batch.loss_mask[row, start:].sum() == 0
            assert n_real <= k
            seen += ids
    assert sorted(seen) == list(range(NUM))


def test_pack_batches_first_fit_by_hand():
    from jaxrl_llm.data.loader import pack_batches

    # max_len 16, 2 rows, ≤ 3 records per row. 10→r0, 6→r0 (full), 5→r1, 3→r1 (8 left);
    # 9 fits no row: the batch closes; 9→r0 (7 left), 7→r0 (exactly full), 2→r1.
    plan = pack_batches([10, 6, 5, 3, 9, 7, 2], rows=2, max_len=16, records_per_row=3)
    np.testing.assert_array_equal(plan, [[[0, 1, -1], [2, 3, -1]], [[4, 5, -1], [6, -1, -1]]])
    # The record limit: 7 one-token records, 3 per row, 2 rows -> 6 in batch 0, 1 in batch 1.
    plan = pack_batches([1] * 7, rows=2, max_len=16, records_per_row=3)
    np.testing.assert_array_equal(plan, [[[0, 1, 2], [3, 4, 5]], [[6, -1, -1], [-1, -1, -1]]])


def test_packing_uses_fewer_rows_than_one_record_per_row(tmp_path):
    from jaxrl_llm.data.records import Record

    # Row lengths (prompt + completion − 1): 2+3−1 = 4 each; 8 records, max_len 16, k 4.
    rng = np.random.default_rng(0)
    records = [Record(prompt_ids=rng.integers(0, 50, 2), completion_ids=rng.integers(0, 50, 3),
                      reward=float(i), correct=True, group_id=i, task="unit",
                      behavior_logprobs=-rng.random(3) - 0.1, mu_logprobs=-rng.random(3) - 0.1)
               for i in range(8)]
    write_records(tmp_path, records, vocab_size=50)
    kwargs = dict(batch_size=2, max_len=16, num_epochs=1, prefetch=0)
    unpacked = list(make_loader(str(tmp_path), **kwargs))
    packed = list(make_loader(str(tmp_path), pack=True, records_per_row=4, **kwargs))
    assert sum(b.batch_size for b in unpacked) == 8  # one row per record
    # 4 records of 4 tokens fill a 16-token row exactly: 8 records -> 2 rows -> 1 batch.
    assert len(packed) == 1 and sum(b.batch_size for b in packed) == 2
    assert packed[0].segment_ids.tolist() == [[1] * 4 + [2] * 4 + [3] * 4 + [4] * 4] * 2
    assert sorted(slot_ids(packed[0])) == list(range(8))


def test_packed_processes_see_every_record_once_and_stay_in_lockstep(shard_dir):
    kwargs = dict(seed=3, num_epochs=2, process_count=2, prefetch=0, **PACK)
    batches = [list(make_loader(shard_dir, process_index=p, **kwargs)) for p in range(2)]
    assert len(batches[0]) == len(batches[1]) > 0  # lockstep
    for p in range(2):
        loader = make_loader(shard_dir, process_index=p, **kwargs)
        # The iterator walks epoch 0's plan, then epoch 1's, in record-slot order.
        planned = np.concatenate([loader.slot_indices(0), loader.slot_indices(1)])
        assert [i for b in batches[p] for i in slot_ids(b)] == [int(i) for i in planned if i >= 0]
        counts = [loader.batches_in_epoch(e) for e in range(2)]
        assert len(batches[p]) == sum(counts)
    for epoch in range(2):
        seen = []
        for p in range(2):
            loader = make_loader(shard_dir, process_index=p, **kwargs)
            seen += [int(i) for i in loader.slot_indices(epoch) if i >= 0]
        assert sorted(seen) == list(range(NUM))  # nothing lost or duplicated per epoch
    ids = [i for proc in batches for b in proc for i in slot_ids(b)]
    assert sorted(ids) == sorted(list(range(NUM)) * 2)


def test_packed_lockstep_pads_the_shorter_process_with_empty_batches(tmp_path):
    from jaxrl_llm.data.records import Record

    # Unshuffled, 2 processes: process 0 reads records 0, 2, 4, ..., process 1 reads 1, 3, ....
    # Even records have 15-token rows (one per row), odd ones 3-token rows (5 fill a row):
    # with 1 row per batch, process 0 needs 3 batches and process 1 one, so it gets 2 empty ones.
    records = []
    for i in range(6):
        prompt, completion = (np.arange(1, 9), np.arange(1, 9)) if i % 2 == 0 else (np.arange(1, 3), np.arange(1, 3))
        records.append(Record(prompt_ids=prompt, completion_ids=completion, reward=float(i), correct=True,
                              group_id=i, task="unit", behavior_logprobs=-np.ones(completion.size) * 0.1,
                              mu_logprobs=-np.ones(completion.size) * 0.1))
    write_records(tmp_path, records, vocab_size=50)
    kwargs = dict(batch_size=1, max_len=16, shuffle=False, num_epochs=1, process_count=2, prefetch=0,
                  pack=True, records_per_row=8)
    out = [list(make_loader(str(tmp_path), process_index=p, **kwargs)) for p in range(2)]
    assert [len(b) for b in out] == [3, 3]
    assert [slot_ids(b) for b in out[0]] == [[0], [2], [4]]
    assert [slot_ids(b) for b in out[1]] == [[1, 3, 5], [], []]
    for empty in out[1][1:]:
        assert empty.record_mask.sum() == 0 and empty.loss_mask.sum() == 0 and empty.segment_ids.sum() == 0


def test_packed_get_state_set_state_resumes_at_the_exact_next_batch(shard_dir):
    for num_epochs in (2, None):  # None: epoch plans are computed lazily, forever
        kwargs = dict(seed=1, num_epochs=num_epochs, **PACK)
        loader = make_loader(shard_dir, **kwargs)
        first_epoch = loader.batches_in_epoch(0)
        for _ in range(first_epoch - 2):
            next(loader)
        state = loader.get_state()
        rest = [next(loader) for _ in range(5)]  # crosses into epoch 1
        resumed = make_loader(shard_dir, **kwargs)
        resumed.set_state(state)
        for expected in rest:
            got = next(resumed)
            for name in ("inputs", "segment_ids", "positions", "loss_mask", "rewards", "record_mask"):
                np.testing.assert_array_equal(getattr(got, name), getattr(expected, name))
        epoch1 = [i for b in rest[2:] for i in slot_ids(b)]
        assert epoch1 == [int(i) for i in loader.slot_indices(1) if i >= 0][: len(epoch1)]


def test_pack_refuses_pair_losses_and_is_wired_from_config(shard_dir):
    from jaxrl_llm.config import ConfigError, load_config
    from jaxrl_llm.data.loader import loader_from_config

    common = [f"data.records={shard_dir}", "train.batch_size=4", "train.max_seq_len=16", "data.pack=true",
              "data.records_per_row=3"]
    with pytest.raises(ConfigError, match=r"data\.pack=true cannot train loss\.name=dpo"):
        loader_from_config(load_config(None, [*common, "loss.name=dpo"]), process_index=0, process_count=1)
    loader = loader_from_config(load_config(None, [*common, "loss.name=grpo"]), process_index=1, process_count=2,
                                num_epochs=1)
    assert loader.options.pack and loader.options.records_per_row == 3 and loader.options.batch_size == 2
    batch = next(loader)
    assert batch.inputs.shape == (2, 16) and batch.rewards.shape == (6,)
