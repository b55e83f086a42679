"""Group-aware batching for the losses that compute group statistics in the batch (GRPO,
Dr.GRPO, A*-PO): whole groups are the shuffle unit, so a batch never holds part of a group.

Expectations are counted from the records written here (group of record i = `GROUP_OF[i]`,
stored interleaved so that storage order is no help), not from the loader."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from jaxrl_llm.data.loader import make_loader
from jaxrl_llm.data.records import Record
from jaxrl_llm.data.shards import write_records
from jaxrl_llm.data.units import group_counts, group_units, pack_batches

GROUP = 4
NUM_GROUPS = 12
# Record i belongs to group GROUP_OF[i]: groups interleaved over the storage order.
GROUP_OF = np.random.default_rng(7).permutation(np.repeat(np.arange(NUM_GROUPS), GROUP))


def write(directory, group_of, *, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    records = []
    for i, g in enumerate(group_of):
        c = int(rng.integers(1, 6))
        records.append(Record(
            prompt_ids=rng.integers(1, 50, int(rng.integers(1, 5))),
            completion_ids=rng.integers(1, 50, c), reward=float(i),  # reward = record id
            correct=bool(i % 2), group_id=int(g), mu_logprobs=-rng.random(c) - 0.01))
    write_records(directory, records, records_per_shard=17)
    return str(directory)


def ids(batch) -> list[int]:
    """Record ids (rewards) of a batch's real rows."""
    return [int(r) for r, m in zip(batch.rewards, batch.record_mask) if m > 0]


def assert_whole(batch, group_of) -> None:
    size = Counter(int(g) for g in group_of)
    held = Counter(int(group_of[i]) for i in ids(batch))
    assert held, "an empty batch"
    for g, n in held.items():
        assert n == size[g], f"group {g}: {n} of its {size[g]} records in the batch"
    # the batch's group ids are the records' own
    assert [int(g) for g, m in zip(batch.group_ids, batch.record_mask) if m > 0] == \
        [int(group_of[i]) for i in ids(batch)]


@pytest.fixture(scope="module")
def grouped(tmp_path_factory) -> str:
    return write(tmp_path_factory.mktemp("groups") / "recs", GROUP_OF)


def test_group_units_collects_each_group_in_storage_order():
    units = group_units(np.array([5, 3, 5, 9, 3, 5]))
    np.testing.assert_array_equal(units, [[0, 2, 5], [1, 4, -1], [3, -1, -1]])


def test_every_record_once_per_epoch_and_groups_never_split(grouped):
    kwargs = dict(batch_size=8, max_len=16, seed=3, num_epochs=2, prefetch=0, groups=True)
    loader = make_loader(grouped, **kwargs)
    batches = list(loader)
    per_epoch = len(GROUP_OF) // 8
    assert len(batches) == 2 * per_epoch
    for epoch in range(2):
        seen = [i for b in batches[epoch * per_epoch:(epoch + 1) * per_epoch] for i in ids(b)]
        assert sorted(seen) == list(range(len(GROUP_OF)))
    for b in batches:
        assert_whole(b, GROUP_OF)
        assert loader.group_counts(b) == {"data/whole_groups": 2.0, "data/partial_groups": 0.0}
    # shuffled: the two epochs (and a record loader) visit groups in different orders
    order = [int(GROUP_OF[ids(b)[0]]) for b in batches]
    assert order[:per_epoch] != order[per_epoch:]
    records = make_loader(grouped, **{**kwargs, "groups": False, "num_epochs": 1})
    assert all(records.group_counts(b) == {} for b in records)  # no group metric without groups


def test_resume_mid_epoch_gives_the_same_sequence(grouped):
    kwargs = dict(batch_size=8, max_len=16, seed=1, prefetch=0, groups=True)
    loader = make_loader(grouped, **kwargs)
    for _ in range(4):
        next(loader)
    state = loader.get_state()
    rest = [ids(next(loader)) for _ in range(5)]  # crosses into the next epoch
    resumed = make_loader(grouped, **kwargs)
    resumed.set_state(state)
    assert [ids(next(resumed)) for _ in range(5)] == rest


def test_two_processes_hold_whole_groups_in_lockstep(grouped):
    kwargs = dict(batch_size=4, max_len=16, seed=2, num_epochs=1, prefetch=0, groups=True)
    parts = [list(make_loader(grouped, process_index=p, process_count=2, **kwargs)) for p in (0, 1)]
    assert len(parts[0]) == len(parts[1])
    seen = [i for part in parts for b in part for i in ids(b)]
    assert sorted(seen) == list(range(len(GROUP_OF)))
    for part in parts:
        for b in part:
            assert_whole(b, GROUP_OF)


def test_unequal_groups_are_padded_not_split(tmp_path):
    group_of = np.array([0, 1, 0, 2, 1, 0, 3, 2, 0, 1, 3, 4])  # sizes 4, 3, 2, 2, 1
    directory = write(tmp_path / "recs", group_of)
    loader = make_loader(directory, batch_size=8, max_len=16, seed=0, num_epochs=1, prefetch=0,
                         groups=True)
    batches = list(loader)
    # 5 groups, each a unit of 4 rows (the largest group): 2 units a batch -> 3 batches
    assert len(batches) == 3
    assert sorted(i for b in batches for i in ids(b)) == list(range(group_of.size))
    for b in batches:
        assert_whole(b, group_of)


def test_batch_that_cannot_hold_a_group_is_refused(grouped):
    from jaxrl_llm.config import ConfigError, load_config
    from jaxrl_llm.data.loader import loader_from_config

    common = [f"data.records={grouped}", "train.max_seq_len=16"]
    with pytest.raises(ConfigError, match=r"train\.batch_size=6.*loss\.name=grpo.*whole groups "
                                          r"of 4 records"):
        loader_from_config(load_config(None, [*common, "train.batch_size=6", "loss.name=grpo"]),
                           process_index=0, process_count=1)
    # 8 rows over 2 processes: 4 each, one group each
    loader = loader_from_config(load_config(None, [*common, "train.batch_size=8", "loss.name=apo"]),
                                process_index=0, process_count=2, num_epochs=1)
    assert loader.options.groups and not loader.options.pairs
    # a loss without group statistics shuffles single records
    loader = loader_from_config(load_config(None, [*common, "train.batch_size=6", "loss.name=topr"]),
                                process_index=0, process_count=1)
    assert not loader.options.groups


def test_packed_batches_keep_groups_whole(grouped):
    loader = make_loader(grouped, batch_size=2, max_len=16, seed=5, num_epochs=1, prefetch=0,
                         groups=True, pack=True, records_per_row=4)
    batches = list(loader)
    assert sorted(i for b in batches for i in ids(b)) == list(range(len(GROUP_OF)))
    for b in batches:
        assert_whole(b, GROUP_OF)


def test_pack_batches_places_a_unit_whole_or_in_the_next_batch():
    # 2 rows × 2 slots × 10 tokens. Unit A = [6, 6] fills one slot of each row; unit B =
    # [3, 3, 3] needs 3 slots but 2 are left: B goes whole into batch 2.
    plan = pack_batches([6, 6, 3, 3, 3], rows=2, max_len=10, records_per_row=2, unit_sizes=[2, 3])
    np.testing.assert_array_equal(plan, [[[0, -1], [1, -1]], [[2, 3], [4, -1]]])
    # the same stream as single records fills batch 1 first
    plan = pack_batches([6, 6, 3, 3, 3], rows=2, max_len=10, records_per_row=2)
    np.testing.assert_array_equal(plan[0], [[0, 2], [1, 3]])


def test_group_counts_by_hand():
    sizes = {0: 2, 1: 3, 2: 1}
    # group 0 whole (2 of 2), group 1 split (2 of 3), group 2 whole, a padding row
    whole, partial = group_counts(np.array([0, 1, 0, 1, 2, -1]), np.array([1, 1, 1, 1, 1, 0]), sizes)
    assert (whole, partial) == (2, 1)
