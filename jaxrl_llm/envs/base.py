"""The environment protocol: what a multi-turn, tool-using task implements.

An episode starts from a task's `Problem` (tasks/base.py). The model writes a turn; the
environment answers it (`respond`) with chat messages to append, or says the episode is done;
this alternates until done or a turn or token limit (`envs/episodes.py`, which runs every
environment call on the host, in parallel, with a timeout). The reward comes at the end from
`score` alone — per-turn rewards are optional extras — and a truncated episode's reward is
whatever `score` gives for it (the default scores the last model turn with the task, so an
episode cut off mid tool call gets the task's reward for a missing answer).

User environments are named by import path, as custom tasks are (`env.name:
package.module:Factory`); the factory is called with `task=` (the task `data.task` names) and
the keyword arguments of `env.options`. docs/environments.md has the protocol and an example.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

from jaxrl_llm.tasks.base import Problem, RewardResult, Task

ROLES = ("tool", "user")  # the roles an environment's messages may take


@dataclasses.dataclass
class EnvResponse:
    """What an environment answers after one model turn."""

    messages: list[dict[str, str]]  # chat messages to append (role "tool" or "user"); [] when done
    done: bool
    reward: float | None = None  # optional per-turn reward (kept in the record's metadata)
    info: dict[str, Any] = dataclasses.field(default_factory=dict)  # JSON-able: tool calls, errors


class Environment(abc.ABC):
    """Base class: subclass it and implement `respond` (and usually `start` and `score`).

    The defaults use the task: the first user turn is the task's prompt (with its system
    message, `data.system_prompt`), and `score` scores the last model turn with the task.
    """

    name: str = ""
    max_turns: int = 4  # model turns per episode (env.max_turns overrides it)

    def __init__(self, *, task: Task | None = None) -> None:
        self.task = task

    def _task(self) -> Task:
        if self.task is None:
            raise TypeError(f"environment {self.name or type(self).__name__!r} has no task: "
                            "give it one (data.task) or override user_prompt and score")
        return self.task

    def tools(self) -> list[Any]:
        """The tools the chat template lists (`envs.tools.Tool`); none by default."""
        return []

    def system_prompt(self, problem: Problem) -> str | None:
        return getattr(self._task().prompt(problem), "system", None)

    def user_prompt(self, problem: Problem) -> str:
        """The first user turn (default: the task's prompt)."""
        return str(self._task().prompt(problem))

    def start(self, problem: Problem) -> Any:
        """Per-episode state, handed to every `respond` and to `score`."""
        return None

    @abc.abstractmethod
    def respond(self, state: Any, model_text: str) -> EnvResponse:
        """The environment's answer to one model turn (every subclass defines it: a subclass
        without it cannot be instantiated, so no episode starts on a missing method)."""

    def score(self, state: Any, problem: Problem, model_turns: list[str]) -> RewardResult:
        """The episode's reward: by default the task's score of the last model turn."""
        return self._task().score(problem, model_turns[-1] if model_turns else "")


def check_response(response: Any, where: str) -> EnvResponse:
    """`response` if it keeps the protocol, else a `TypeError` saying what it broke (the
    runner turns it into an "env_error" truncation)."""
    if not isinstance(response, EnvResponse):
        raise TypeError(f"{where}: respond() returned {type(response).__name__}, not EnvResponse")
    if not isinstance(response.messages, list):
        raise TypeError(f"{where}: messages must be a list, got {type(response.messages).__name__}")
    for i, message in enumerate(response.messages):
        if not isinstance(message, dict):
            raise TypeError(f"{where}: message {i} is {type(message).__name__}, not a dict")
        if message.get("role") not in ROLES:
            raise TypeError(f"{where}: message {i} has role {message.get('role')!r}; an "
                            f"environment answers as {' or '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise TypeError(f"{where}: message {i} content is "
                            f"{type(message.get('content')).__name__}, not a string")
    if not response.done and not response.messages:
        raise TypeError(f"{where}: not done but no message for the model to read")
    if response.reward is not None and not isinstance(response.reward, int | float):
        raise TypeError(f"{where}: reward must be a number or None, got "
                        f"{type(response.reward).__name__}")
    if not isinstance(response.info, dict):
        raise TypeError(f"{where}: info must be a dict, got {type(response.info).__name__}")
    return response
