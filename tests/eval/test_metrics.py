"""Evaluation estimators against exact enumeration (SPEC §6)."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np
import pytest

from jaxrl_llm.eval import metrics as m
from jaxrl_llm.eval.window import MetricWindow, is_count_metric


def brute_pass_at_k(correct_row: list[bool], k: int) -> float:
    """Fraction of k-subsets holding at least one correct sample."""
    subsets = list(itertools.combinations(range(len(correct_row)), k))
    return sum(any(correct_row[i] for i in s) for s in subsets) / len(subsets)


def brute_majority(answers: list[str | None], correct: list[bool], subset: tuple[int, ...]):
    """Plain-Python vote: most frequent valid answer; ties to the earliest sample's answer."""
    counts = Counter(answers[i] for i in subset if answers[i] is not None)
    if not counts:
        return False
    top = max(counts.values())
    for i in sorted(subset):
        if answers[i] is not None and counts[answers[i]] == top:
            return correct[i]
    raise AssertionError("unreachable")


def exact_maj_at_k(answers, correct, k) -> float:
    """Exact expectation of maj@K over all K-subsets, averaged over questions."""
    per_q = []
    for a, c in zip(answers, correct):
        subsets = list(itertools.combinations(range(len(a)), k))
        per_q.append(sum(brute_majority(a, c, s) for s in subsets) / len(subsets))
    return float(np.mean(per_q))


RNG = np.random.default_rng(7)


def random_questions(q: int, n: int, vocab: int = 3):
    """Random answers from a small vocabulary (lots of ties) with "1" the right answer."""
    answers, correct = [], []
    for _ in range(q):
        row = [None if RNG.random() < 0.2 else str(RNG.integers(vocab)) for _ in range(n)]
        answers.append(row)
        correct.append([a == "1" for a in row])
    return answers, correct


def test_pass_at_k_matches_enumeration_for_every_k():
    answers, correct = random_questions(6, 7)
    samples = m.EvalSamples.from_answers(answers, correct)
    curve = m.pass_at_k(samples)
    for k in range(1, 8):
        expected = np.mean([brute_pass_at_k(row, k) for row in correct])
        assert curve[k - 1] == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_closed_form_large_n_no_overflow():
    n, c = 1000, np.array([0, 1, 10, 999, 1000])
    table = m.pass_at_k_per_question(n, c)
    for ci, row in zip(c, table):
        for k in (1, 5, 100, 1000):
            expected = 1 - math.comb(n - int(ci), k) / math.comb(n, k)
            assert row[k - 1] == pytest.approx(expected, abs=1e-9)
    assert np.all(np.isfinite(table))


def test_pass_at_1_and_se_follow_002_eq_29_30():
    correct = np.array([[1, 0, 1, 1], [0, 0, 1, 0], [1, 1, 1, 0]], bool)
    a = [2 / 3, 1 / 3, 1.0, 1 / 3]  # column accuracies a_j
    mean = sum(a) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in a) / 3)
    got = m.pass_at_1_with_se(correct)
    assert got.mean == pytest.approx(mean)
    assert got.se == pytest.approx(std / 2)


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_maj_at_k_bootstrap_mean_matches_exact_expectation(k):
    answers, correct = random_questions(40, 6)
    samples = m.EvalSamples.from_answers(answers, correct)
    exact = exact_maj_at_k(answers, correct, k)
    result = m.vote_at_k_bootstrap(samples, k, trials=2000, seed=1)
    # The trial mean is an average of 2000 unbiased trials: within 5 of its own SEs.
    trial_se = math.sqrt(result.variance / result.trials)
    assert abs(result.mean - exact) <= 5 * trial_se + 1e-12
    assert result.se == pytest.approx(math.sqrt(k * result.variance / (6 - k)))
    assert result.as_dict()["error_bar"] == pytest.approx(2 * result.se)


def test_maj_at_n_is_deterministic_and_its_se_is_over_questions():
    answers, correct = random_questions(10, 4)
    samples = m.EvalSamples.from_answers(answers, correct)
    result = m.vote_at_k_bootstrap(samples, 4, trials=10)
    assert result.mean == pytest.approx(exact_maj_at_k(answers, correct, 4))
    assert result.variance == pytest.approx(0.0, abs=1e-20)  # the bootstrap says nothing here
    assert m.vote_accuracy(samples) == pytest.approx(result.mean)
    assert result.se_method == "questions" and result.se == result.se_questions


def test_maj_at_n_se_by_hand():
    # The majorities: "1" (right), "6" (wrong), "4" (right): hits 1, 0, 1, mean 2/3.
    # Deviations 1/3, -2/3, 1/3: sample variance (1/9 + 4/9 + 1/9) / 2 = 1/3, so the SE over
    # the 3 questions is sqrt(1/3) / sqrt(3) = 1/3, and the error bar 2/3.
    samples = m.EvalSamples.from_answers(
        [["1", "1", "2"], ["5", "6", "6"], ["3", "4", "4"]],
        [[True, True, False], [False, False, False], [False, True, True]])
    got = m.vote_at_k_bootstrap(samples, 3, trials=5).as_dict()
    assert got["mean"] == pytest.approx(2 / 3)
    assert got["se"] == pytest.approx(1 / 3) and got["error_bar"] == pytest.approx(2 / 3)
    assert got["se_method"] == "questions"
    summary = m.evaluation_summary(samples, maj_k=(1, 3), trials=5)
    assert summary["maj_at_k"]["3"]["se"] == pytest.approx(1 / 3)  # a number in eval.json
    assert summary["maj_at_k"]["1"]["se_method"] == "bootstrap"


def test_invalid_answers_never_win():
    # Three invalid samples outnumber the single valid (wrong) one, which still wins.
    samples = m.EvalSamples.from_answers([[None, None, "7", None]], [[False] * 4])
    assert m.vote(samples.answer_ids)[0] == samples.answer_ids[0, 2]
    ok = m.EvalSamples.from_answers([[None, None, "3", None]], [[False, False, True, False]])
    assert m.vote_accuracy(ok) == 1.0
    # No valid answer at all: the vote is INVALID and scores 0.
    none = m.EvalSamples.from_answers([[None, None]], [[False, False]])
    assert m.vote(none.answer_ids)[0] == m.INVALID
    assert m.vote_accuracy(none) == 0.0


def test_ties_go_to_the_answer_that_appeared_first():
    # "5" (wrong) appears first; "3" (right) ties it 2–2.
    answers = [["5", "3", "3", "5"], ["3", "5", "5", "3"]]
    correct = [[a == "3" for a in row] for row in answers]
    samples = m.EvalSamples.from_answers(answers, correct)
    assert m.vote_accuracy(samples) == 0.5
    ids = samples.answer_ids
    assert list(m.vote(ids)) == [ids[0, 0], ids[1, 0]]


def test_weighted_self_consistency_follows_verifier_scores():
    # Majority says "5" (wrong), but the verifier gives the lone "3" more "correct" verdicts.
    answers = [["5", "5", "3"]]
    correct = [[False, False, True]]
    samples = m.EvalSamples.from_answers(answers, correct)
    verdicts = np.array([[[1, 0, -1, 0], [0, 0, 1, -1], [1, 1, 1, 0]]])
    scores = m.verifier_scores(verdicts)
    np.testing.assert_array_equal(scores, [[1, 1, 3]])
    assert m.vote_accuracy(samples) == 0.0
    assert m.vote_accuracy(samples, scores) == 1.0
    summary = m.evaluation_summary(samples, maj_k=[1, 3], trials=5, verdicts=verdicts)
    assert summary["weighted_sc"]["at_n"] == 1.0


def test_proportions_and_cardinality():
    answers = [["1", None, "2", "1"], [None, None, "2", "2"], ["1", "1", "1", "1"]]
    correct = [[a == "1" for a in row] for row in answers]
    samples = m.EvalSamples.from_answers(answers, correct)
    p = m.proportions(samples)
    assert (p.correct, p.incorrect, p.invalid) == (6 / 12, 3 / 12, 3 / 12)
    assert m.cardinality_histogram(samples.correct).tolist() == [1, 0, 1, 0, 1]


def test_summary_is_json_ready_and_skips_k_above_n():
    import json

    answers, correct = random_questions(5, 4)
    summary = m.evaluation_summary(
        m.EvalSamples.from_answers(answers, correct), maj_k=[1, 2, 8], trials=20
    )
    assert set(summary["maj_at_k"]) == {"1", "2"} and summary["maj_at_k_skipped"] == [8]
    assert list(summary["pass_at_k"]) == ["1", "2", "3", "4"]
    json.dumps(summary, allow_nan=False)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="marked correct but its answer is invalid"):
        m.EvalSamples(np.array([[m.INVALID]]), np.array([[True]]))
    with pytest.raises(ValueError, match="same number of samples"):
        m.EvalSamples.from_answers([["1"], ["1", "2"]], [[True], [True, False]])
    samples = m.EvalSamples.from_answers([["1", "2"]], [[True, False]])
    with pytest.raises(ValueError, match="1 <= K <= n"):
        m.vote_at_k_bootstrap(samples, 3)


def test_cumulative_solve_rate():
    tracker = m.SolveTracker(4)
    assert tracker.update([0, 1, 1], [False, True, False]) == 0.25
    assert tracker.update([0, 3], [True, False]) == 0.5
    assert tracker.update([1], [True]) == 0.5  # solving again adds nothing
    restored = m.SolveTracker.from_state_dict(tracker.state_dict())
    assert restored.rate == 0.5
    with pytest.raises(ValueError, match="task id 9"):
        tracker.update([9], [True])
    # A run continued with more iterations (fresh prompts): 2 solved of now 8 tasks, and the
    # new iteration's task ids 4..7 are accepted instead of failing the re-run.
    widened = m.SolveTracker.from_state_dict(tracker.state_dict(), num_tasks=8)
    assert widened.rate == 2 / 8
    assert widened.update([4, 7], [True, False]) == 3 / 8
    assert m.SolveTracker.from_state_dict(tracker.state_dict(), num_tasks=2).num_tasks == 4


def test_window_means_rates_and_sums_counts():
    window = MetricWindow()
    window.add({"loss": 1.0, "num_records": 8, "clipped_count": 2})
    window.add({"loss": 3.0, "num_records": 8, "clipped_count": 1, "eval/pass_at_1": 0.5})
    row = window.flush()
    assert row == {"loss": 2.0, "num_records": 16.0, "clipped_count": 3.0, "eval/pass_at_1": 0.5}
    assert window.flush() == {} and len(window) == 0
    assert is_count_metric("train/num_tokens") and not is_count_metric("clip_fraction")
    assert is_count_metric("loss/count_pi_below_0.2_incorrect")
    assert is_count_metric("loss/num_pos") and not is_count_metric("loss/log_ratio_mean_pos")
