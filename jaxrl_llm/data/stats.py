"""Statistics of a record directory: composition, lengths, rewards, correct answers per group,
and for multi-turn episodes their turns, tool calls, model and environment tokens and
truncations (what `jaxrl-llm data stats` prints)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from jaxrl_llm.data.shards import RecordSource
from jaxrl_llm.data.show import episode_counts, is_episode


def summary(x: np.ndarray) -> dict[str, float]:
    """Mean, min and max of `x` ({} when empty)."""
    return {"mean": float(x.mean()), "min": float(x.min()), "max": float(x.max())} if x.size else {}


def dataset_stats(directory: str) -> dict[str, Any]:
    """Composition, lengths, rewards, per-group correct counts (TOPR arXiv:2503.14286 Fig. 3/4 quantities)."""
    source = RecordSource(directory)
    rewards, correct, invalid, groups, has_mu, episodes = [], [], [], [], [], []
    for r in source:
        rewards.append(r.reward)
        correct.append(r.correct)
        invalid.append(r.invalid)
        groups.append(r.group_id)
        has_mu.append(r.mu_logprobs is not None)
        if is_episode(r):
            episodes.append(episode_counts(r))
    lengths = source.lengths()
    n = len(rewards)
    _, group_correct = np.unique(np.asarray(groups), return_inverse=True) if n else (None, np.zeros(0, int))
    per_group = np.bincount(group_correct, weights=np.asarray(correct, float)).astype(int) if n else np.zeros(0, int)
    hist = {int(k): int(v) for k, v in zip(*np.unique(per_group, return_counts=True))}

    out = {
        "manifest": json.loads(source.manifest.to_json()),
        "num_records": n,
        "num_groups": int(len(per_group)),
        "correct_fraction": float(np.mean(correct)) if n else 0.0,
        "invalid_fraction": float(np.mean(invalid)) if n else 0.0,
        "scored_fraction": float(np.mean(has_mu)) if n else 0.0,
        "reward": summary(np.asarray(rewards, float)),
        "prompt_length": summary(lengths[:, 0].astype(float)),
        "completion_length": summary(lengths[:, 1].astype(float)),
        "correct_per_group_histogram": hist,
    }
    if episodes:
        out["episodes"] = episode_summary(episodes)
    return out


def episode_summary(episodes: list[dict[str, Any]]) -> dict[str, Any]:
    """Per episode (`data.show.episode_counts`): model turns, tool calls, model and environment
    tokens (mean/min/max), and how many were truncated, by reason."""
    truncated: dict[str, int] = {}
    for e in episodes:
        if e["truncated"]:
            reason = str(e["truncated"])
            truncated[reason] = truncated.get(reason, 0) + 1
    return {
        "num_episodes": len(episodes),
        **{f"{key}_per_episode": summary(np.asarray([e[key] for e in episodes], float))
           for key in ("turns", "tool_calls", "model_tokens", "environment_tokens")},
        "truncated": dict(sorted(truncated.items())),
    }
