"""`ToolEnvironment`: a task answered with tools. Each model turn's tool calls run and their
results come back as tool messages; a turn without a tool call is the final answer (done),
which `score` grades with the task.

A call that cannot run — malformed JSON, an unknown tool, arguments that do not fit the
tool's schema, a tool that raises, more calls in one turn than `max_calls_per_turn` — is an
error message the model reads and can act on ("Error: ..."), counted in the turn's info
(`tool_errors`); it never ends the episode by itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from jaxrl_llm.envs.base import Environment, EnvResponse
from jaxrl_llm.envs.parsers import ParsedTurn, get_parser
from jaxrl_llm.envs.tools import Tool, ToolCallError, tool_table
from jaxrl_llm.tasks.base import Problem, Task


@dataclasses.dataclass
class ToolState:
    problem: Problem
    tool_calls: int = 0
    tool_errors: int = 0


class ToolEnvironment(Environment):
    """Tools over a task (subclasses give `default_tools` or pass `tools=`)."""

    name = "tools"
    instructions = ("You can call the tools listed above. When you know the final answer, "
                    "reply with it and no tool call.")

    def __init__(self, *, task: Task | None = None, tools: Sequence[Tool] | None = None,
                 tool_parser: str | Callable[[str], ParsedTurn] = "hermes",
                 max_calls_per_turn: int = 4) -> None:
        super().__init__(task=task)
        self._tools = list(tools if tools is not None else self.default_tools())
        self._table = tool_table(self._tools)
        self.parser = get_parser(tool_parser) if isinstance(tool_parser, str) else tool_parser
        if max_calls_per_turn < 1:
            raise ValueError(f"max_calls_per_turn={max_calls_per_turn} must be >= 1")
        self.max_calls_per_turn = max_calls_per_turn

    def default_tools(self) -> list[Tool]:
        return []

    def tools(self) -> list[Tool]:
        return list(self._tools)

    def system_prompt(self, problem: Problem) -> str | None:
        task_system = super().system_prompt(problem)
        return f"{task_system}\n\n{self.instructions}" if task_system else self.instructions

    def start(self, problem: Problem) -> ToolState:
        return ToolState(problem)

    def run_call(self, name: str, arguments: dict[str, Any]) -> str:
        """One call's result text; `ToolCallError` for anything the model should read."""
        if name not in self._table:
            raise ToolCallError(f"unknown tool {name!r}; the tools are {sorted(self._table)}")
        return self._table[name].call(arguments)

    def respond(self, state: ToolState, model_text: str) -> EnvResponse:
        parsed = self.parser(model_text)
        if parsed.empty:
            return EnvResponse([], done=True, info={"tool_calls": []})
        messages = [{"role": "tool", "content": f"Error: {e}"} for e in parsed.errors]
        calls: list[dict[str, Any]] = [{"error": e} for e in parsed.errors]
        for i, call in enumerate(parsed.calls):
            entry: dict[str, Any] = {"name": call.name, "arguments": call.arguments}
            try:
                if i >= self.max_calls_per_turn:
                    raise ToolCallError(f"more than {self.max_calls_per_turn} tool calls in one "
                                        "turn; this one was not run")
                content = self.run_call(call.name, call.arguments)
                entry["result"] = content
            except ToolCallError as err:
                content = f"Error: {err}"
                entry["error"] = str(err)
            messages.append({"role": "tool", "name": call.name, "content": content})
            calls.append(entry)
        errors = sum("error" in c for c in calls)
        state.tool_calls += len(calls)
        state.tool_errors += errors
        return EnvResponse(messages, done=False, info={"tool_calls": calls, "tool_errors": errors})
