"""Backend-neutral completions -> scored `Record`s (one per completion, docs/kernels.md notation).

Both backends (JAX sampler, vLLM) produce `Completion`s; this module decodes them, scores
them with the task in one batch (so the MATH verifier pool works in parallel) and builds the
records the shard writer stores.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl_llm.core.errors import ConfigError
from jaxrl_llm.data.records import Record
from jaxrl_llm.data.sampler_info import (  # noqa: F401 (re-exported: the backends' import path)
    effective_temperature,
    manifest_sampler_info,
    sampler_logprob_info,
)
from jaxrl_llm.tasks.base import Problem, Task


@dataclasses.dataclass
class Completion:
    prompt_index: int  # index into the problems of this call
    token_ids: np.ndarray  # [C] int32, stop token included
    logprobs: np.ndarray | None  # [C] sampler log-probs after temperature/top-k/top-p
    raw_logprobs: np.ndarray | None = None  # [C] before truncation (or as the backend defines)
    finish_reason: str = ""
    routing: np.ndarray | None = None  # [C-1, L, k] experts per fed token (data/routing.py)


TEMPLATE_NOTICE = ("data.chat_template is unset: the tokenizer has a chat template, so prompts "
                   "go through it (set data.chat_template=false for raw text)")
_SAID: list[bool] = []  # the notice was printed (once a process)


def uses_chat_template(tokenizer: Any, chat_template: bool | None) -> bool:
    """`data.chat_template`, with None (the default) meaning: the tokenizer's own chat
    template when it has one (instruct models expect it). Applying it unasked is said on
    stderr, once a process; raw text (no template to apply) goes unsaid."""
    if chat_template is not None:
        return chat_template
    found = bool(getattr(tokenizer, "chat_template", None))
    if found and not _SAID:
        _SAID.append(True)
        print(TEMPLATE_NOTICE, file=sys.stderr)
    return found


def format_prompts(tokenizer: Any, prompts: Sequence[str], *,
                   chat_template: bool | None = False) -> list[str]:
    """The prompts as the model sees them (`data.chat_template`, `uses_chat_template`).

    Raw text, or each task prompt as one user turn of the tokenizer's chat template with the
    assistant turn opened — how an instruct model expects to be asked (SmolLM2-Instruct's
    ChatML, say); without it such a model mostly answers off-format. A prompt's system
    message (`tasks.base.Prompt`, `data.system_prompt`) is the template's system turn, or
    the text's first paragraph without a template.
    """
    if not uses_chat_template(tokenizer, chat_template):
        return [f"{p.system}\n\n{p}" if getattr(p, "system", None) else str(p) for p in prompts]
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"data.chat_template=true but tokenizer "
                          f"{getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__!r} "
                          "has no chat template")

    def turns(text: str) -> list[dict[str, str]]:
        system = getattr(text, "system", None)
        return ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": str(text)}]

    return [tokenizer.apply_chat_template(turns(text), tokenize=False, add_generation_prompt=True)
            for text in prompts]


def encode_prompts(tokenizer: Any, prompts: Sequence[str], *,
                   chat_template: bool | None = False) -> list[list[int]]:
    """Token ids of each prompt (already through `format_prompts`); an empty encoding is an
    error naming the prompt. Templated prompts carry their own special tokens (BOS etc.)."""
    templated = uses_chat_template(tokenizer, chat_template)
    out = []
    for i, text in enumerate(prompts):
        ids = list(tokenizer.encode(text, add_special_tokens=not templated))
        if not ids:
            raise ValueError(f"prompt {i} encodes to no tokens: {text[:60]!r}")
        out.append(ids)
    return out


def build_records(
    task: Task,
    problems: Sequence[Problem],
    prompt_ids: Sequence[Sequence[int]],
    completions: Sequence[Completion],
    tokenizer: Any,
    *,
    group_offset: int = 0,
    prompts: Sequence[str] | None = None,
) -> list[Record]:
    """Score completions and build records; `group_id = group_offset + prompt_index`."""
    texts = [tokenizer.decode(c.token_ids.tolist(), skip_special_tokens=True) for c in completions]
    results = task.score_many([problems[c.prompt_index] for c in completions], texts)
    records = []
    for c, text, result in zip(completions, texts, results, strict=True):
        problem = problems[c.prompt_index]
        records.append(Record(
            prompt_ids=np.asarray(prompt_ids[c.prompt_index], np.int32),
            completion_ids=c.token_ids,
            reward=result.reward, correct=result.correct, invalid=result.invalid,
            group_id=group_offset + c.prompt_index, task=task.name,
            behavior_logprobs=c.logprobs, raw_logprobs=c.raw_logprobs, routing=c.routing,
            answer=result.answer,
            prompt_text=prompts[c.prompt_index] if prompts is not None else "",
            completion_text=text,
            metadata={"problem_id": problem.id, "question": problem.question, "gold": problem.answer,
                      "finish_reason": c.finish_reason, **_jsonable(result.info)},
        ))
    return records


def gold_records(task: Task, problems: Sequence[Problem], tokenizer: Any, *,
                 eos_token_id: int | None = None, group_offset: int = 0,
                 chat_template: bool | None = False) -> list[Record]:
    """Gold solutions as SFT records (warm start as in FPA arXiv:2509.19893): reward +1, correct, no log-probs."""
    records = []
    prompts = format_prompts(tokenizer, [task.prompt(p) for p in problems], chat_template=chat_template)
    ids = encode_prompts(tokenizer, prompts, chat_template=chat_template)
    for i, (problem, prompt, pids) in enumerate(zip(problems, prompts, ids)):
        gold = task.gold_completion(problem)
        if gold is None:
            continue
        completion = list(tokenizer.encode(gold, add_special_tokens=False))
        if eos_token_id is not None:
            completion.append(int(eos_token_id))
        result = task.score(problem, gold)
        if not result.correct:
            raise ValueError(f"task {task.name!r}: gold solution of {problem.id} does not score correct: {result}")
        records.append(Record(
            prompt_ids=pids, completion_ids=completion, reward=result.reward, correct=True,
            group_id=group_offset + i, task=task.name, answer=result.answer, prompt_text=prompt,
            completion_text=gold, metadata={"problem_id": problem.id, "question": problem.question,
                                            "gold": problem.answer, "source": "gold"},
        ))
    return records


def _jsonable(info: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in info.items() if isinstance(v, str | int | float | bool) or v is None}
