"""`math` (TOPR arXiv:2503.14286 §4.1, FPA arXiv:2509.19893): competition problems; answer = the last balanced `\\boxed{…}`.

Equivalence with the gold answer is decided by math-verify in worker processes under a hard
per-call timeout (`tasks.math_verifier`); timeouts and verifier errors score as incorrect but
are never a silent 0: each is flagged on its completion (`info["reward_error"]` = "timeout" or
"verifier_error", which the record's metadata keeps) and counted in `metrics()`
(`reward/timeouts`, `reward/verifier_errors`).
Rows: `{"problem", "solution"}` (MATH format; gold = last box of the solution) or
`{"problem", "answer"}`. The prompt is FPA's (Fig. 7).
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources

from jaxrl_llm.tasks.answers import last_boxed
from jaxrl_llm.tasks.base import (
    REWARD_ERRORS,
    Problem,
    RewardResult,
    RewardScheme,
    Task,
    binary_reward,
    reward_error_metrics,
)
from jaxrl_llm.tasks.loading import load_rows, require
from jaxrl_llm.tasks.math_verifier import MathVerifier

PROMPT_002 = (
    "Solve this math problem step by step. At the end, make sure to finish the calculation and "
    "state the answer exactly once in the following format: The final answer is \\boxed{{X}}, "
    "where X is your final answer. Q:{question} A:"
)
TINY_ASSET = "math_tiny.jsonl"


class MathTask(Task):
    name = "math"
    reward_fn = "±1: last \\boxed{} equivalent to the gold by math-verify (hard timeout); none -> invalid"

    def __init__(
        self,
        *,
        path: str | None = None,
        verifier_workers: int = 2,
        verifier_timeout_s: float = 5.0,
        reward_scheme: RewardScheme = "pm1",
    ) -> None:
        super().__init__(reward_scheme=reward_scheme)
        self.path = path
        self.verifier = MathVerifier(workers=verifier_workers, timeout_s=verifier_timeout_s)

    def load(self, *, split: str = "train", num: int | None = None, seed: int = 0) -> list[Problem]:
        path = self.path or str(resources.files("jaxrl_llm.assets") / TINY_ASSET)
        problems = []
        for i, row in enumerate(load_rows(path, split=split)):
            where = f"{path} row {i}"
            question = str(require(row, "problem", where))
            solution = row.get("solution")
            gold = row.get("answer") or (last_boxed(solution) if solution else None)
            if not gold:
                raise ValueError(f"{where}: needs 'answer' or a 'solution' with a \\boxed{{}} answer")
            if solution:
                solution = f"{solution.strip()}\nThe final answer is \\boxed{{{gold}}}."
            problems.append(Problem(id=f"math-{split}-{i}", question=question, answer=str(gold),
                                    solution=solution, metadata={k: row[k] for k in ("level", "type") if k in row}))
        return problems[:num] if num else problems

    def prompt(self, problem: Problem) -> str:
        return PROMPT_002.format(question=problem.question)

    def score(self, problem: Problem, completion: str) -> RewardResult:
        return self.score_many([problem], [completion])[0]

    def score_many(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[RewardResult]:
        answers = [last_boxed(c) for c in completions]
        to_check = [i for i, a in enumerate(answers) if a is not None]
        outcomes = dict(zip(to_check, self.verifier.verify_many(
            [(problems[i].answer, answers[i]) for i in to_check])))
        results = []
        for i, answer in enumerate(answers):
            if answer is None:
                results.append(RewardResult(binary_reward(False, self.reward_scheme), False, True, None))
                continue
            outcome = outcomes[i]
            info = {"verifier": outcome.status, "detail": outcome.detail}
            if outcome.status != "ok":
                info["reward_error"] = REWARD_ERRORS[outcome.status]
            results.append(RewardResult(binary_reward(outcome.correct, self.reward_scheme), outcome.correct,
                                        False, answer, info))
        return results

    def metrics(self) -> dict[str, float]:
        counts = self.verifier.counts
        return {**self.verifier.metrics(),
                **reward_error_metrics(["timeout"] * counts["timeout"] + ["verifier_error"] * counts["error"])}
