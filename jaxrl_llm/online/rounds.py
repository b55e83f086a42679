"""Pure pieces of an online round: which prompts, which k, how records become batches, the
round's reward metrics and the sampler-vs-trainer μ comparison (docs/online.md)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxrl_llm.core.signals import Interrupted
from jaxrl_llm.data.records import Record
from jaxrl_llm.losses.pkpo import pass_at_k


def prompt_slice(position: int, count: int, pool: int) -> list[int]:
    """Indices of the `count` prompts from `position` in a pool of `pool`, wrapping around."""
    if pool < 1:
        raise ValueError("the prompt pool is empty (data.num_prompts / the task's split)")
    return [(position + i) % pool for i in range(count)]


def k_for_round(schedule: Sequence[int] | None, default: int | None, index: int) -> int | None:
    """PKPO's k of round `index` (0-based): the schedule's entry, its last value after it
    ends, or `default` without a schedule."""
    if not schedule:
        return default
    return int(schedule[min(index, len(schedule) - 1)])


def sampling_seed(seed: int, index: int) -> int:
    """The sampler seed of round `index` (a resumed run re-derives it)."""
    return seed * 1_000_003 + index


def split_batches(records: Sequence[Record], count: int) -> list[list[Record]]:
    """`records` (prompt-major) as `count` consecutive equal batches."""
    if len(records) % count:
        raise ValueError(f"{len(records)} records do not split into {count} equal batches")
    size = len(records) // count
    return [list(records[i * size:(i + 1) * size]) for i in range(count)]


def reward_metrics(records: Sequence[Record], n: int, ks: Sequence[int]) -> dict[str, float]:
    """Mean reward (before any group transform), correct rate, and pass@k (unbiased, PKPO
    eq. 3) averaged over the round's groups of `n` completions, for each k ≤ n."""
    raw = np.asarray([r.raw_reward if r.raw_reward is not None else r.reward for r in records])
    groups: dict[int, list[bool]] = {}
    for r in records:
        groups.setdefault(r.group_id, []).append(r.correct)
    sizes = np.asarray([len(v) for v in groups.values()])
    correct = np.asarray([sum(v) for v in groups.values()])
    out = {"reward_mean": float(raw.mean()), "correct_rate": float(np.mean([r.correct for r in records])),
           "invalid_rate": float(np.mean([r.invalid for r in records]))}
    for k in sorted(set(ks) | {n}):
        if k <= n:
            out[f"pass@{k}"] = float(np.mean(pass_at_k(sizes, correct, k)))
    return out


def logprob_mismatch(sampler: Sequence[np.ndarray], trainer: Sequence[np.ndarray],
                     masks: Sequence[np.ndarray] | None = None) -> dict[str, float]:
    """Per-token |sampler − trainer| log-prob differences over the completions' model tokens
    (`masks`: bool per token, an episode's action mask; None: every token): max and mean
    (the `mu_mismatch_*` metrics)."""
    masks = masks if masks is not None else [np.ones(len(a), bool) for a in sampler]
    diffs = [np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))[np.asarray(m, bool)]
             for a, b, m in zip(sampler, trainer, masks, strict=True)]
    diffs = [d for d in diffs if d.size]
    if not diffs:
        return {"mu_mismatch_max": 0.0, "mu_mismatch_mean": 0.0}
    flat = np.concatenate(diffs)
    return {"mu_mismatch_max": float(flat.max()), "mu_mismatch_mean": float(flat.mean())}


def mean_metrics(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    """Per-key mean over the round's updates (keys present in every row)."""
    if not rows:
        return {}
    keys = set(rows[0]).intersection(*rows[1:])
    return {k: float(np.mean([row[k] for row in rows])) for k in sorted(keys)}


def probe(hook: Callable[[int, Any], Any] | None, every: int, policy: Any, before: int,
          after: int, total: int) -> dict[str, float]:
    """The round's `eval/KEY` numbers: `hook(after, policy)` when the round's updates (from
    `before` to `after`) reached a new multiple of `every`, or the last of `total`; none
    otherwise, or when a Ctrl-C stopped the hook (the signal stays noted: the loop stops after
    this round, checkpointed)."""
    if hook is None or after == before:
        return {}
    if after // every == before // every and after != total:
        return {}
    try:
        return {f"eval/{k}": float(v) for k, v in (hook(after, policy) or {}).items()}
    except Interrupted:
        return {}


def probe_start(hook: Callable[[int, Any], Any] | None, at_start: bool, policy: Any,
                round_index: int, total: int) -> dict[str, float]:
    """The step-0 row's `eval/KEY` numbers (the initial weights, before round 1 of a fresh
    run: `round_index` 0), in every mode; none otherwise or when a Ctrl-C stopped the hook."""
    if not at_start or round_index != 0:
        return {}
    return probe(hook, 1, policy, -1, 0, total)  # update 0 counts as reached from −1
