"""Evaluation estimators (TOPR §4.2, FPA App. B.3): pass@k, pass@1 ± SE, maj@K with bootstrap SE, proportions,
correct-answer cardinality, weighted self-consistency, cumulative solve rate.

Everything here is host-side numpy on small arrays: one row per question, one column per
sample. An *answer* is the string extracted from a completion, or `None` when no answer could
be parsed (an invalid completion, TOPR arXiv:2503.14286 Fig. 3).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from jaxrl_llm.losses.pkpo import pass_at_k as pkpo_pass_at_k

INVALID = -1  # answer id of a completion without a parsable answer


@dataclass(frozen=True)
class EvalSamples:
    """Graded samples of one evaluation: `n` samples for each of `Q` questions.

    answer_ids: [Q, n] int, per question a dense id of the extracted answer (`INVALID` = none);
        equal ids mean equal answers *within the question*.
    correct: [Q, n] bool, whether the sample's answer is right (invalid samples are never).
    """

    answer_ids: np.ndarray
    correct: np.ndarray

    def __post_init__(self) -> None:
        ids, ok = np.asarray(self.answer_ids), np.asarray(self.correct)
        if ids.ndim != 2 or ok.shape != ids.shape:
            raise ValueError(
                f"answer_ids {ids.shape} and correct {ok.shape} must both be [questions, samples]"
            )
        if ids.shape[1] == 0:
            raise ValueError("EvalSamples needs at least one sample per question")
        if np.any(ok & (ids == INVALID)):
            q, j = np.argwhere(ok & (ids == INVALID))[0]
            raise ValueError(f"question {q} sample {j}: marked correct but its answer is invalid")
        object.__setattr__(self, "answer_ids", ids.astype(np.int64))
        object.__setattr__(self, "correct", ok.astype(bool))

    @property
    def num_questions(self) -> int:
        return int(self.answer_ids.shape[0])

    @property
    def n(self) -> int:
        return int(self.answer_ids.shape[1])

    @property
    def valid(self) -> np.ndarray:
        return self.answer_ids != INVALID

    @classmethod
    def from_answers(
        cls, answers: Sequence[Sequence[str | None]], correct: Sequence[Sequence[bool]]
    ) -> EvalSamples:
        """Build from extracted answer strings (None = invalid) and correctness flags."""
        if len(answers) != len(correct):
            raise ValueError(f"{len(answers)} questions of answers but {len(correct)} of flags")
        widths = {len(row) for row in answers}
        if len(widths) > 1:
            raise ValueError(f"every question needs the same number of samples; got {sorted(widths)}")
        ids = np.full((len(answers), widths.pop() if widths else 0), INVALID, np.int64)
        for q, row in enumerate(answers):
            seen: dict[str, int] = {}
            for j, answer in enumerate(row):
                if answer is not None:
                    ids[q, j] = seen.setdefault(answer, len(seen))
        return cls(ids, np.asarray(correct, bool).reshape(ids.shape))


def pass_at_k_per_question(num_samples: int, num_correct: np.ndarray) -> np.ndarray:
    """Unbiased pass@k for every k = 1..n (TOPR §4.2, FPA App. B.3; PKPO arXiv:2505.15201 eq. 3): `1 − C(n−c,k)/C(n,k)`.

    Returns [Q, n] float64 with column k−1 holding pass@k; the estimator is PKPO's
    (`losses.pkpo.pass_at_k`, host float64, overflow-free for any n).
    """
    n = int(num_samples)
    c = np.asarray(num_correct, np.int64)[:, None]
    return np.asarray(pkpo_pass_at_k(n, c, np.arange(1, n + 1)[None, :]), np.float64)


def pass_at_k(samples: EvalSamples) -> np.ndarray:
    """Mean over questions of unbiased pass@k, for k = 1..n (index k−1)."""
    return pass_at_k_per_question(samples.n, samples.correct.sum(axis=1)).mean(axis=0)


@dataclass(frozen=True)
class MeanSE:
    mean: float
    se: float

    def as_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "se": self.se}


def pass_at_1_with_se(correct: np.ndarray, *, ddof: int = 1) -> MeanSE:
    """pass@1 and its standard error from sample columns (FPA arXiv:2509.19893 eq. 29–30).

    `a_j` is the accuracy of the j-th sample column over the questions; pass@1 = mean_j a_j and
    SE = std(a)/√n. **(choice)** std uses `ddof=1` (the sample standard deviation); with a
    single column the SE is 0.
    """
    correct = np.asarray(correct, np.float64)
    a = correct.mean(axis=0)
    n = a.shape[0]
    se = float(a.std(ddof=ddof) / np.sqrt(n)) if n > ddof else 0.0
    return MeanSE(float(a.mean()), se)


def vote(answer_ids: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """Winning answer id of each row of samples (majority rule of TOPR §4.2).

    answer_ids: [..., K] in the order the samples appeared; weights: [..., K] (default 1 per
    sample, which makes this the majority vote). The answer with the largest weight sum wins;
    invalid answers never win (a row with no valid answer returns `INVALID`); **(choice)** ties
    go to the tied answer that appeared first.
    """
    ids = np.asarray(answer_ids)
    w = np.ones(ids.shape, np.float64) if weights is None else np.asarray(weights, np.float64)
    if w.shape != ids.shape:
        raise ValueError(f"weights {w.shape} must match answer_ids {ids.shape}")
    valid = ids != INVALID
    # same[..., i, j]: samples i and j carry the same valid answer.
    same = (ids[..., :, None] == ids[..., None, :]) & valid[..., :, None] & valid[..., None, :]
    score = np.einsum("...ij,...j->...i", same.astype(np.float64), w)
    k = ids.shape[-1]
    position = np.arange(k)
    # First appearance of each sample's answer; a later duplicate gets its first's position.
    first = np.where(same, position[None, :], k).min(axis=-1)
    # Lexicographic (score desc, first appearance asc); invalid samples are excluded.
    best_score = np.where(valid, score, -np.inf).max(axis=-1, keepdims=True)
    candidate = valid & (score == best_score)
    winner_pos = np.where(candidate, first, k).min(axis=-1)
    has_valid = valid.any(axis=-1)
    winner_pos = np.minimum(winner_pos, k - 1)
    winners = np.take_along_axis(ids, winner_pos[..., None], axis=-1)[..., 0]
    return np.where(has_valid, winners, INVALID)


def _winner_correct(ids: np.ndarray, correct: np.ndarray, winners: np.ndarray) -> np.ndarray:
    """Whether each row's winning answer is a correct one (INVALID winner scores 0)."""
    hit = (ids == winners[..., None]) & correct
    return hit.any(axis=-1) & (winners != INVALID)


@dataclass(frozen=True)
class BootstrapResult:
    """maj@K (or weighted SC at K) with the bootstrap of TOPR §4.2."""

    k: int
    mean: float
    # the reported SE: the bootstrap's sqrt(K V̂ / (n − K)) for K < n; at K = n every trial
    # draws the same samples (V̂ = 0 says nothing), so the SE over questions instead
    se: float
    variance: float
    trials: int
    se_questions: float  # SE over questions of the per-question maj@K accuracy (ddof=1)
    se_method: str  # "bootstrap" or "questions": which one `se` is

    def as_dict(self) -> dict[str, float | int | str]:
        return {
            "k": self.k, "mean": self.mean, "se": self.se, "error_bar": 2.0 * self.se,
            "se_method": self.se_method, "se_questions": self.se_questions,
            "variance": self.variance, "trials": self.trials,
        }


def vote_at_k_bootstrap(
    samples: EvalSamples,
    k: int,
    *,
    trials: int = 100,
    seed: int = 0,
    weights: np.ndarray | None = None,
) -> BootstrapResult:
    """maj@K with bootstrap error bars (TOPR §4.2).

    Each trial draws, per question, K of the n samples without replacement, votes (weighted by
    `weights` [Q, n] when given — weighted self-consistency, TOPR §4.4), scores the winner, and
    averages over questions. `V̂` is the variance of the trial means (ddof=1) and
    SE = sqrt(K V̂ / (n − K)); the paper's error bars are 2 SE. At K = n that formula is
    undefined (every trial is the same vote): the SE is then the one over questions,
    std(per-question maj@n hit, ddof=1) / sqrt(Q) (`se_method` says which).
    """
    n = samples.n
    if not 1 <= k <= n:
        raise ValueError(f"maj@K needs 1 <= K <= n = {n}; got K = {k}")
    if trials < 2:
        raise ValueError(f"the bootstrap needs at least 2 trials; got {trials}")
    q = samples.num_questions
    if weights is not None and np.asarray(weights).shape != samples.answer_ids.shape:
        raise ValueError(f"weights {np.asarray(weights).shape} must be [Q, n] = {(q, n)}")
    rng = np.random.default_rng(seed)
    # A random K-subset per (trial, question), kept in original order so that "appeared first"
    # is a property of the subset (the tie rule), not of the draw order.
    picks = np.sort(np.argsort(rng.random((trials, q, n)), axis=-1)[..., :k], axis=-1)
    hits = np.zeros((trials, q), bool)
    # The vote builds [trials, questions, K, K] pair tables: bound them to ~4M entries.
    chunk = max(1, 4_000_000 // (trials * k * k))
    for start in range(0, q, chunk):
        stop = min(q, start + chunk)
        rows = np.arange(start, stop)[None, :, None]
        cols = picks[:, start:stop]
        ids = samples.answer_ids[rows, cols]
        w = None if weights is None else np.asarray(weights, np.float64)[rows, cols]
        hits[:, start:stop] = _winner_correct(ids, samples.correct[rows, cols], vote(ids, w))
    scores = hits.mean(axis=1)  # [trials]
    variance = float(scores.var(ddof=1))
    per_question = hits.mean(axis=0)  # [Q]: each question's maj@K accuracy over the trials
    se_questions = float(per_question.std(ddof=1) / np.sqrt(q)) if q > 1 else 0.0
    se, method = ((se_questions, "questions") if k == n
                  else (float(np.sqrt(k * variance / (n - k))), "bootstrap"))
    return BootstrapResult(k=k, mean=float(scores.mean()), se=se, variance=variance,
                           trials=trials, se_questions=se_questions, se_method=method)


def vote_accuracy(samples: EvalSamples, weights: np.ndarray | None = None) -> float:
    """Accuracy of the vote over all n samples of each question (maj@n or weighted SC@n)."""
    winners = vote(samples.answer_ids, weights)
    return float(_winner_correct(samples.answer_ids, samples.correct, winners).mean())


def verifier_scores(verdicts: np.ndarray) -> np.ndarray:
    """Per-solution score of weighted self-consistency (TOPR §4.4).

    verdicts: [Q, n, V] with 1 for a "correct" verdict, 0 for "incorrect", and −1 (or any
    negative) for a verification that could not be parsed, which counts as no vote.
    Returns the per-solution sum of "correct" verdicts, [Q, n].
    """
    v = np.asarray(verdicts)
    if v.ndim != 3:
        raise ValueError(f"verdicts must be [questions, samples, verifications]; got {v.shape}")
    return (v > 0).sum(axis=-1).astype(np.float64)


@dataclass(frozen=True)
class Proportions:
    correct: float
    incorrect: float
    invalid: float

    def as_dict(self) -> dict[str, float]:
        return {"correct": self.correct, "incorrect": self.incorrect, "invalid": self.invalid}


def proportions(samples: EvalSamples) -> Proportions:
    """Fractions of all completions that are correct / valid but wrong / invalid (TOPR Fig. 3)."""
    total = samples.correct.size
    correct = int(samples.correct.sum())
    invalid = int((~samples.valid).sum())
    return Proportions(correct / total, (total - correct - invalid) / total, invalid / total)


def cardinality_histogram(correct: np.ndarray) -> np.ndarray:
    """Number of questions with c correct samples, for c = 0..n (TOPR Fig. 4, bottom left)."""
    correct = np.asarray(correct, bool)
    return np.bincount(correct.sum(axis=1), minlength=correct.shape[1] + 1)


class SolveTracker:
    """Cumulative solve rate (PKPO §5.2): fraction of tasks solved at least once so far."""

    def __init__(self, num_tasks: int) -> None:
        if num_tasks <= 0:
            raise ValueError(f"num_tasks must be positive; got {num_tasks}")
        self.num_tasks = num_tasks
        self._solved: set[int] = set()

    def update(self, task_ids: Iterable[int], correct: Iterable[bool]) -> float:
        for task, ok in zip(task_ids, correct, strict=True):
            task = int(task)
            if not 0 <= task < self.num_tasks:
                raise ValueError(f"task id {task} outside [0, {self.num_tasks})")
            if ok:
                self._solved.add(task)
        return self.rate

    @property
    def rate(self) -> float:
        return len(self._solved) / self.num_tasks

    def state_dict(self) -> dict[str, object]:
        return {"num_tasks": self.num_tasks, "solved": sorted(self._solved)}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, object], num_tasks: int | None = None
                        ) -> SolveTracker:
        """The saved tracker; `num_tasks` widens it when a run is continued with more tasks
        (more `iterate.iterations`), so the rate is over the tasks of the whole run."""
        saved = int(state["num_tasks"])  # type: ignore[arg-type]
        tracker = cls(max(saved, num_tasks or 0))
        tracker._solved = {int(t) for t in state["solved"]}  # type: ignore[union-attr]
        return tracker


def evaluation_summary(
    samples: EvalSamples,
    *,
    maj_k: Sequence[int] = (1, 4),
    trials: int = 100,
    seed: int = 0,
    verdicts: np.ndarray | None = None,
) -> dict[str, object]:
    """Every evaluation number (TOPR §4.2, FPA App. B.3) of one evaluation, as a JSON-ready dict (what `eval.json` holds).

    maj@K values with K > n are skipped (listed under `maj_at_k_skipped`) rather than failing,
    since a config's K list is shared by runs with different n.
    """
    n = samples.n
    curve = pass_at_k(samples)
    maj = {}
    skipped = [k for k in maj_k if k > n]
    for k in sorted({k for k in maj_k if k <= n}):
        maj[str(k)] = vote_at_k_bootstrap(samples, k, trials=trials, seed=seed).as_dict()
    summary: dict[str, object] = {
        "num_questions": samples.num_questions,
        "n": n,
        "pass_at_1": pass_at_1_with_se(samples.correct).as_dict(),
        "pass_at_k": {str(k): float(curve[k - 1]) for k in range(1, n + 1)},
        "maj_at_k": maj,
        "maj_at_n": vote_accuracy(samples),
        "proportions": proportions(samples).as_dict(),
        "cardinality": cardinality_histogram(samples.correct).tolist(),
    }
    if skipped:
        summary["maj_at_k_skipped"] = skipped
    if verdicts is not None:
        scores = verifier_scores(verdicts)
        if scores.shape != samples.answer_ids.shape:
            raise ValueError(f"verdicts {np.shape(verdicts)} do not match samples [Q, n] = "
                             f"{samples.answer_ids.shape}")
        summary["weighted_sc"] = {
            "at_n": vote_accuracy(samples, scores),
            **{
                str(k): vote_at_k_bootstrap(
                    samples, k, trials=trials, seed=seed, weights=scores
                ).as_dict()
                for k in sorted({k for k in maj_k if k <= n})
            },
        }
    return summary
