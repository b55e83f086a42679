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
