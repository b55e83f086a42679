"""The `env:` section (envs/: multi-turn, tool-using episodes; docs/environments.md)."""

from __future__ import annotations

from typing import Any

from pydantic import (
    Field,
    model_validator,
)

from jaxrl_llm.config.base import Section


class EnvConfig(Section):
    """Multi-turn episodes: the environment, its tools and limits (docs/environments.md)."""

    # a built-in environment (calculator, countdown_game, python) or an import path
    # package.module:Factory; null: single-turn completions
    name: str | None = None
    options: dict[str, Any] = Field(default_factory=dict, description="the environment's "
                                    "constructor keyword arguments (besides task=)")
    max_turns: int | None = Field(None, gt=0, description="model turns per episode (null: the "
                                  "environment's own max_turns)")
    # how tool calls are read from the model's text: hermes (a JSON object in tool_call tags,
    # as Qwen2.5 and the Hermes models write them) or an import path package.module:function
    tool_parser: str = "hermes"
    # seconds an environment's answer to one turn may take; a slower one ends the episode,
    # truncated env_timeout (the call is abandoned: a thread cannot be killed)
    timeout_s: float = Field(30.0, gt=0)
    workers: int = Field(8, gt=0)  # environment calls run at the same time (host threads)
    # tokens one environment answer may take (null: only the episode's token budget bounds
    # it); a longer one ends the episode, truncated max_observation_tokens
    max_observation_tokens: int | None = Field(1024, gt=0)
    # allow env.name: python, which runs model-written code in a sandboxed child process
    # (resource limits, no network, its own temporary directory): off by default
    python_tool: bool = False

    @model_validator(mode="after")
    def _python_needs_consent(self) -> EnvConfig:
        if self.name == "python" and not self.python_tool:
            raise ValueError("env.name=python runs model-written code (in a sandboxed child "
                             "process) and is off by default: set env.python_tool=true "
                             "(docs/environments.md § The Python tool)")
        return self
