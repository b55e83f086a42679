"""Each curation strategy's composition on a constructed dataset (SPEC §7), and group transforms."""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl_llm.data import curation
from jaxrl_llm.data.records import Record
from jaxrl_llm.data.shards import read_manifest, read_records, write_records

# 4 prompts x 4 samples: all correct, 3/4, 1/4, none.
CORRECT = np.asarray([1, 1, 1, 1, 0, 1, 1, 1, 0, 0, 1, 0, 0, 0, 0, 0], bool)
GROUPS = np.repeat(np.arange(4), 4)


def epf(p: float, c: float) -> float:
    """000 eq. 12, written out here as the oracle."""
    return p * (1 - c) / (1 + (1 - 2 * p) * c)


def test_uniform_picks_distinct_records():
    idx = curation.uniform(16, 8, seed=0)
    assert len(set(idx.tolist())) == 8 and idx.max() < 16
    with pytest.raises(ValueError, match="asks for 17 records but the dataset has only 16"):
        curation.uniform(16, 17, seed=0)


@pytest.mark.parametrize("name, num, pos", [("25p", 8, 2), ("50p", 16, 8), ("20p", 10, 2)])
def test_target_fraction_has_the_exact_composition(name, num, pos):
    idx = curation.select(name, CORRECT, GROUPS, num=num, seed=1)
    assert len(idx) == num and CORRECT[idx].sum() == pos and len(set(idx.tolist())) == num


def test_target_fraction_default_size_is_the_largest_possible():
    # 8 positives, 8 negatives: 25% positives -> limited by negatives: 8 / 0.75 = 10 records.
    idx = curation.target_fraction(CORRECT, 0.25, None, seed=0)
    assert len(idx) == 10 and CORRECT[idx].sum() == 2  # round(2.5) = 2 (banker's rounding)
    with pytest.raises(ValueError, match="positives"):
        curation.target_fraction(CORRECT, 0.9, 16, seed=0)


def test_positives_only_and_drop_uniform_groups():
    assert CORRECT[curation.positives_only(CORRECT)].all()
    assert len(curation.positives_only(CORRECT)) == 8
    kept = curation.drop_uniform_groups(CORRECT, GROUPS)
    np.testing.assert_array_equal(kept, np.arange(4, 12))  # groups 1 and 2 are mixed


def test_anna_karenina_keeps_first_positive_per_problem():
    idx = curation.anna_karenina(CORRECT, GROUPS, None, seed=0)
    positives = idx[CORRECT[idx]]
    np.testing.assert_array_equal(positives, [0, 5, 10])  # first correct sample of groups 0, 1, 2
    assert (~CORRECT[idx]).sum() == 8  # every negative when num is None
    idx = curation.anna_karenina(CORRECT, GROUPS, 7, seed=0)
    assert len(idx) == 7 and CORRECT[idx].sum() == 3


def test_hard_emphasis_quotas_follow_hamilton_apportionment():
    # weights (1 − p_g + 1/4): 0.25, 0.5, 1.0, 1.25; ideal shares of 8: 2/3, 4/3, 8/3, 10/3
    # floors 0, 1, 2, 3 leave 2 units for the largest remainders (groups 0 and 2).
    idx = curation.hard_emphasis(CORRECT, GROUPS, 8, seed=0)
    np.testing.assert_array_equal(np.bincount(GROUPS[idx], minlength=4), [1, 1, 3, 3])
    # Caps: asking for everything returns everything.
    assert len(curation.hard_emphasis(CORRECT, GROUPS, 16, seed=0)) == 16


@pytest.mark.parametrize("baseline", [0.0, -0.5, 0.5])
def test_composition_reports_effective_positive_fraction(baseline):
    idx = curation.select("25p", CORRECT, GROUPS, num=8, seed=0)
    comp = curation.composition(CORRECT[idx], GROUPS[idx], baseline=baseline)
    assert (comp.positives, comp.negatives) == (2, 6)
    assert comp.effective_positive_fraction == pytest.approx(epf(0.25, baseline), rel=1e-6)


def test_group_transforms_against_hand_computed_values():
    rewards = np.asarray([1, -1, -1, 1, 1, 1, -1, 1], np.float32)
    groups = np.asarray([0, 0, 0, 0, 1, 1, 1, 1])
    rloo = curation.transform_rewards(rewards, groups, "rloo")
    # group 0: mean of the others is −1/3 for a +1 and +1/3 for a −1.
    np.testing.assert_allclose(rloo[:4], [4 / 3, -4 / 3, -4 / 3, 4 / 3], rtol=1e-6)
    # group 1 (three +1, one −1): +1 -> 1 − 1/3; −1 -> −1 − 1.
    np.testing.assert_allclose(rloo[4:], [2 / 3, 2 / 3, -2, 2 / 3], rtol=1e-6)
    grpo = curation.transform_rewards(rewards, groups, "grpo")
    std1 = np.std([1, 1, -1, 1])
    np.testing.assert_allclose(grpo[4:], (rewards[4:] - 0.5) / (std1 + 1e-6), rtol=1e-5)
    # PKPO k = 1 is leave-one-out centring divided by n (SPEC §5).
    pk = curation.transform_rewards(rewards, groups, "pkpo", k=1)
    np.testing.assert_allclose(pk, rloo / 4, rtol=1e-5)
    # PKPO k = 2 on group 0 by brute force over subsets (003 eq. 33 with the (k/n) ρ(g_{-i}, k−1) baseline).
    from itertools import combinations
    g = rewards[:4].astype(float)
    n, k = 4, 2
    subsets = list(combinations(range(n), k))
    s = [sum(max(g[j] for j in S) for S in subsets if i in S) / len(subsets) for i in range(n)]
    rho_loo = [np.mean([g[j] for j in range(n) if j != i]) for i in range(n)]  # ρ(g_{-i}, 1) = mean
    expected = [s[i] - k / n * rho_loo[i] for i in range(n)]
    pk2 = curation.transform_rewards(rewards, groups, "pkpo", k=2)
    np.testing.assert_allclose(pk2[:4], expected, rtol=1e-5, atol=1e-6)


def test_curate_directory_writes_selection_transform_and_report(tmp_path):
    records = [Record([1, 2], [3], reward=1.0 if c else -1.0, correct=bool(c), group_id=int(g))
               for c, g in zip(CORRECT, GROUPS)]
    write_records(tmp_path / "in", records, vocab_size=10, task="unit")
    comp = curation.curate_directory(str(tmp_path / "in"), str(tmp_path / "out"),
                                     strategy="drop_uniform_groups", transform="rloo", baseline=0.0)
    assert (comp.num_records, comp.positives, comp.negatives, comp.num_groups) == (8, 4, 4, 2)
    out = read_records(tmp_path / "out")
    assert [r.raw_reward for r in out] == [-1, 1, 1, 1, -1, -1, 1, -1]
    np.testing.assert_allclose([r.reward for r in out[:4]], [-2, 2 / 3, 2 / 3, 2 / 3], rtol=1e-6)
    assert read_manifest(tmp_path / "out").extra["curation"]["positives"] == 4


def test_dpo_pairs_are_all_correct_x_incorrect_pairs_per_prompt():
    pairs = curation.dpo_pairs(CORRECT, GROUPS, seed=0)
    brute = {(i, j) for i in range(16) for j in range(16)
             if GROUPS[i] == GROUPS[j] and CORRECT[i] and not CORRECT[j]}
    assert {tuple(p) for p in pairs.tolist()} == brute and len(pairs) == len(brute) == 3 + 3


def test_dpo_curation_feeds_pair_batches(tmp_path):
    from jaxrl_llm.data.loader import make_loader

    records = [Record([1, 2], [3 + i % 5], reward=1.0 if c else -1.0, correct=bool(c), group_id=int(g),
                      metadata={"i": i}) for i, (c, g) in enumerate(zip(CORRECT, GROUPS))]
    write_records(tmp_path / "in", records, vocab_size=10)
    comp = curation.curate_directory(str(tmp_path / "in"), str(tmp_path / "dpo"), strategy="dpo")
    assert (comp.positives, comp.negatives) == (6, 6)
    loader = make_loader(str(tmp_path / "dpo"), batch_size=4, max_len=8, pairs=True, num_epochs=1, seed=0)
    seen = set()
    for batch in loader:
        assert batch.pair_index.shape == (2, 2)
        for chosen, rejected in batch.pair_index.tolist():
            if chosen < 0:
                continue
            assert batch.correct[chosen] and not batch.correct[rejected]
            assert batch.group_ids[chosen] == batch.group_ids[rejected]
            seen.add(int(batch.group_ids[chosen]))
    assert seen == set(range(6))
    with pytest.raises(ValueError, match="even batch_size"):
        make_loader(str(tmp_path / "dpo"), batch_size=3, max_len=8, pairs=True)
