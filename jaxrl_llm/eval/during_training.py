"""`train.eval_every`: evaluate the policy while it trains, from the command line.

Every `train.eval_every` steps the trainer calls the hook with its current state; the hook
samples `eval.n` completions for each of `eval.num_questions` held-out questions (`eval.split`
of the task, from `eval.task_path` when set, else `data.task_path`) at `eval.temperature` with
the JAX sampler, grades them with the task and returns pass@1 ± SE (FPA arXiv:2509.19893
eq. 30), pass@n and the invalid rate. The trainer logs them as `eval/…` in metrics.jsonl
(TensorBoard, W&B) and `jaxrl-llm report` plots pass@1 with its 2-SE band.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from jaxrl_llm.core.errors import ConfigError
from jaxrl_llm.envs.sampled import runner_for
from jaxrl_llm.eval.evaluate import evaluate_model
from jaxrl_llm.tasks import task_from_config


def eval_task(config: Any) -> Any:
    """The task evaluation reads: `data.task`, with `eval.task_path` instead of
    `data.task_path` when set (a local file holds one split: give the test file here)."""
    if config.eval.task_path is None:
        return task_from_config(config)
    data = config.data.model_copy(update={"task_path": config.eval.task_path})
    return task_from_config(config.model_copy(update={"data": data}))


def make_eval_hook(config: Any, tokenizer: Any, *, progress: bool = False
                   ) -> Callable[[int, Any], Mapping[str, float]]:
    """`(step, train state) -> metrics`: the evaluation above of the state's policy; with
    `progress`, its own bar ("evaluate TASK at step N", as `jaxrl-llm evaluate` shows)."""
    e, g = config.eval, config.generate
    task = eval_task(config)
    problems = task.load(split=e.split, num=e.num_questions, seed=config.seed)
    if not problems:
        raise ConfigError(f"train.eval_every: eval.split={e.split!r} of data.task={config.data.task!r} "
                          "has no questions")

    runner = runner_for(config, task, tokenizer, max_new_tokens=e.max_new_tokens)

    def hook(step: int, state: Any) -> Mapping[str, float]:
        summary, _ = evaluate_model(
            state.model(), tokenizer, task, problems, n=e.n,
            temperature=g.temperature if e.temperature is None else e.temperature,
            max_new_tokens=e.max_new_tokens or g.max_new_tokens,
            batch_size=e.batch_size or g.batch_size, seed=e.seed, maj_k=(1,), trials=2,
            chat_template=config.data.chat_template, progress=progress,
            sampler=config.generate.sampler_options(), runner=runner,
            desc=" ".join(filter(None, ("evaluate", getattr(task, "name", ""), f"at step {step}"))))
        top = max(summary["pass_at_k"], key=int)
        return {"pass_at_1": summary["pass_at_1"]["mean"], "pass_at_1_se": summary["pass_at_1"]["se"],
                f"pass_at_{top}": summary["pass_at_k"][top],
                "invalid": summary["proportions"]["invalid"]}

    return hook
