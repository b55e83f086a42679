"""The online loop with the sampler and the trainer on their own devices (docs/online.md §
Pipeline): `online.sampler_devices` split, `online.pipeline: deterministic` overlapped.

The serial loop's round r samples with θ_{U(r)} (`lag.weights_version`) and update u trains on
batch u (FIFO). Here the same computation is a dataflow between two sides:

- the sampler (a thread, on the first `online.sampler_devices` devices) samples round r as
  soon as the trainer has published θ_{U(r)}, then rewards it, sets μ and applies the group
  transform, exactly as the serial round does;
- the trainer (this thread, on the rest) trains update u as soon as batch u has arrived, and
  publishes θ_v to the sampler's devices (an in-memory resharding copy) right after the update
  that made it, whenever some round samples with θ_v.

At staleness s ≥ 1 round r's sampling needs no update of the trainer's round r, so the two
overlap; every update sees the same θ_u and batch u as the serial loop, and the metric rows,
checkpoints (round, queue, prompt position, μ decision: the serial loop's format) and the
final state are the serial loop's on the same placements. With `pipeline: off` the sampler's
rounds run in this thread, in turn with the updates (the reference the tests compare with).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

from jaxrl_llm.api import Policy, load_policy
from jaxrl_llm.core.errors import ConfigError
from jaxrl_llm.core.paths import as_path
from jaxrl_llm.core.progress import progress_bar
from jaxrl_llm.data.records import Record
from jaxrl_llm.online import run_state
from jaxrl_llm.online.config import OnlineConfig
from jaxrl_llm.online.driver import drive
from jaxrl_llm.online.lag import lag_metrics, side_seconds, total_rounds, version_of
from jaxrl_llm.online.placement import Placement, make_placement
from jaxrl_llm.online.queue import StalenessQueue
from jaxrl_llm.online.rounds import (
    mean_metrics,
)
from jaxrl_llm.online.sampler_shape import IN_FLIGHT_VERSIONS
from jaxrl_llm.online.sampler_side import (
    Feed,
    LiveWeights,
    Sampled,
    SamplerSide,
    Weights,
    sampler_mu,
)
from jaxrl_llm.sampling.layout import sampling_dtype
from jaxrl_llm.train.checkpoint import CHECKPOINT_DIR, Checkpointer
from jaxrl_llm.train.metrics_log import MetricsLogger
from jaxrl_llm.train.preemption import StopSync
from jaxrl_llm.train.state_items import state_items


def wants_pipeline(config: OnlineConfig) -> bool:
    """Whether `config` runs here rather than in the serial loop (`loop.run_online`)."""
    return config.online.pipeline != "off" or config.online.sampler_devices > 0


@dataclass
class Opened:
    """What both pipeline modes set up: the trainer's policy on its devices, the run's position
    (restored from the newest checkpoint, the serial loop's format) and the sampler side."""

    config: OnlineConfig
    experiment: Any
    placement: Placement
    policy: Policy
    run: Any  # run_state.RunState
    meta: dict[str, Any]  # the restored checkpoint's online meta ({} on a fresh run)
    checkpointer: Checkpointer
    side: SamplerSide | None
    weights: Weights | None
    _decode: tuple[Any, Any] | None = None  # the sampler's (decode layout, dtype), once
    stop: Any = None  # the trainer loop's StopSync (`watch_signals`)
    stopped: bool = False

    def publish(self) -> float:
        """θ_updates onto the sampler's devices, in its decode layout and sampling dtype (the
        copy it decodes with); the trainer's pause in seconds. The serial loop's sampler
        shares the trainer's state (`LiveWeights`): nothing to copy."""
        t0 = time.perf_counter()
        if self.weights.live:
            return 0.0
        state = self.policy.state
        if self._decode is None:
            model = self.policy.model
            g = self.config.generate
            self._decode = (self.placement.sampler_layout(
                model.config.num_kv_heads, data=g.decode_data, tensor=g.decode_tensor),
                sampling_dtype(model))
        self.weights.put(self.run.updates, self.placement.publish(
            state.params, state.model_state, *self._decode))
        return time.perf_counter() - t0

    def logger(self) -> MetricsLogger:
        c = self.config
        return MetricsLogger(c.run_dir, resume_step=self.run.round, wandb=c.metrics,
                             enabled=jax.process_index() == 0,  # a multi-host trainer
                             run_name=c.name, run_config=c.model_dump(mode="json"))

    def round_done(self, saved: bool) -> None:
        """After each round's row (and its checkpoint when `saved`): nothing here; the
        storage trainer (online/remote.py) records its progress and collects garbage."""

    def watch_signals(self) -> None:
        """From here on, Ctrl-C and SIGTERM stop the trainer after its current round,
        checkpointed, on every process at the same round (the serial loop's `StopSync`; an
        evaluation they interrupt ends early and the round still stops)."""
        self.stop = StopSync(what="the current round and its checkpoint")
        self.stop.install()

    def should_stop(self, last_round: int) -> bool:
        """After a round's row: whether a signal stops the run here (every process agrees)."""
        self.stopped = self.stop.should_stop(self.run.round) and self.run.round < last_round
        return self.stopped

    def close(self, feed: Feed | None, bar: Any, logger: MetricsLogger) -> None:
        """Stop the sampler side, close the bars, the metrics and the checkpointer."""
        try:
            if feed is not None:
                feed.close()
        finally:
            if self.stop is not None:
                self.stop.uninstall()
            for closing in (getattr(self.side, "bar", None), bar, logger, self.checkpointer):
                if closing is not None:
                    closing.close()

    def result(self, last: dict[str, Any]) -> Any:
        jax.block_until_ready(self.policy.state.params)
        latest = self.checkpointer.latest_step()
        return run_state.OnlineResult(
            rounds=self.run.round, updates=self.run.updates, last=last, policy=self.policy,
            stopped=self.stopped, stop_signal=self.stop.signum if self.stopped else None,
            checkpoint=None if latest is None else str(self.checkpointer.directory / str(latest)))

    def save(self, pending: list[list[Record]], **extra: Any) -> None:
        self.run.queue = StalenessQueue(self.run.queue.staleness, pending)
        self.checkpointer.save(self.run.round, state_items(self.policy.state), force=True, meta={
            "config": self.experiment.model_dump(mode="json"),
            run_state.ONLINE_META: {**self.run.meta(), **extra}}, blobs=self.run.blobs())


def open_run(config: OnlineConfig, *, sampler: bool = True, opened: type[Opened] = Opened,
             mesh: Any = None) -> Opened:
    """Checks (before any model is loaded), placement, policy, restore, and the sampler side
    (`sampler`; none for the storage trainer, whose samplers are other processes). `mesh`:
    the serial loop's (the trainer's and its sampler's; default: `mesh:` over every device)."""
    if sampler and config.online.exchange:
        raise ConfigError(f"online.exchange={config.online.exchange}: the sampler runs in "
                          "worker processes; run each side with `jaxrl-llm online --role "
                          "trainer` / `--role worker --worker K` (online.remote)")
    run_state.check_config(config)
    placement = make_placement(config) if mesh is None else Placement(mesh, mesh)
    o = config.online
    experiment = run_state.experiment_of(config)
    policy = load_policy(config=experiment, mesh=placement.trainer)
    run = run_state.RunState(o.staleness)
    checkpointer = Checkpointer(as_path(config.run_dir) / CHECKPOINT_DIR, save_every=o.checkpoint_every,
                                keep=config.train.keep_checkpoints, async_save=False,
                                params_dtype=config.train.checkpoint_dtype)
    meta: dict[str, Any] = {}
    if checkpointer.latest_step() is not None:
        run_state.restore_run(policy, checkpointer, run)
        meta = checkpointer.read_meta(checkpointer.latest_step())[run_state.ONLINE_META]
        free = meta.get("mode") == "free"
        if free != (o.pipeline == "free"):  # rows, rounds and the queue mean other things
            raise ConfigError(
                f"{checkpointer.directory} was written by online.pipeline="
                f"{'free' if free else 'off/deterministic'} and cannot resume as "
                f"online.pipeline={o.pipeline}: set it back, or start a new run_dir")

    if not sampler:
        return opened(config, experiment, placement, policy, run, meta, checkpointer, None, None)
    weights: Any = (Weights(newest_only=config.online.pipeline == "free")
                    if wants_pipeline(config) else LiveWeights(policy))
    problems = problems_of(config, policy)
    side = SamplerSide(config, policy, placement, problems, weights,
                       mu_source=run.mu_source, mu=sampler_mu(config))
    # on its own devices the sampler also holds the versions in flight beside its own
    run.fix_sampler_batch(config, side.policy, problems,
                          in_flight=IN_FLIGHT_VERSIONS if placement.split else 0)
    return opened(config, experiment, placement, policy, run, meta, checkpointer, side, weights)


def problems_of(config: OnlineConfig, policy: Policy) -> list[Any]:
    """The prompt pool the rounds draw from (the serial loop's)."""
    g, d = config.generate, config.data
    return policy.task.load(split=g.split, num=d.num_prompts, seed=config.seed)


def run_serial(config: OnlineConfig, *, progress: bool = True, mesh: Any = None,
               eval_hook: Any = None, eval_every: int = 0, eval_at_start: bool = False) -> Any:
    """`loop.run_online`: the rounds driver (`train_rounds`) with the sampler on the trainer's
    own policy and devices, each round sampled before its updates."""
    opened = open_run(config, mesh=mesh)
    run, side = opened.run, opened.side
    assert side is not None
    return train_rounds(opened, lambda: Feed(side, run.round, total_rounds(config), run.position,
                                             overlap=False),
                        progress=progress, eval_hook=eval_hook, eval_every=eval_every,
                        eval_at_start=eval_at_start)


def run_pipeline(config: OnlineConfig, *, progress: bool = True, eval_hook: Any = None,
                 eval_every: int = 0, eval_at_start: bool = False) -> Any:
    """`loop.run_online` with the sampler on `online.sampler_devices` devices (module
    docstring): the same result type, rows (plus `pipeline/*` columns) and checkpoints."""
    if eval_hook is not None and eval_every <= 0:
        raise ValueError(f"eval_every={eval_every}: an eval_hook needs eval_every > 0")
    if config.online.pipeline == "free":
        raise ValueError("online.pipeline=free runs in online.free.run_free")
    opened = open_run(config)
    run, side = opened.run, opened.side
    assert side is not None
    side.bar = progress_bar(total_rounds(config), desc="sampler", unit="round",
                            enabled=progress, initial=run.round)
    return train_rounds(opened, lambda: Feed(side, run.round, total_rounds(config), run.position,
                                             overlap=config.online.pipeline != "off"),
                        progress=progress, eval_hook=eval_hook, eval_every=eval_every,
                        eval_at_start=eval_at_start)


def train_rounds(opened: Opened, make_feed: Callable[[], Any], *, progress: bool,
                 eval_hook: Any = None, eval_every: int = 0, eval_at_start: bool = False
                 ) -> Any:
    """The rounds driver (`driver.drive`) with in-order rounds (`InOrder`): the serial loop,
    `pipeline: deterministic` / `off`, and the storage trainer."""
    return drive(opened, make_feed, InOrder(opened), progress=progress, eval_hook=eval_hook,
                 eval_every=eval_every, eval_at_start=eval_at_start)


class InOrder:
    """How deterministic rounds take their batches (`driver.Rounds`): update u trains on
    batch u from the feed's rounds in order, and θ_v is published (`Opened.publish`) right
    after the update that made it when a round samples with it. The serial loop (its sampler
    shares the trainer's state, `LiveWeights`) samples each round before its updates and
    writes no `pipeline/*` columns; the pipelines (the sampler thread, or storage) take a
    round's samples after its updates, so the two sides overlap."""

    def __init__(self, opened: Opened) -> None:
        self.opened, config = opened, opened.config
        self.serial = opened.weights is not None and opened.weights.live
        self.last_round = total_rounds(config)
        run = opened.run
        self.pending: deque[list[Record]] = deque(run.queue.batches())
        self.needed = {version_of(config, r) for r in range(run.round, self.last_round)}
        self.syncs: list[float] = []
        self.sampled: dict[int, Sampled] = {}

    def progress(self, enabled: bool) -> Any:
        o, run = self.opened.config.online, self.opened.run
        if self.serial:
            return progress_bar(self.last_round, desc="online", unit="round", enabled=enabled,
                                initial=run.round)
        return progress_bar(o.rounds * o.updates_per_round, desc="trainer", unit="update",
                            enabled=enabled, initial=run.updates)

    def start(self) -> None:
        self._publish()

    def _publish(self) -> None:
        if self.opened.run.updates in self.needed:
            self.syncs.append(self.opened.publish())

    def _take_round(self, feed: Any) -> None:
        """This round's samples (its row and checkpoint need them)."""
        while feed.next <= self.opened.run.round:
            done = feed.get()
            self.sampled[done.round] = done
            self.pending.extend(done.batches)

    def play(self, feed: Any, bar: Any) -> dict[str, float]:
        config, run, policy = self.opened.config, self.opened.run, self.opened.policy
        o = config.online
        t_round = time.perf_counter()
        waited = feed.waited
        steps, lags, busy = [], [], 0.0
        if self.serial:  # with θ_{U(r)}, the trainer's state now
            self._take_round(feed)
        end = version_of(config, run.round + 1)
        while run.updates < end:
            while not self.pending:
                done = feed.get()
                self.sampled[done.round] = done
                self.pending.extend(done.batches)
            t0 = time.perf_counter()
            steps.append(policy.step(self.pending.popleft()))
            busy += time.perf_counter() - t0
            lags.append(run.updates - version_of(config, run.updates // o.updates_per_round))
            run.updates += 1
            if not self.serial:
                bar.update(1)
            self._publish()
        self._take_round(feed)
        this = self.sampled.pop(run.round)
        run.round, run.position, run.mu_source = this.round + 1, this.position, this.mu_source
        metrics = dict(this.metrics)
        metrics.update(mean_metrics(steps))
        metrics.update(updates=run.updates, round_updates=len(steps), queued=len(self.pending),
                       mu_from_sampler=float(run.mu_source == "sampler"),
                       seconds_sampling=this.seconds["seconds_sampling"],
                       seconds_scoring=this.seconds["seconds_scoring"],
                       seconds_training=busy, **lag_metrics(lags, config.train.batch_size),
                       **side_seconds(sampler_busy=this.seconds["sampler_busy"],
                                      sampler_wait=this.seconds["sampler_wait"],
                                      trainer_busy=busy, trainer_wait=feed.waited - waited,
                                      syncs=self.syncs),
                       **{"pipeline/version": float(this.version),
                          "pipeline/round_s": time.perf_counter() - t_round})
        self.syncs = []
        if self.serial:  # one program on one device set: no pipeline columns
            metrics = {k: v for k, v in metrics.items() if not k.startswith("pipeline/")}
        return metrics

    def shown(self, bar: Any, metrics: dict[str, float]) -> None:
        # the postfix without a redraw: one line per count in a log
        run = self.opened.run
        if self.serial:
            bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", updates=run.updates,
                            refresh=False)
            bar.update(1)
        else:
            bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", round=run.round,
                            refresh=False)

    def save(self) -> None:
        self.opened.save(list(self.pending))
