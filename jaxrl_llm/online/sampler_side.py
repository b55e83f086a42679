"""The sampler's side of the online pipeline (docs/online.md § Pipeline): the serial round's
first half (sample, reward, μ, group transform) on the sampler's own devices (`SamplerSide`),
the weight versions the trainer publishes to it (`Weights`), and the trainer's end of the
hand-over (`Feed`: rounds from the sampler thread, or sampled in turn with `pipeline: off`).
Shared by the in-memory pipeline (pipeline.py, free.py) and the rollout workers (remote.py).
"""

from __future__ import annotations

import queue as queues
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flax import nnx

from jaxrl_llm.api import Policy, transform_rewards
from jaxrl_llm.data.records import Record
from jaxrl_llm.online import run_state
from jaxrl_llm.online.config import OnlineConfig
from jaxrl_llm.online.lag import version_of
from jaxrl_llm.online.placement import Placement
from jaxrl_llm.online.rounds import (
    k_for_round,
    prompt_slice,
    reward_metrics,
    sampling_seed,
    split_batches,
)

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

    live = False  # the sampler holds copies (`LiveWeights`: it shares the trainer's)

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


class LiveWeights:
    """`Weights` of a sampler that shares the trainer's policy and devices (the serial loop,
    `online.pipeline: off` without `online.sampler_devices`): every version it takes is the
    trainer's current state, which the rounds' order makes the one it needs (`train_rounds`
    samples a round before its updates); nothing is ever copied."""

    live = True

    def __init__(self, policy: Policy) -> None:
        self.policy = policy

    def put(self, version: int, weights: Any) -> None:
        del version, weights  # never called: `Opened.publish` copies nothing for it

    def take(self, version: int) -> Any:
        del version
        return self.policy.state.params, self.policy.state.model_state

    def close(self) -> None:
        pass


class _Stopped(Exception):
    """The trainer stopped (finished, failed or interrupted): the sampler side ends."""


class SamplerSide:
    """The serial round's first half (sample, reward, μ, transform) on the sampler's devices."""

    def __init__(self, config: OnlineConfig, policy: Policy, placement: Placement,
                 problems: list[Any], weights: Any, *, mu_source: str | None,
                 mu: Callable[..., Any]) -> None:
        self.config, self.problems, self.weights, self._mu = config, problems, weights, mu
        if getattr(weights, "live", False):  # the serial loop: the trainer's own policy
            self.policy = policy
        else:  # the trainer's model on the sampler's mesh, no optimizer
            template = policy.state.replace(opt_state=None, ref_params=None, step=None,
                                            rng=None)
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
        records = run_state.shared_rewards(records)  # multi-host: process 0's verdicts
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


def sampler_mu(config: OnlineConfig) -> Callable[[SamplerSide, list[Record]], Any]:
    """The sampler side's μ step: the serial loop's `_mu`, its decision kept on the side."""

    def mu(side: SamplerSide, records: list[Record]) -> Any:
        state = run_state.RunState(0)
        state.mu_source = side.mu_source
        out = run_state.round_mu(side.policy, config, state, records)
        side.mu_source = state.mu_source
        return out

    return mu
