"""`jaxrl-llm evaluate --model (checkpoint|HF dir) --task T --n N`: sample N completions per
test question, grade them with the task and write every evaluation number (TOPR §4.2, FPA App. B.3) to `eval.json`.

Also used in-process by `quickstart` and `iterate` (`evaluate_model`), which reuse the
sampler's compiled program across evaluations of models of the same shape.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from etils import epath

from jaxrl_llm.core.atomic import atomic_open, atomic_write_text
from jaxrl_llm.core.paths import PathLike, as_path
from jaxrl_llm.core.progress import progress_bar
from jaxrl_llm.core.signals import stop_point
from jaxrl_llm.envs.episodes import EpisodeRunner
from jaxrl_llm.envs.sampled import RowTurns, begin_episodes, episode_records, rollout_metrics
from jaxrl_llm.eval.metrics import EvalSamples, evaluation_summary
from jaxrl_llm.generate.completions import encode_prompts, format_prompts
from jaxrl_llm.generate.jax_backend import (
    SEGMENT_S,
    STOP_GRACE_S,
    SamplingProgress,
    progress_batches,
    sample_completions,
)
from jaxrl_llm.sampling.build import build_sampler
from jaxrl_llm.sampling.sampler import SamplingParams
from jaxrl_llm.tasks.base import Problem, reward_error_metrics
from jaxrl_llm.tasks.verify import VerifyTask, parse_verdict

EVAL_FILE = "eval.json"
SAMPLES_FILE = "samples.jsonl"


@dataclass(frozen=True)
class Graded:
    """Every completion of an evaluation, graded: [Q][n] lists."""

    texts: list[list[str]]
    answers: list[list[str | None]]
    correct: list[list[bool]]
    # Per sample: None, or why its reward could not be computed ("timeout", "verifier_error").
    reward_errors: list[list[str | None]] = field(default_factory=list)
    # Multi-turn episodes only: turns, tool calls and truncations per episode
    episodes: dict[str, Any] = field(default_factory=dict)

    def samples(self) -> EvalSamples:
        return EvalSamples.from_answers(self.answers, self.correct)


def sample_and_grade(
    model: Any, tokenizer: Any, task: Any, problems: Sequence[Any], *, n: int,
    temperature: float, max_new_tokens: int, batch_size: int = 8, seed: int = 0,
    chat_template: bool | None = False, progress: bool = True,
    sampler: Mapping[str, Any] | None = None, desc: str | None = None,
    runner: EpisodeRunner | None = None,
) -> Graded:
    """n samples per problem from the JAX sampler, decoded and scored by the task. A bar
    (named `desc`, default "evaluate TASK") counts the questions and shows the decode step
    within a batch (`jaxrl_llm/core/progress.py`);
    `sampler`: `build_sampler`'s batching keywords (`GenerateConfig.sampler_options`);
    Ctrl-C or SIGTERM stops after the current decode segment, before anything is written.
    `runner`: each sample is a multi-turn episode, graded by its environment's reward."""
    eos = getattr(tokenizer, "eos_token_id", None)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, n=n,
                            stop_token_ids=() if eos is None else (int(eos),))
    if runner is not None:
        episodes, prompt_ids = begin_episodes(runner, problems, n)
    else:
        prompts = format_prompts(tokenizer, [task.prompt(p) for p in problems],
                                 chat_template=chat_template)
        prompt_ids = encode_prompts(tokenizer, prompts, chat_template=chat_template)
    sampler = build_sampler(model, tokenizer, prompt_ids, batch_size=batch_size, n=n,
                            max_new_tokens=max_new_tokens, key="eval.batch_size",
                            segment_s=SEGMENT_S, **(sampler or {}))
    desc = desc or f"evaluate {getattr(task, 'name', '')}".strip()
    bar = progress_bar(len(problems), desc=desc,
                       unit="question", enabled=progress and jax.process_index() == 0)
    with stop_point("the current decode segment", grace_s=STOP_GRACE_S) as stop:
        status = SamplingProgress(bar, stop, "evaluate", f"no {EVAL_FILE} was written",
                                  batches=progress_batches(sampler, [len(problems)]),
                                  max_new_tokens=max_new_tokens)
        try:
            completions = sample_completions(
                sampler, prompt_ids, params, jax.random.key(seed), status,
                turns=None if runner is None else RowTurns(runner, episodes))
        finally:
            bar.close()
    if runner is not None:
        return _graded_episodes(episode_records(runner, episodes, n=n,
                                                tokens=[c.token_ids for c in completions]),
                                len(problems), n, tokenizer)
    texts = [tokenizer.decode(c.token_ids.tolist(), skip_special_tokens=True)
             for c in completions]
    results = task.score_many([problems[c.prompt_index] for c in completions], texts)
    q = len(problems)
    graded: Graded = Graded([[] for _ in range(q)], [[] for _ in range(q)],
                            [[] for _ in range(q)], [[] for _ in range(q)])
    for c, text, result in zip(completions, texts, results, strict=True):
        graded.texts[c.prompt_index].append(text)
        graded.answers[c.prompt_index].append(None if result.invalid else result.answer)
        graded.correct[c.prompt_index].append(bool(result.correct))
        graded.reward_errors[c.prompt_index].append(result.info.get("reward_error"))
    return graded


def _graded_episodes(records: Sequence[Any], questions: int, n: int, tokenizer: Any) -> Graded:
    """Episodes' records as graded samples: the environment's reward decides, the text is
    the model's last turn."""
    graded = Graded([[] for _ in range(questions)], [[] for _ in range(questions)],
                    [[] for _ in range(questions)], [[] for _ in range(questions)],
                    episodes=rollout_metrics(records))
    for row, record in enumerate(records):
        q = row // n
        last = [t for t in record.metadata["episode"]["turns"] if t["kind"] == "model"][-1]
        graded.texts[q].append(tokenizer.decode(
            record.completion_ids[last["start"]:last["end"]].tolist(), skip_special_tokens=True))
        graded.answers[q].append(None if record.invalid else record.answer)
        graded.correct[q].append(bool(record.correct))
        graded.reward_errors[q].append(record.metadata.get("reward_error"))
    return graded


def verify_samples(
    verifier: Any, tokenizer: Any, problems: Sequence[Any], graded: Graded, *,
    verifications: int, temperature: float, max_new_tokens: int, batch_size: int = 8,
    seed: int = 0, sampler: Mapping[str, Any] | None = None,
) -> np.ndarray:
    """Verdicts [Q, n, V] of a generative verifier on every graded solution (TOPR arXiv:2503.14286 §4.4).

    Each solution is shown to `verifier` with the `verify` task's prompt; each of its V
    sampled verifications gives 1 ("The verdict is correct"), 0 ("... incorrect") or −1 (no
    parsable verdict, which counts as no vote).
    """
    verify = VerifyTask()
    prompts = [
        verify.prompt(Problem(id=f"{p.id}/{j}", question=p.question, answer="",
                              metadata={"candidate": text}))
        for p, texts in zip(problems, graded.texts, strict=True) for j, text in enumerate(texts)
    ]
    eos = getattr(tokenizer, "eos_token_id", None)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                            n=verifications, stop_token_ids=() if eos is None else (int(eos),))
    prompt_ids = encode_prompts(tokenizer, prompts)
    sampler = build_sampler(verifier, tokenizer, prompt_ids, batch_size=batch_size,
                            n=verifications, max_new_tokens=max_new_tokens, key="eval.batch_size",
                            **(sampler or {}))
    completions = sample_completions(sampler, prompt_ids, params, jax.random.key(seed + 1))
    verdicts = np.full((len(prompts), verifications), -1, np.int8)
    filled = np.zeros(len(prompts), np.int64)
    for c in completions:
        verdict = parse_verdict(tokenizer.decode(c.token_ids.tolist(), skip_special_tokens=True))
        if verdict is not None:
            verdicts[c.prompt_index, filled[c.prompt_index]] = int(verdict)
        filled[c.prompt_index] += 1
    n = len(graded.texts[0]) if graded.texts else 0
    return verdicts.reshape(len(problems), n, verifications)


def evaluate_model(
    model: Any, tokenizer: Any, task: Any, problems: Sequence[Any], *, n: int,
    temperature: float, max_new_tokens: int, batch_size: int = 8, seed: int = 0,
    maj_k: Sequence[int] = (1, 4), trials: int = 100,
    verifier: tuple[Any, Any] | None = None, verifications: int = 4, chat_template: bool | None = False,
    progress: bool = True, sampler: Mapping[str, Any] | None = None, desc: str | None = None,
    runner: EpisodeRunner | None = None,
) -> tuple[dict[str, Any], Graded]:
    """(eval.json dict, graded samples) of `model` on `problems`; with `verifier`
    (= (model, tokenizer)) also weighted self-consistency (TOPR §4.4). `sampler`: the
    sampler's batching keywords (`GenerateConfig.sampler_options`); `progress`, `desc`: the
    questions' bar (`sample_and_grade`)."""
    graded = sample_and_grade(model, tokenizer, task, problems, n=n, temperature=temperature,
                              max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed,
                              chat_template=chat_template, progress=progress, sampler=sampler,
                              desc=desc, runner=runner)
    verdicts = None
    if verifier is not None:
        verdicts = verify_samples(verifier[0], verifier[1], problems, graded,
                                  verifications=verifications, temperature=temperature,
                                  max_new_tokens=max_new_tokens, batch_size=batch_size,
                                  seed=seed, sampler=sampler)
    summary = evaluation_summary(graded.samples(), maj_k=maj_k, trials=trials, seed=seed,
                                 verdicts=verdicts)
    # A reward the verifier could not compute is counted, never folded silently into "wrong".
    summary.update(reward_error_metrics([e for row in graded.reward_errors for e in row]))
    if verdicts is not None:
        summary["verifier_invalid_rate"] = float((verdicts < 0).mean())
    if graded.episodes:  # multi-turn: turns and tool calls per episode
        summary["episodes"] = graded.episodes
    summary.update(task=getattr(task, "name", ""), temperature=temperature,
                   max_new_tokens=max_new_tokens, seed=seed)
    return summary, graded


def write_eval(out_dir: PathLike, summary: dict[str, Any], graded: Graded | None = None,
               problems: Sequence[Any] | None = None) -> epath.Path:
    """`eval.json` (strict JSON) and, with the graded samples, `samples.jsonl`."""
    out = as_path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / EVAL_FILE
    if graded is not None and problems is not None:  # before eval.json, which marks completion
        with atomic_open(out / SAMPLES_FILE) as f:
            for problem, texts, answers, correct in zip(problems, graded.texts, graded.answers,
                                                        graded.correct, strict=True):
                f.write(json.dumps({"id": problem.id, "question": problem.question,
                                    "gold": problem.answer, "answers": answers,
                                    "correct": correct, "completions": texts}) + "\n")
    atomic_write_text(path, json.dumps(summary, indent=2, allow_nan=False) + "\n")
    return path


def format_table(rows: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """A plain-text before/after table of pass@1 ± SE, pass@k, maj@K and invalid rate."""
    header = ["", "pass@1 ± SE", "pass@n", "maj@K", "invalid"]
    lines = []
    for label, s in rows:
        curve = s.get("pass_at_k") or {}
        top = max((int(k) for k in curve), default=None)
        maj = s.get("maj_at_k") or {}
        kmax = max((int(k) for k in maj), default=None)
        lines.append([
            label,
            f"{s['pass_at_1']['mean']:.3f} ± {s['pass_at_1']['se']:.3f}",
            "–" if top is None else f"{curve[str(top)]:.3f} (n={top})",
            "–" if kmax is None else f"{maj[str(kmax)]['mean']:.3f} (K={kmax})",
            f"{s['proportions']['invalid']:.3f}",
        ])
    widths = [max(len(str(r[i])) for r in [header, *lines]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*r) for r in [header, *lines])

