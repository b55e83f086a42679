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

import queue as queues
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
from flax import nnx

from jaxrl_llm.api import Policy, load_policy, transform_rewards
from jaxrl_llm.core.errors import ConfigError
from jaxrl_llm.core.paths import as_path
from jaxrl_llm.core.progress import progress_bar
from jaxrl_llm.data.records import Record
from jaxrl_llm.online import loop
from jaxrl_llm.online.config import OnlineConfig
from jaxrl_llm.online.lag import lag_metrics, side_seconds, total_rounds, version_of
from jaxrl_llm.online.placement import Placement, make_placement
from jaxrl_llm.online.queue import StalenessQueue
from jaxrl_llm.online.rounds import (
    k_for_round,
    mean_metrics,
    probe,
    probe_start,
    prompt_slice,
    reward_metrics,
    sampling_seed,
    split_batches,
)
from jaxrl_llm.online.sampler_shape import IN_FLIGHT_VERSIONS
from jaxrl_llm.sampling.layout import sampling_dtype
from jaxrl_llm.train.checkpoint import CHECKPOINT_DIR, Checkpointer
from jaxrl_llm.train.metrics_log import MetricsLogger
from jaxrl_llm.train.preemption import StopSync
from jaxrl_llm.train.state_items import state_items

POLL_S = 0.5  # how often a waiting side checks that the other is still alive


@dataclass
class Sampled:
    """One round as the sampler side hands it over."""

    round: int
    version: int | None  # the weights θ_version sampled it; None: weights lost with a killed
    # free-running trainer (published past its checkpoint): never trained, counted dropped
    position: int  # the prompt position after it
    batches: list[list[Record]]
    metrics: dict[str, float]  # reward metrics, μ mismatch, pkpo_k
    mu_source: str | None
    seconds: dict[str, float] = field(default_factory=dict)


class Weights:
    """Published weight versions on the sampler's devices: the trainer puts θ_v, the sampler
    takes the one its round needs (waiting for it) and drops the older ones. `newest_only`
    (free-running): a put also drops every older version but the one last taken (sampling
    now), so at most two versions are ever held, however far the trainer runs ahead."""

    def __init__(self, newest_only: bool = False) -> None:
        self._cond = threading.Condition()
        self._versions: dict[int, Any] = {}
        self._closed = False
        self._newest_only = newest_only
        self._taken: int | None = None

    def put(self, version: int, weights: Any) -> None:
        with self._cond:
            self._versions[version] = weights
            if self._newest_only:  # free mode only ever takes the newest
                for old in [v for v in self._versions if v < version and v != self._taken]:
                    del self._versions[old]
            self._cond.notify_all()

    def held(self) -> int:
        """How many versions are held now."""
        with self._cond:
            return len(self._versions)

    def take(self, version: int) -> Any:
        with self._cond:
            while version not in self._versions:
                if self._closed:
                    raise _Stopped
                self._cond.wait(POLL_S)
            return self._take(version)

    def _take(self, version: int) -> Any:
        """θ_version, the older versions dropped (no later round samples with them); the
        lock is held."""
        for old in [v for v in self._versions if v < version]:
            del self._versions[old]
        self._taken = version
        return self._versions[version]

    def take_newest(self, after: int | None = None) -> tuple[int, Any] | None:
        """(v, θ_v) for the newest version v, taken at once (free-running mode: a put between
        reading v and taking it could drop it); None when v ≤ `after`. Waits for a first one."""
        with self._cond:
            while not self._versions:
                if self._closed:
                    raise _Stopped
                self._cond.wait(POLL_S)
            version = max(self._versions)
            if after is not None and version <= after:
                return None
            return version, self._take(version)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class _Stopped(Exception):
    """The trainer stopped (finished, failed or interrupted): the sampler side ends."""


class SamplerSide:
    """The serial round's first half (sample, reward, μ, transform) on the sampler's devices."""

    def __init__(self, config: OnlineConfig, policy: Policy, placement: Placement,
                 problems: list[Any], weights: Weights, *, mu_source: str | None,
                 mu: Callable[..., Any]) -> None:
        self.config, self.problems, self.weights, self._mu = config, problems, weights, mu
        # the sampler's own Policy: the trainer's model on the sampler's mesh, no optimizer
        template = policy.state.replace(opt_state=None, ref_params=None, step=None, rng=None)
        self.policy = Policy(policy.config, template, policy.tokenizer, placement.sampler)
        self.mu_source = mu_source
        self.bar: Any = None
        self.free = False  # free-running: sample with the newest weights, not θ_U(r)
        self.stop: threading.Event | None = None  # set: abandon the round at its next segment
        # what samples a round: the policy itself, or a stand-in with the same `rollout`
        # (a vLLM worker's `VllmRollout`); weights and μ stay the policy's
        self.sampler: Any = self.policy

    def version(self, round_index: int) -> int:
        return version_of(self.config, round_index)

    def sample(self, round_index: int, position: int) -> Sampled:
        o, g, d = self.config.online, self.config.generate, self.config.data
        t0 = time.perf_counter()
        if self.free:
            version, (params, model_state) = self.weights.take_newest()
        else:
            version = self.version(round_index)
            params, model_state = self.weights.take(version)
        self.policy.state = self.policy.state.replace(params=params, model_state=model_state)
        t1 = time.perf_counter()
        picked = [self.problems[i] for i in prompt_slice(position, o.prompts_per_round,
                                                         len(self.problems))]
        swaps: list[float] = []
        records = self.sampler.rollout(picked, n=g.n, seed=sampling_seed(self.config.seed, round_index),
                                      group_offset=round_index * o.prompts_per_round,
                                      **(self._in_flight(version, swaps) if o.inflight_weights
                                         else {}),
                                      **({"on_segment": self._check_stop} if self.stop else {}))
        t2 = time.perf_counter()
        metrics = reward_metrics(records, g.n, o.pass_k)
        records, mismatch = self._mu(self, records)
        t3 = time.perf_counter()
        k = k_for_round(o.pkpo_k, d.pkpo_k, round_index)
        records = transform_rewards(records, d.group_transform, k=k)
        metrics.update(mismatch, **({"pkpo_k": k} if k else {}))
        if self.bar is not None:
            self.bar.update(1)
        return Sampled(round_index, version, (position + o.prompts_per_round) % len(self.problems),
                       split_batches(records, o.updates_per_round), metrics, self.mu_source,
                       {"seconds_sampling": t2 - t1, "seconds_scoring": t3 - t2,
                        "sampler_busy": time.perf_counter() - t1, "sampler_wait": t1 - t0,
                        "inflight_swaps": float(len(swaps)), "inflight_swap_s": sum(swaps)})

    def _check_stop(self, *_: int) -> None:
        """After each decode segment: a stopping trainer (Ctrl-C, SIGTERM, an error) ends the
        round here, so the thread ends within a segment instead of a whole round (the round
        is sampled again, identically, on resume)."""
        if self.stop is not None and self.stop.is_set():
            raise _Stopped

    def _in_flight(self, version: int, swaps: list[float]) -> dict[str, Any]:
        """`Policy.rollout`'s in-flight keywords: before each decode segment, the newest
        published weights if newer than those sampling (`swaps` gets each swap's seconds)."""
        current = [version]

        def newer() -> tuple[int, Any] | None:
            t0 = time.perf_counter()
            newest = self.weights.take_newest(after=current[0])
            if newest is None:
                return None
            v, (params, model_state) = newest
            self.policy.state = self.policy.state.replace(params=params, model_state=model_state)
            current[0] = v
            swaps.append(time.perf_counter() - t0)
            return v, nnx.split(self.policy.model)[1]

        return dict(weights=newer, version=version)

    def run(self, first: int, last: int, position: int, out: queues.Queue[Any],
            stop: threading.Event) -> None:
        """Rounds `first` … `last − 1` into `out`, in order; an error is handed over too."""
        self.stop = stop
        try:
            for r in range(first, last):
                if stop.is_set():
                    return
                done = self.sample(r, position)
                position = done.position
                while True:  # a bounded hand-over (free-running) blocks the sampler
                    try:
                        out.put(done, timeout=POLL_S)
                        break
                    except queues.Full:
                        if stop.is_set():
                            return
        except _Stopped:
            return
        except BaseException as e:  # the trainer raises it
            out.put(e)


class Feed:
    """The trainer's end of the hand-over: the next round, from the thread or sampled here."""

    def __init__(self, side: SamplerSide, first: int, last: int, position: int,
                 overlap: bool, ahead: int = 0) -> None:
        self.side, self.next, self.position = side, first, position
        self.waited = 0.0
        self.stop = threading.Event()
        self._out: queues.Queue[Any] = queues.Queue(maxsize=ahead)  # 0: unbounded
        self._thread = None
        if overlap:
            self._thread = threading.Thread(target=side.run, name="online-sampler", daemon=True,
                                            args=(first, last, position, self._out, self.stop))
            self._thread.start()

    def get(self) -> Sampled:
        t0 = time.perf_counter()
        if self._thread is None:
            done = self.side.sample(self.next, self.position)
        else:
            while True:
                try:
                    done = self._out.get(timeout=POLL_S)
                    break
                except queues.Empty:
                    if not self._thread.is_alive():
                        raise RuntimeError("the online sampler thread ended without handing "
                                           f"over round {self.next}") from None
            if isinstance(done, BaseException):
                raise done
        self.waited += time.perf_counter() - t0
        self.next, self.position = done.round + 1, done.position
        return done

    def close(self) -> None:
        """Stop the sampler thread and wait for it: it ends at its next decode segment
        (`SamplerSide._check_stop`), never abandoned while it runs XLA programs."""
        self.stop.set()
        self.side.weights.close()
        while self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=30)
            if self._thread.is_alive():
                print("online: waiting for the sampler thread to end its decode segment",
                      file=sys.stderr)


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
    run: Any  # loop.RunState
    meta: dict[str, Any]  # the restored checkpoint's online meta ({} on a fresh run)
    checkpointer: Checkpointer
    side: SamplerSide | None
    weights: Weights | None
    _decode: tuple[Any, Any] | None = None  # the sampler's (decode layout, dtype), once
    stop: Any = None  # the trainer loop's StopSync (`watch_signals`)
    stopped: bool = False

    def publish(self) -> float:
        """θ_updates onto the sampler's devices, in its decode layout and sampling dtype (the
        copy it decodes with); the trainer's pause in seconds."""
        t0 = time.perf_counter()
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
        return loop.OnlineResult(
            rounds=self.run.round, updates=self.run.updates, last=last, policy=self.policy,
            stopped=self.stopped, stop_signal=self.stop.signum if self.stopped else None,
            checkpoint=None if latest is None else str(self.checkpointer.directory / str(latest)))

    def save(self, pending: list[list[Record]], **extra: Any) -> None:
        self.run.queue = StalenessQueue(self.run.queue.staleness, pending)
        self.checkpointer.save(self.run.round, state_items(self.policy.state), force=True, meta={
            "config": self.experiment.model_dump(mode="json"),
            loop.ONLINE_META: {**self.run.meta(), **extra}})


def open_run(config: OnlineConfig, *, sampler: bool = True, opened: type[Opened] = Opened
             ) -> Opened:
    """Checks (before any model is loaded), placement, policy, restore, and the sampler side
    (`sampler`; none for the storage trainer, whose samplers are other processes)."""
    if sampler and config.online.exchange:
        raise ConfigError(f"online.exchange={config.online.exchange}: the sampler runs in "
                          "worker processes; run each side with `jaxrl-llm online --role "
                          "trainer` / `--role worker --worker K` (online.remote)")
    loop.check_config(config)
    placement = make_placement(config)
    o = config.online
    experiment = loop.experiment_of(config)
    policy = load_policy(config=experiment, mesh=placement.trainer)
    run = loop.RunState(o.staleness)
    checkpointer = Checkpointer(as_path(config.run_dir) / CHECKPOINT_DIR, save_every=o.checkpoint_every,
                                keep=config.train.keep_checkpoints, async_save=False,
                                params_dtype=config.train.checkpoint_dtype)
    meta: dict[str, Any] = {}
    if checkpointer.latest_step() is not None:
        loop.restore_run(policy, checkpointer, run)
        meta = checkpointer.read_meta(checkpointer.latest_step())[loop.ONLINE_META]
        free = meta.get("mode") == "free"
        if free != (o.pipeline == "free"):  # rows, rounds and the queue mean other things
            raise ConfigError(
                f"{checkpointer.directory} was written by online.pipeline="
                f"{'free' if free else 'off/deterministic'} and cannot resume as "
                f"online.pipeline={o.pipeline}: set it back, or start a new run_dir")

    if not sampler:
        return opened(config, experiment, placement, policy, run, meta, checkpointer, None, None)
    weights = Weights(newest_only=config.online.pipeline == "free")
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


def sampler_mu(config: OnlineConfig) -> Callable[[SamplerSide, list[Record]], Any]:
    """The sampler side's μ step: the serial loop's `_mu`, its decision kept on the side."""

    def mu(side: SamplerSide, records: list[Record]) -> Any:
        state = loop.RunState(0)
        state.mu_source = side.mu_source
        out = loop.round_mu(side.policy, config, state, records)
        side.mu_source = state.mu_source
        return out

    return mu


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
    """The trainer's side of the deterministic pipeline: update u trains on batch u from
    `make_feed()` (rounds in order: `get()`, `next`, `waited`, `close()`), and θ_v is
    published (`opened.publish`) right after the update that made it when a round samples
    with it; rows and checkpoints as the serial loop's."""
    config = opened.config
    o = config.online
    policy, run, checkpointer = opened.policy, opened.run, opened.checkpointer
    total_updates = o.rounds * o.updates_per_round
    last_round = total_rounds(config)
    pending: deque[list[Record]] = deque(run.queue.batches())
    needed = {version_of(config, r) for r in range(run.round, last_round)}
    syncs: list[float] = []

    def publish() -> None:
        if run.updates in needed:
            syncs.append(opened.publish())

    logger = opened.logger()
    bar = progress_bar(total_updates, desc="trainer", unit="update",
                       enabled=progress and jax.process_index() == 0, initial=run.updates)
    sampled: dict[int, Sampled] = {}
    last: dict[str, Any] = {}
    feed = None
    try:
        opened.watch_signals()
        # the serial loop's step-0 row: the initial weights, before the sampler starts
        numbers = probe_start(eval_hook, eval_at_start, policy, run.round, total_updates)
        if numbers:
            last = logger.log(0, numbers)
        publish()
        feed = make_feed()
        while run.round < last_round:
            t_round = time.perf_counter()
            waited = feed.waited
            steps, lags, busy = [], [], 0.0
            end = version_of(config, run.round + 1)
            while run.updates < end:
                while not pending:
                    done = feed.get()
                    sampled[done.round] = done
                    pending.extend(done.batches)
                t0 = time.perf_counter()
                steps.append(policy.step(pending.popleft()))
                busy += time.perf_counter() - t0
                lags.append(run.updates - version_of(config, run.updates // o.updates_per_round))
                run.updates += 1
                bar.update(1)
                publish()
            while feed.next <= run.round:  # this round's samples: its row and checkpoint
                done = feed.get()
                sampled[done.round] = done
                pending.extend(done.batches)
            this = sampled.pop(run.round)
            run.round, run.position, run.mu_source = this.round + 1, this.position, this.mu_source
            metrics = dict(this.metrics)
            metrics.update(mean_metrics(steps))
            metrics.update(probe(eval_hook, eval_every, policy, run.updates - len(steps),
                                  run.updates, total_updates))
            metrics.update(updates=run.updates, round_updates=len(steps), queued=len(pending),
                           mu_from_sampler=float(run.mu_source == "sampler"),
                           seconds_sampling=this.seconds["seconds_sampling"],
                           seconds_scoring=this.seconds["seconds_scoring"],
                           seconds_training=busy, **lag_metrics(lags, config.train.batch_size),
                           **side_seconds(sampler_busy=this.seconds["sampler_busy"],
                                          sampler_wait=this.seconds["sampler_wait"],
                                          trainer_busy=busy, trainer_wait=feed.waited - waited,
                                          syncs=syncs),
                           **{"pipeline/version": float(this.version),
                              "pipeline/round_s": time.perf_counter() - t_round})
            last = logger.log(run.round, metrics)
            syncs.clear()
            bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", round=run.round,
                            refresh=False)  # no second line for this count (a log)
            stopped = opened.should_stop(last_round)
            saved = checkpointer.should_save(run.round) or run.round == last_round or stopped
            if saved:
                opened.save(list(pending))
            opened.round_done(saved)
            if stopped:
                break
    finally:
        opened.close(feed, bar, logger)
    return opened.result(last)
