"""Task registry: `get_task("gsm8k", path=...)` builds a task by name."""

from __future__ import annotations

import importlib
from typing import Any

from jaxrl_llm.tasks.base import Task

# name -> "module:Class"; modules import lazily so `math` does not start a process pool early.
_TASKS: dict[str, str] = {
    "arithmetic": "jaxrl_llm.tasks.arithmetic:ArithmeticTask",
    "countdown": "jaxrl_llm.tasks.countdown:CountdownTask",
    "gsm8k": "jaxrl_llm.tasks.gsm8k:GSM8KTask",
    "math": "jaxrl_llm.tasks.math_task:MathTask",
    "verify": "jaxrl_llm.tasks.verify:VerifyTask",
}


def register_task(name: str, target: str) -> None:
    """Register `target` ("module:Class") under `name`."""
    if name in _TASKS and _TASKS[name] != target:
        raise ValueError(f"task {name!r} is already registered as {_TASKS[name]}")
    _TASKS[name] = target


def task_names() -> list[str]:
    return sorted(_TASKS)


def get_task(name: str, **kwargs: Any) -> Task:
    if name not in _TASKS:
        raise KeyError(f"unknown task {name!r}; known: {', '.join(task_names())}")
    module_name, class_name = _TASKS[name].split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(**kwargs)
