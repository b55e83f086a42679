"""Episodes through a sampler: the JAX continuous sampler's turn hook over an `EpisodeRunner`
(output row → episode), and the episodes' records once the sampler is done.

Rows are prompt-major (row i·n + j = sample j of problem i), as every sampler's output; each
row is its own episode with its own environment state. Every backend hands the runner the
model's tokens exactly as sampled, and feeds back the runner's observation ids: the records'
tokens are the sampler's, never re-tokenised (`episode_records` checks this).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from jaxrl_llm.data.records import Record
from jaxrl_llm.envs.episodes import Episode, EpisodeRunner
from jaxrl_llm.envs.registry import env_from_config, runner_from_config
from jaxrl_llm.tasks.base import Problem


class EpisodeError(RuntimeError):
    """A sampler's output that disagrees with its episodes (a backend defect)."""


def begin_episodes(runner: EpisodeRunner, problems: Sequence[Problem], n: int
                   ) -> tuple[list[Episode], list[list[int]]]:
    """n episodes per problem (prompt-major) and each problem's prompt ids."""
    episodes = [runner.begin(p) for p in problems for _ in range(n)]
    prompts = [list(episodes[i * n].prompt_ids) for i in range(len(problems))]
    for row, ep in enumerate(episodes):  # an environment's prompt must not depend on its state
        if list(ep.prompt_ids) != prompts[row // n]:
            raise EpisodeError(f"{runner.where}: problem {problems[row // n].id!r} gave "
                               "different prompts to its episodes")
    return episodes, prompts


class RowTurns:
    """`sampling.turns.TurnHook` for the continuous sampler: output row → its episode."""

    def __init__(self, runner: EpisodeRunner, episodes: Sequence[Episode]):
        self.runner, self.episodes = runner, list(episodes)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return tuple(self.runner.stop_ids)

    def submit(self, row: int, tokens: np.ndarray, logprobs: np.ndarray, stopped: bool
               ) -> Future:
        return self.runner.submit(self.episodes[row], tokens.tolist(), logprobs.tolist(),
                                  stopped)


def episode_records(runner: EpisodeRunner, episodes: Sequence[Episode], *, n: int,
                    group_offset: int = 0, tokens: Sequence[np.ndarray] | None = None,
                    action_mask: Sequence[np.ndarray] | None = None) -> list[Record]:
    """One record per finished episode (group = group_offset + problem index). `tokens` /
    `action_mask`: the sampler's own rows, which must equal the episodes' (a check that no
    backend dropped, re-tokenised or misplaced a token)."""
    records = []
    for row, ep in enumerate(episodes):
        if tokens is not None:
            got = np.asarray(tokens[row]).tolist()
            if got != ep.completion_ids:
                raise EpisodeError(f"row {row} ({ep.problem.id!r}): the sampler's {len(got)} "
                                   f"tokens differ from the episode's {len(ep.completion_ids)}")
        if action_mask is not None and np.asarray(action_mask[row]).tolist() != ep.action_mask:
            raise EpisodeError(f"row {row} ({ep.problem.id!r}): the sampler's action mask "
                               "differs from the episode's")
        records.append(runner.finish(ep, group_id=group_offset + row // n))
    return records


def rollout_metrics(records: Sequence[Record]) -> dict[str, Any]:
    """Turns, tool calls and truncations per episode, over `records`' episode metadata."""
    meta = [r.metadata.get("episode") for r in records]
    meta = [m for m in meta if m]
    if not meta:
        return {}
    truncated: dict[str, int] = {}
    for m in meta:
        if m.get("truncated"):
            truncated[m["truncated"]] = truncated.get(m["truncated"], 0) + 1
    return {"episodes": len(meta),
            "turns_per_episode": float(np.mean([m["num_turns"] for m in meta])),
            "tool_calls_per_episode": float(np.mean([m["tool_calls"] for m in meta])),
            "tool_errors_per_episode": float(np.mean([m.get("tool_errors", 0) for m in meta])),
            "truncated": truncated}


def runner_for(config: Any, task: Any, tokenizer: Any, *, max_new_tokens: int | None = None
               ) -> EpisodeRunner | None:
    """The config's episode runner (`env:`) for `task`, or None for single-turn completions;
    `max_new_tokens`: the episode's token budget (default generate.max_new_tokens)."""
    env = env_from_config(config, task)
    if env is None:
        return None
    return runner_from_config(config, env, tokenizer, max_episode_tokens=max_new_tokens)


def sample_episodes(runner: EpisodeRunner, problems: Sequence[Problem], n: int,
                    sample: Any, *, group_offset: int = 0) -> tuple[list[Record], Any]:
    """n episodes per problem through `sample(prompt_ids, turns)` (a sampler call with a
    `RowTurns` hook returning `api.Samples`): their records (the sampler's untruncated
    log-probs as `raw_logprobs`, as single-turn records) and the samples."""
    episodes, ids = begin_episodes(runner, problems, n)
    s = sample(ids, RowTurns(runner, episodes))
    records = episode_records(runner, episodes, n=n, group_offset=group_offset,
                              tokens=s.token_ids, action_mask=s.action_mask)
    return [r.replace(raw_logprobs=np.asarray(raw, np.float32))
            for r, raw in zip(records, s.raw_logprobs, strict=True)], s
