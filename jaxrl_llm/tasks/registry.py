"""Task registry: `get_task("gsm8k", path=...)` builds a task by name, or by import path.

A name with a colon (`data.task: my_package.rewards:make_task`) is an import path: the
module is imported (it must be installed or on PYTHONPATH) and the attribute after the colon
(a `Task` subclass or a function returning a `Task`) is called with the task keyword
arguments (`reward_scheme`, `path` from `data.task_path`, and `data.task_options`). The
protocol the object must follow is `tasks/base.py`'s `Task`; docs/custom_tasks.md has an
example.
"""

from __future__ import annotations

import importlib
from typing import Any

from jaxrl_llm.core.errors import ConfigError
from jaxrl_llm.tasks.base import Task, with_system_prompt

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


class TaskNotFound(KeyError):
    """A task name or import path that does not resolve (the message names it)."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


# What a task object must provide (tasks/base.py's `Task` has all of them).
TASK_METHODS = ("load", "prompt", "score", "score_many", "gold_completion", "metrics")


def resolve_import_path(target: str, what: str = "task") -> Any:
    """The callable `module.sub:attr.sub` names; a `TaskNotFound` naming what is missing
    (`what`: the kind of object, for the message — a task, an environment, a tool parser)."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise TaskNotFound(f"{what} import path {target!r} is not of the form "
                           "'package.module:factory'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise TaskNotFound(f"{what} import path {target!r}: cannot import module "
                           f"{module_name!r} ({err}); install it or put it on PYTHONPATH"
                           ) from err
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise TaskNotFound(f"{what} import path {target!r}: module {module_name!r} has no "
                               f"attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        hint = " (give a Task subclass or a function returning a Task)" if what == "task" else ""
        raise TaskNotFound(f"{what} import path {target!r}: {attr!r} is not callable{hint}")
    return obj


def task_from_import_path(target: str, **kwargs: Any) -> Task:
    """Call the factory `target` names with `kwargs` and check the result is a task."""
    task = resolve_import_path(target)(**kwargs)
    missing = [m for m in TASK_METHODS if not callable(getattr(task, m, None))]
    if missing:
        raise TypeError(f"task import path {target!r} returned {type(task).__name__}, which "
                        f"lacks {missing}; subclass jaxrl_llm.tasks.Task (docs/custom_tasks.md)")
    if not getattr(task, "name", ""):
        task.name = target  # manifests record the task's name
    return task


def get_task(name: str, **kwargs: Any) -> Task:
    if (":" in name or "." in name) and name not in _TASKS:  # "pkg.mod:factory"
        return task_from_import_path(name, **kwargs)
    if name not in _TASKS:
        raise TaskNotFound(f"unknown task {name!r}; known: {', '.join(task_names())}, or an "
                           "import path 'package.module:factory'")
    module_name, class_name = _TASKS[name].split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(**kwargs)


def task_from_config(config: Any) -> Task:
    """The task an experiment config's `data` section names (`data.task`, `task_path`,
    `task_options`, `reward_scheme`, `system_prompt`); a `ConfigError` naming those keys when
    it cannot be built."""
    d = config.data
    kwargs: dict[str, Any] = {"reward_scheme": d.reward_scheme, **d.task_options}
    if d.task_path is not None:
        kwargs["path"] = d.task_path
    try:
        task = get_task(d.task, **kwargs)
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"data.task={d.task!r} / data.task_options: {err}") from err
    if getattr(d, "system_prompt", None):
        task = with_system_prompt(task, d.system_prompt)
    return task
