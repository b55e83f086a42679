"""`python`: a task answered with a Python tool that runs the model's code in a sandboxed child
process (`envs/sandbox.py`). Off by default: `env.name: python` needs `env.python_tool: true`.

The tool's answer is the run's stdout; a run that fails (a traceback, a refused operation, a
limit reached, the wall-clock timeout) is an error observation with its stderr and status.
The limits are env.options (`timeout_s`, `cpu_s`, `memory_mb`, `file_mb`, `open_files`,
`max_output_chars`; `envs.sandbox.SandboxLimits`); docs/environments.md § The Python tool.
"""

from __future__ import annotations

from typing import Any

from jaxrl_llm.envs.sandbox import PythonSandbox, SandboxLimits
from jaxrl_llm.envs.tool_env import ToolEnvironment
from jaxrl_llm.envs.tools import Tool, ToolCallError, tool
from jaxrl_llm.tasks.base import Task


def python_tool(sandbox: PythonSandbox) -> Tool:
    """The `python` tool over `sandbox`."""

    def python(code: str) -> str:
        """Run a Python program (standard library only, no network, no files outside its
        working directory) and return what it prints.

        Args:
            code: The program; print the values you need.
        """
        result = sandbox.run(code)
        if not result.ok:
            raise ToolCallError(result.observation())
        return result.observation()

    return tool(python)


class PythonEnv(ToolEnvironment):
    """The task's problems, with the sandboxed `python` tool (env.name: python)."""

    name = "python"
    max_turns = 4
    instructions = ("You can call the python tool to run code; print what you need. When you "
                    "know the final answer, reply with it in the format asked for and no tool "
                    "call.")

    def __init__(self, *, task: Task | None = None, tool_parser: Any = "hermes",
                 max_calls_per_turn: int = 2, **limits: Any) -> None:
        try:
            self.sandbox = PythonSandbox(SandboxLimits(**limits))
        except TypeError as err:
            raise TypeError(f"environment 'python': {err}; its options are the limits of "
                            "jaxrl_llm.envs.sandbox.SandboxLimits") from err
        super().__init__(task=task, tool_parser=tool_parser,
                         max_calls_per_turn=max_calls_per_turn)

    def default_tools(self) -> list[Tool]:
        return [python_tool(self.sandbox)]
