"""Environments by name (`env.name`), or by import path as custom tasks are; the runner an
experiment config's `env:` section describes.

A name with a colon (`env.name: my_package.envs:MyEnv`) is imported (installed or on
PYTHONPATH) and called with `task=` (the task `data.task` names) and `env.options` as keyword
arguments; it must give an `Environment` (envs/base.py). The `python` environment runs model
code in a sandboxed process and is refused unless `env.python_tool: true`.
"""

from __future__ import annotations

import importlib
from typing import Any

from jaxrl_llm.core.errors import ConfigError
from jaxrl_llm.envs.base import Environment
from jaxrl_llm.envs.episodes import EpisodeRunner
from jaxrl_llm.envs.parsers import get_parser
from jaxrl_llm.envs.render import TurnRenderer
from jaxrl_llm.tasks.base import Task
from jaxrl_llm.tasks.registry import resolve_import_path

# name -> "module:Class"; imported when named.
_ENVIRONMENTS: dict[str, str] = {
    "calculator": "jaxrl_llm.envs.calculator:CalculatorEnv",
    "countdown_game": "jaxrl_llm.envs.countdown_game:CountdownGame",
    "python": "jaxrl_llm.envs.python_tool:PythonEnv",
}
NEEDS_PYTHON_TOOL = frozenset({"python"})


def register_environment(name: str, target: str) -> None:
    """Register `target` ("module:Class") under `name`."""
    if name in _ENVIRONMENTS and _ENVIRONMENTS[name] != target:
        raise ValueError(f"environment {name!r} is already registered as {_ENVIRONMENTS[name]}")
    _ENVIRONMENTS[name] = target


def environment_names() -> list[str]:
    return sorted(_ENVIRONMENTS)


def get_environment(name: str, *, task: Task | None = None, python_tool: bool = False,
                    **options: Any) -> Environment:
    """The environment `name` names, built with `task=` and `options`."""
    if name in NEEDS_PYTHON_TOOL and not python_tool:
        raise PermissionError(
            f"environment {name!r} runs model-written code (in a sandboxed process) and is off "
            "by default: set env.python_tool=true to use it (docs/environments.md § The Python "
            "tool)")
    if name in _ENVIRONMENTS:
        module_name, attr = _ENVIRONMENTS[name].split(":")
        factory = getattr(importlib.import_module(module_name), attr)
    elif ":" in name:
        factory = resolve_import_path(name, "environment")
    else:
        raise KeyError(f"unknown environment {name!r}; known: {', '.join(environment_names())}, "
                       "or an import path 'package.module:Factory'")
    env = factory(task=task, **options)
    if not isinstance(env, Environment):
        raise TypeError(f"environment {name!r} gave {type(env).__name__}, not an Environment "
                        "(subclass jaxrl_llm.envs.Environment: docs/environments.md)")
    if not getattr(env, "name", ""):
        env.name = name
    return env


def env_from_config(config: Any, task: Task | None) -> Environment | None:
    """The environment of the config's `env:` section (None: single-turn, `env.name: null`);
    a `ConfigError` naming the key when it cannot be built."""
    e = config.env
    if e.name is None:
        return None
    try:
        env = get_environment(e.name, task=task, python_tool=e.python_tool, **e.options)
    except (KeyError, TypeError, ValueError, PermissionError) as err:
        raise ConfigError(f"env.name={e.name!r} / env.options: {err}") from err
    if e.max_turns is not None:
        env.max_turns = e.max_turns
    if hasattr(env, "parser"):  # a tool environment: the parser the config names
        try:
            env.parser = get_parser(e.tool_parser)
        except KeyError as err:
            raise ConfigError(f"env.tool_parser={e.tool_parser!r}: {err}") from err
    sandbox = getattr(env, "sandbox", None)
    if sandbox is not None:  # every run of a turn must end before the turn's timeout
        worst = sandbox.limits.timeout_s * getattr(env, "max_calls_per_turn", 1)
        if worst >= e.timeout_s:
            raise ConfigError(
                f"env.timeout_s={e.timeout_s:g} must exceed the Python tool's timeout_s="
                f"{sandbox.limits.timeout_s:g} × max_calls_per_turn="
                f"{getattr(env, 'max_calls_per_turn', 1)} = {worst:g} s (env.options)")
    return env


def runner_from_config(config: Any, env: Environment, tokenizer: Any, *,
                       max_episode_tokens: int | None = None) -> EpisodeRunner:
    """The episode runner for `env`: the config's limits, and its tokenizer's chat template
    (`data.chat_template`). `max_episode_tokens`: the completion budget of an episode
    (default generate.max_new_tokens)."""
    e = config.env
    try:
        renderer = TurnRenderer(tokenizer, chat_template=config.data.chat_template,
                                tools=env.tools())
    except ValueError as err:  # TemplateError: a template the token deltas cannot use
        raise ConfigError(f"env.name={e.name!r} with data.chat_template="
                          f"{config.data.chat_template}: {err}") from err
    return EpisodeRunner(
        env, renderer, max_turns=env.max_turns,
        max_episode_tokens=max_episode_tokens or config.generate.max_new_tokens,
        timeout_s=e.timeout_s, workers=e.workers,
        max_observation_tokens=e.max_observation_tokens)
