"""Tasks: problems, prompts, answer extraction and reward functions (TOPR §4.1, FPA App. B.1)."""

from jaxrl_llm.tasks.base import Problem, RewardResult, Task
from jaxrl_llm.tasks.registry import get_task, register_task, task_from_config, task_names

__all__ = ["Problem", "RewardResult", "Task", "get_task", "register_task", "task_from_config",
           "task_names"]
