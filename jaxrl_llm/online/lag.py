"""The staleness schedule as version numbers (of an online config too), and the pipeline's per-round lag and time
columns (docs/online.md § Pipeline). Pure functions."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

LAG = "pipeline/lag"  # column prefix of the lag statistics and histogram


def weights_version(round_index: int, *, updates_per_round: int, staleness: int,
                    total_updates: int) -> int:
    """The updates applied before round `round_index` (0-based) of the serial loop, i.e. the
    weights θ_v that sample it: round r pushes `updates_per_round` batches, and the queue
    releases every batch beyond `staleness` (until `total_updates`)."""
    return min(total_updates, max(0, round_index * updates_per_round - staleness))


def lag_metrics(lags: Sequence[int], batch_size: int) -> dict[str, float]:
    """The version lag (update index − version of the weights that sampled its batch) of
    each trained sample of a round: min / mean / max, and `pipeline/lag_hist_L` = how many of
    the round's samples were L versions old. Empty: no columns (a queue-filling round)."""
    if not lags:
        return {}
    out = {f"{LAG}_min": float(min(lags)), f"{LAG}_mean": float(sum(lags) / len(lags)),
           f"{LAG}_max": float(max(lags))}
    for lag, updates in sorted(Counter(lags).items()):
        out[f"{LAG}_hist_{lag}"] = float(updates * batch_size)
    return out


def token_lag_metrics(trained: Sequence[tuple[int, Sequence[Any]]]) -> dict[str, float]:
    """In-flight weight updates (`online.inflight_weights`): the lag of every trained token
    (update index − version of the weights that sampled it, from each record's metadata
    `weight_versions` runs) over (update, records) pairs: min / mean / max, and how many
    records span more than one version. No such records: no columns."""
    lag_by_tokens: Counter[int] = Counter()  # lag → trained tokens at that lag
    spanning = 0
    for update, records in trained:
        for record in records:
            runs = record.metadata.get("weight_versions")
            if not runs:
                continue
            spanning += len(runs) > 1
            ends = [start for _, start in runs[1:]] + [len(record.completion_ids)]
            for (version, start), end in zip(runs, ends):
                lag_by_tokens[update - version] += end - start
    tokens = sum(lag_by_tokens.values())
    if not tokens:
        return {}
    return {"pipeline/token_lag_min": float(min(lag_by_tokens)),
            "pipeline/token_lag_mean": sum(k * c for k, c in lag_by_tokens.items()) / tokens,
            "pipeline/token_lag_max": float(max(lag_by_tokens)),
            "pipeline/inflight_records": float(spanning)}


def side_seconds(*, sampler_busy: float, sampler_wait: float, trainer_busy: float,
                 trainer_wait: float, syncs: Sequence[float]) -> dict[str, float]:
    """The round's time columns of each side: busy (sampling + μ + transform / the train
    steps), waiting (for weights / for a batch) and the trainer's pause per weight sync."""
    out = {"pipeline/sampler_busy_s": sampler_busy, "pipeline/sampler_wait_s": sampler_wait,
           "pipeline/trainer_busy_s": trainer_busy, "pipeline/trainer_wait_s": trainer_wait,
           "pipeline/trainer_sync_s": float(sum(syncs)), "pipeline/syncs": float(len(syncs))}
    if syncs:
        out["pipeline/sync_pause_max_s"] = float(max(syncs))
    return out


def version_of(config: Any, round_index: int) -> int:
    """`weights_version` of an online config's round `round_index`."""
    o = config.online
    return weights_version(round_index, updates_per_round=o.updates_per_round,
                           staleness=o.staleness, total_updates=o.rounds * o.updates_per_round)


def total_rounds(config: Any) -> int:
    """The serial loop's rounds: the training ones plus those that fill the queue."""
    o = config.online
    return o.rounds + math.ceil(o.staleness / o.updates_per_round)
