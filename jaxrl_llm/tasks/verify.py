"""`verify` (TOPR arXiv:2503.14286 §4.4): a generative verifier trained on existing records.

Each problem is a stored record's question plus its candidate solution and a request for a
verdict; the gold verdict is the record's own correctness. Reward +1 when the parsed verdict
matches, −1 otherwise; invalid when no verdict parses. Verdicts feed weighted
self-consistency at evaluation (TOPR §4.2, FPA App. B.3).
"""

from __future__ import annotations

import re

from jaxrl_llm.data.shards import RecordSource
from jaxrl_llm.tasks.base import Problem, RewardResult, RewardScheme, Task, binary_reward

# `\s*(?:\*+\s*)?`, not `\s*\**\s*`: two adjacent `\s*` made a run of spaces quadratic.
_VERDICT = re.compile(r"verdict is:?\s*(?:\*+\s*)?(correct|incorrect)\b", re.IGNORECASE)
REQUEST = (
    "Check the proposed solution step by step. Finish with 'The verdict is correct' or "
    "'The verdict is incorrect'."
)


def parse_verdict(text: str) -> bool | None:
    """True/False for the LAST verdict in `text`; None when there is none."""
    last = None
    for match in _VERDICT.finditer(text[-20_000:]):  # verdicts sit at the end; bound the scan
        last = match.group(1).lower() == "correct"
    return last


class VerifyTask(Task):
    name = "verify"
    reward_fn = "±1: parsed verdict equals the candidate's correctness; no verdict -> invalid"

    def __init__(self, *, path: str | None = None, include_invalid: bool = False,
                 reward_scheme: RewardScheme = "pm1") -> None:
        super().__init__(reward_scheme=reward_scheme)
        self.path, self.include_invalid = path, include_invalid

    def load(self, *, split: str = "train", num: int | None = None, seed: int = 0) -> list[Problem]:
        if self.path is None:
            raise ValueError("task 'verify' needs path= a record directory (data.task_path)")

        source = RecordSource(self.path)
        problems = []
        for i, record in enumerate(source):
            if record.invalid and not self.include_invalid:
                continue
            question = record.metadata.get("question")
            if question is None:
                raise ValueError(f"{source.where(i)}: record has no metadata['question'] to verify against")
            problems.append(Problem(
                id=f"verify-{i}",
                question=str(question),
                answer="correct" if record.correct else "incorrect",
                metadata={"candidate": record.completion_text, "source_index": i,
                          "source_group": record.group_id},
            ))
            if num and len(problems) >= num:
                break
        return problems

    def prompt(self, problem: Problem) -> str:
        return (f"Problem: {problem.question}\n\nProposed solution: {problem.metadata['candidate']}\n\n"
                f"{REQUEST}\n")

    def score(self, problem: Problem, completion: str) -> RewardResult:
        verdict = parse_verdict(completion)
        if verdict is None:
            return RewardResult(binary_reward(False, self.reward_scheme), False, True, None)
        correct = verdict == (problem.answer == "correct")
        answer = "correct" if verdict else "incorrect"
        return RewardResult(binary_reward(correct, self.reward_scheme), correct, False, answer)
