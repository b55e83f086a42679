"""The task interface: problems, prompts, gold solutions and reward functions (TOPR §4.1, FPA App. B.1).

A task turns a `Problem` into a prompt string and scores a completion string into a
`RewardResult`. Rewards are ±1 by default (TOPR arXiv:2503.14286, FPA arXiv:2509.19893); `reward_scheme="01"` maps them to 0/1
and tasks may return continuous scores (PKPO arXiv:2505.15201).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

RewardScheme = Literal["pm1", "01"]
# A reward that could not be computed is flagged, never a silent 0: verifier status -> the
# `reward_error` a result's info (and so its record's metadata) carries.
REWARD_ERRORS = {"timeout": "timeout", "error": "verifier_error"}


@dataclasses.dataclass(frozen=True)
class Problem:
    """One prompt's worth of task data."""

    id: str
    question: str
    answer: str  # gold final answer, as the task compares it
    solution: str | None = None  # gold step-by-step solution ending in the task's answer format
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class RewardResult:
    reward: float
    correct: bool
    invalid: bool  # no parsable answer (TOPR Fig. 3)
    answer: str | None  # extracted answer, None when invalid
    info: dict[str, Any] = dataclasses.field(default_factory=dict)  # e.g. {"timeout": True}


def reward_error_metrics(errors: Sequence[str | None]) -> dict[str, float]:
    """`reward/timeouts` and `reward/verifier_errors`: how many rewards could not be computed."""
    return {"reward/timeouts": float(sum(e == "timeout" for e in errors)),
            "reward/verifier_errors": float(sum(e == "verifier_error" for e in errors))}


def binary_reward(correct: bool, scheme: RewardScheme) -> float:
    """±1 (default) or 0/1 for a correct/incorrect outcome."""
    if scheme == "pm1":
        return 1.0 if correct else -1.0
    if scheme == "01":
        return 1.0 if correct else 0.0
    raise ValueError(f"unknown reward scheme {scheme!r} (expected 'pm1' or '01')")


class Prompt(str):
    """A task prompt (the user's turn) that may carry a system message (`data.system_prompt`):
    `generate.completions.format_prompts` puts it in the chat template's system turn, or
    before the prompt as plain text."""

    system: str | None = None

    def __new__(cls, text: str, system: str | None = None) -> Prompt:
        prompt = super().__new__(cls, text)
        prompt.system = system
        return prompt


def with_system_prompt(task: Task, system: str) -> Task:
    """`task`, whose prompts now carry `system` (every backend formats it the same way)."""
    user_turn = task.prompt
    task.prompt = lambda problem: Prompt(user_turn(problem), system)  # type: ignore[method-assign]
    return task


class Task:
    """Base class: subclasses set `name` and implement `load`, `prompt`, `score`."""

    name: str = ""
    reward_fn: str = ""  # human-readable reward description for the manifest

    def __init__(self, *, reward_scheme: RewardScheme = "pm1") -> None:
        binary_reward(True, reward_scheme)  # validates the scheme early
        self.reward_scheme: RewardScheme = reward_scheme

    def load(self, *, split: str = "train", num: int | None = None, seed: int = 0) -> list[Problem]:
        raise TypeError(f"task {self.name!r} does not define load()")

    def prompt(self, problem: Problem) -> str:
        raise TypeError(f"task {self.name!r} does not define prompt()")

    def score(self, problem: Problem, completion: str) -> RewardResult:
        raise TypeError(f"task {self.name!r} does not define score()")

    def score_many(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[RewardResult]:
        """Score a batch; tasks with an expensive verifier override this to parallelise."""
        return [self.score(p, c) for p, c in zip(problems, completions, strict=True)]

    def gold_completion(self, problem: Problem) -> str | None:
        """The gold solution as a completion (SFT warm start, as FPA); None if unknown."""
        return problem.solution

    def metrics(self) -> dict[str, float]:
        """Counters accumulated while scoring (verifier timeouts, failures); zero here."""
        return reward_error_metrics([])
