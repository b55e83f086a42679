"""Statistics of a record directory: composition, lengths, rewards, correct answers per group
(what `jaxrl-llm data stats` prints)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from jaxrl_llm.data.shards import RecordSource


def dataset_stats(directory: str) -> dict[str, Any]:
    """Composition, lengths, rewards, per-group correct counts (TOPR arXiv:2503.14286 Fig. 3/4 quantities)."""
    source = RecordSource(directory)
    rewards, correct, invalid, groups, has_mu = [], [], [], [], []
    for r in source:
        rewards.append(r.reward)
        correct.append(r.correct)
        invalid.append(r.invalid)
        groups.append(r.group_id)
        has_mu.append(r.mu_logprobs is not None)
    lengths = source.lengths()
    n = len(rewards)
    _, group_correct = np.unique(np.asarray(groups), return_inverse=True) if n else (None, np.zeros(0, int))
    per_group = np.bincount(group_correct, weights=np.asarray(correct, float)).astype(int) if n else np.zeros(0, int)
    hist = {int(k): int(v) for k, v in zip(*np.unique(per_group, return_counts=True))}

    def summary(x: np.ndarray) -> dict[str, float]:
        return {"mean": float(x.mean()), "min": float(x.min()), "max": float(x.max())} if x.size else {}

    return {
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
