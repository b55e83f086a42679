"""DPO pairs are the units `curate` wrote, rows (2i, 2i+1) — never re-formed from group ids.

`curate data.curation=dpo` may pair one correct response with several incorrect ones of its
group, and a batch that straddles an epoch boundary may hold the same pair twice: re-pairing
the batch by group would then invent (chosen, rejected) combinations or overflow the
`batch_size / 2` pair slots (a `ValueError` from `make_pairs` before this fix).
"""

import numpy as np

from jaxrl_llm.data.loader import make_loader
from jaxrl_llm.data.records import Record
from jaxrl_llm.data.shards import write_records


def _record(group: int, correct: bool, token: int) -> Record:
    return Record(prompt_ids=[1, 2, 3], completion_ids=[token, token + 1], reward=1.0 if correct else -1.0,
                  correct=correct, group_id=group, task="unit", mu_logprobs=[-0.5, -0.5])


def test_each_batch_pairs_exactly_the_written_units(tmp_path):
    # group 0: one correct response c0 paired with three incorrect ones (every combination,
    # as curate writes them), group 1: one pair; 4 pairs, odd against a batch of 3 pairs.
    units = [(0, 10, 20), (0, 10, 22), (0, 10, 24), (1, 30, 40)]
    records = [r for g, c, w in units for r in (_record(g, True, c), _record(g, False, w))]
    write_records(tmp_path / "pairs", records, vocab_size=64)
    loader = make_loader(str(tmp_path / "pairs"), batch_size=6, max_len=8, pairs=True,
                         num_epochs=3, prefetch=0, read_threads=1)
    seen = 0
    for batch in loader:
        rows = np.asarray(batch.record_mask) > 0
        expected = [[2 * i, 2 * i + 1] if rows[2 * i] else [-1, -1] for i in range(3)]
        np.testing.assert_array_equal(batch.pair_index, expected)
        for chosen, rejected in batch.pair_index[batch.pair_index[:, 0] >= 0]:
            assert batch.correct[chosen] and not batch.correct[rejected]
            assert batch.group_ids[chosen] == batch.group_ids[rejected]
            # the rejected row is the one written beside its chosen row: its first token
            # identifies the unit (20, 22, 24 for group 0; 40 for group 1)
            assert batch.targets[rejected, 2] in (20, 22, 24, 40)
        seen += int(rows.sum()) // 2
    assert seen == 3 * len(units)  # every pair once per epoch, none invented
