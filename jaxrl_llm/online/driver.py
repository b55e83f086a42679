"""The one rounds driver of `jaxrl-llm online` (docs/online.md): every mode (the serial loop,
the deterministic and free-running pipelines, the storage trainer) runs `drive`, and differs
only in its placement (`Opened`: where the sampler runs, how weights reach it) and in how its
rounds take batches (`Rounds`: in order, `pipeline.InOrder`; the freshest within a bound,
`free.Freshest`). Stop points, the evaluations (step 0 included), checkpoints, metric rows and
progress lines are written here, once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import jax

from jaxrl_llm.online.rounds import probe, probe_start


class Rounds(Protocol):
    """How a mode's rounds take their batches and train (the driver does the rest)."""

    last_round: int  # the run ends when `run.round` reaches it

    def progress(self, enabled: bool) -> Any:
        """The trainer's progress bar."""

    def start(self) -> None:
        """Before the first round: publish the weights the first rounds sample with."""

    def play(self, feed: Any, bar: Any) -> dict[str, float]:
        """One round: take its batches from `feed`, train, publish; advance `run.round`; the
        round's metrics row (without evaluation numbers)."""

    def shown(self, bar: Any, metrics: dict[str, float]) -> None:
        """After the row is written: the bar's postfix (and count) for this round."""

    def save(self) -> None:
        """The round's checkpoint (`Opened.save` with what the mode's resume needs)."""


def drive(opened: Any, make_feed: Callable[[], Any], rounds: Rounds, *, progress: bool,
          eval_hook: Callable[[int, Any], Any] | None = None, eval_every: int = 0,
          eval_at_start: bool = False) -> Any:
    """Run (or resume) `opened`'s rounds until `rounds.last_round`, a stop signal (after the
    round, checkpointed) or an error; `run_state.OnlineResult`. `eval_hook(updates, policy)`:
    before the first update of a fresh run (`eval_at_start`, a row at step 0), at the end of
    every round whose updates reached a new multiple of `eval_every`, and after the last."""
    if eval_hook is not None and eval_every <= 0:
        raise ValueError(f"eval_every={eval_every}: an eval_hook needs eval_every > 0")
    o = opened.config.online
    policy, run, checkpointer = opened.policy, opened.run, opened.checkpointer
    total_updates = o.rounds * o.updates_per_round
    logger = opened.logger()
    bar = rounds.progress(progress and jax.process_index() == 0)
    last: dict[str, Any] = {}
    feed = None
    try:
        opened.watch_signals()
        numbers = probe_start(eval_hook, eval_at_start, policy, run.round, total_updates)
        if numbers:  # the initial weights' row (none when a signal stopped the evaluation)
            last = logger.log(0, numbers)
        rounds.start()
        feed = make_feed()
        while run.round < rounds.last_round:
            before = run.updates
            metrics = rounds.play(feed, bar)
            metrics.update(probe(eval_hook, eval_every, policy, before, run.updates,
                                 total_updates))
            last = logger.log(run.round, metrics)
            rounds.shown(bar, metrics)
            stopped = opened.should_stop(rounds.last_round)
            saved = (checkpointer.should_save(run.round) or run.round == rounds.last_round
                     or stopped)
            if saved:
                rounds.save()
            opened.round_done(saved)
            if stopped:
                break
    finally:
        opened.close(feed, bar, logger)
    return opened.result(last)
