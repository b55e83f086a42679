"""The free-running pipeline (`online.pipeline: free`, docs/online.md § Pipeline): what the
asynchronous RL systems do. The sampler (its own devices, its own thread) always samples with
the newest weights the trainer has published; the trainer publishes after every update and
trains on the oldest waiting batch whose version lag (updates since the weights that sampled
it) is at most `online.max_staleness`, dropping older ones (counted). Which batch meets which
weights depends on timing, so a run is not reproducible; its accounting is: every sample
handed over is trained, dropped or still waiting, and every trained lag is within the bound.

Rows are per trainer round (`updates_per_round` updates): the reward metrics of the trained
samples, the step metrics, the lag statistics and histogram, the per-side seconds, and the
counters `pipeline/received_total`, `pipeline/trained_total`, `pipeline/dropped_total`,
`pipeline/dropped`, `pipeline/waiting`. A checkpoint keeps the waiting batches with their
versions, and a resumed run goes on from there.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from jaxrl_llm.core.progress import progress_bar
from jaxrl_llm.data.records import Record
from jaxrl_llm.online.config import OnlineConfig
from jaxrl_llm.online.driver import drive
from jaxrl_llm.online.lag import lag_metrics, side_seconds, token_lag_metrics
from jaxrl_llm.online.pipeline import open_run
from jaxrl_llm.online.rounds import mean_metrics, reward_metrics
from jaxrl_llm.online.sampler_side import Feed

NO_END = 2**62  # the sampler's last round: it samples until the trainer stops it


def run_free(config: OnlineConfig, *, progress: bool = True, eval_hook: Any = None,
             eval_every: int = 0, eval_at_start: bool = False) -> Any:
    """The free-running loop (module docstring) of `config`; `run_state.OnlineResult`."""
    if config.online.pipeline != "free":
        raise ValueError(f"online.pipeline={config.online.pipeline}: run_free runs "
                         "online.pipeline: free (pipeline.run_pipeline runs the others)")
    opened = open_run(config)
    side = opened.side
    assert side is not None
    side.free = True
    counts = free_counts(opened.meta)
    side.bar = progress_bar(None, desc="sampler", unit="round", enabled=progress,
                            initial=counts["sampled_rounds"])
    # at most enough rounds ahead to cover the bound: the sampler waits beyond that
    return free_rounds(opened, lambda: Feed(side, counts["sampled_rounds"], NO_END,
                                            opened.run.position, overlap=True,
                                            ahead=rounds_ahead(config)), progress=progress,
                       eval_hook=eval_hook, eval_every=eval_every, eval_at_start=eval_at_start)


def rounds_ahead(config: OnlineConfig) -> int:
    """How many sampled rounds may wait for the trainer: enough to cover the lag bound."""
    o = config.online
    return max(1, -(-(o.max_staleness + 1) // o.updates_per_round))


def free_counts(meta: dict[str, Any]) -> dict[str, int]:
    """The accounting a checkpoint's meta carries (zeros on a fresh run)."""
    return {k: int(meta.get(k, 0)) for k in ("received_total", "trained_total",
                                              "dropped_total", "sampled_rounds")}


def free_rounds(opened: Any, make_feed: Any, *, progress: bool, eval_hook: Any = None,
                eval_every: int = 0, eval_at_start: bool = False) -> Any:
    """The rounds driver (`driver.drive`) with free-running rounds (`Freshest`). The
    evaluations run on the trainer's clock, as in the other modes (the sampler keeps
    sampling meanwhile, bounded by `online.max_staleness`)."""
    return drive(opened, make_feed, Freshest(opened), progress=progress, eval_hook=eval_hook,
                 eval_every=eval_every, eval_at_start=eval_at_start)


class Freshest:
    """How free-running rounds take their batches (`driver.Rounds`, module docstring): each
    of a round's `updates_per_round` updates trains on the next batch at most
    `online.max_staleness` versions old (older ones, and those of weights lost with a killed
    trainer, are dropped and counted), publishing after every update."""

    def __init__(self, opened: Any) -> None:
        self.opened, o = opened, opened.config.online
        self.last_round = o.rounds
        versions = opened.meta.get("versions", [])
        self.pending: deque[tuple[int | None, list[Record]]] = deque(
            zip(versions, opened.run.queue.batches(), strict=True))
        self.counts = free_counts(opened.meta)
        self.syncs: list[float] = []

    def progress(self, enabled: bool) -> Any:
        o = self.opened.config.online
        return progress_bar(o.rounds * o.updates_per_round, desc="trainer", unit="update",
                            enabled=enabled, initial=self.opened.run.updates)

    def start(self) -> None:
        self.syncs = [self.opened.publish()]

    def play(self, feed: Any, bar: Any) -> dict[str, float]:
        config, run, policy = self.opened.config, self.opened.run, self.opened.policy
        o, g, counts, pending = config.online, config.generate, self.counts, self.pending
        waited = feed.waited
        steps, lags, trained, dropped, busy = [], [], [], 0, 0.0
        sampler = {"sampler_busy": 0.0, "sampler_wait": 0.0}
        inflight = {"inflight_swaps": 0.0, "inflight_swap_s": 0.0}
        by_update: list[tuple[int, list[Record]]] = []
        for _ in range(o.updates_per_round):
            while True:
                while not pending:
                    done = feed.get()
                    pending.extend((done.version, b) for b in done.batches)
                    counts["received_total"] += sum(map(len, done.batches))
                    counts["sampled_rounds"] = done.round + 1
                    run.position, run.mu_source = done.position, done.mu_source
                    for key in sampler:
                        sampler[key] += done.seconds[key]
                    for key in inflight:
                        inflight[key] += done.seconds.get(key, 0.0)
                version, records = pending.popleft()
                if version is not None and run.updates - version <= o.max_staleness:
                    break
                dropped += len(records)  # too old for the bound, or lost: never trained
            t0 = time.perf_counter()
            steps.append(policy.step(records))
            busy += time.perf_counter() - t0
            lags.append(run.updates - version)
            trained.extend(records)
            by_update.append((run.updates, records))
            run.updates += 1
            bar.update(1)
            self.syncs.append(self.opened.publish())
        run.round += 1
        counts["trained_total"] += len(trained)
        counts["dropped_total"] += dropped
        metrics = reward_metrics(trained, g.n, o.pass_k)
        metrics.update(mean_metrics(steps))
        metrics.update(updates=run.updates, round_updates=len(steps),
                       queued=len(pending), mu_from_sampler=float(run.mu_source == "sampler"),
                       seconds_training=busy, **lag_metrics(lags, config.train.batch_size),
                       **side_seconds(trainer_busy=busy, trainer_wait=feed.waited - waited,
                                      syncs=self.syncs, **sampler),
                       **{f"pipeline/{k}": float(v) for k, v in counts.items()},
                       **token_lag_metrics(by_update),
                       **({f"pipeline/{k}": v for k, v in inflight.items()}
                          if o.inflight_weights else {}),
                       **{"pipeline/dropped": float(dropped),
                          "pipeline/waiting": float(sum(len(b) for _, b in pending))})
        self.syncs = []
        return metrics

    def shown(self, bar: Any, metrics: dict[str, float]) -> None:
        bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}",
                        dropped=self.counts["dropped_total"], refresh=False)  # no redraw

    def save(self) -> None:
        self.opened.save([b for _, b in self.pending], mode="free",
                         versions=[v for v, _ in self.pending], **self.counts)
