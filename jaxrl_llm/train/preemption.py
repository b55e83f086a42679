"""When to stop training on SIGTERM (preemption), decided at the same step on every process.

A multi-host job must stop at one step everywhere: a host that leaves the loop to checkpoint
while another enters the next train step waits forever in mismatched collectives. So the
decision goes through a sync point:

- one process: SIGTERM or Ctrl-C sets a flag (a Python handler), read after each step;
- several processes with JAX's preemption sync manager (started by
  `jax.distributed.initialize`, on by default: `jax_enable_preemption_service`): JAX catches
  SIGTERM itself (a C++ handler), tells every host through the coordination service, and
  `multihost_utils.reached_preemption_sync_point(step)` returns True on every host at the same
  step (one after the largest step any host had reached). A Python SIGTERM handler would
  replace JAX's, so none is installed in this mode. Measured with two local CPU processes: only
  one gets SIGTERM and both leave the loop after the same step;
- several processes without that manager: each step all-gathers the local flags (one
  scalar collective) and stops when any is set.

`request()` is the programmatic stop (tests, hooks); with several processes, call it on every
process at the same step (hooks run the same program everywhere).
"""

from __future__ import annotations

LOCAL, JAX_SYNC, ALLGATHER = "local", "jax_sync_point", "allgather"
EXIT_PREEMPTED = 143  # 128 + SIGTERM, what schedulers expect of a job stopped by SIGTERM


class Preempted(Exception):
    """A command's training stage stopped on SIGTERM or Ctrl-C after checkpointing
    (`iterate`, `quickstart`): the command exits 143 (SIGTERM) or 130 (Ctrl-C,
    `signals.last_signal`); re-running it resumes."""


def sync_mode() -> str:
    """How this job agrees on a stop step: LOCAL, JAX_SYNC or ALLGATHER (see module doc)."""
    import jax
    from jax._src import distributed

    if jax.process_count() == 1:
        return LOCAL
    if getattr(distributed.global_state, "preemption_sync_manager", None) is not None:
        return JAX_SYNC
    return ALLGATHER


class StopSync:
    """The stop decision of one training loop: `install()` before it, `should_stop(step)`
    after every step on every process, `uninstall()` after it. SIGTERM and Ctrl-C (SIGINT)
    both stop it (`jaxrl_llm/core/signals.py`), except in JAX_SYNC mode, where JAX handles SIGTERM
    and a Ctrl-C on one host alone keeps Python's default."""

    def __init__(self, mode: str | None = None) -> None:
        from jaxrl_llm.core.signals import STOP_SIGNALS, StopSignals

        self.mode = mode if mode is not None else sync_mode()
        self._signals = StopSignals(() if self.mode == JAX_SYNC else STOP_SIGNALS,
                                    what="the current step and its checkpoint")

    def request(self) -> None:
        self._signals.request()

    def is_set(self) -> bool:
        """Whether this process was asked to stop (not yet agreed with the others)."""
        return self._signals.signum is not None

    @property
    def signum(self) -> int | None:
        """The signal that stopped this process (None: a request, or JAX's preemption)."""
        return self._signals.signum

    def install(self) -> None:
        """Route the stop signals to the flag (main thread only)."""
        self._signals.install()

    def uninstall(self) -> None:
        self._signals.uninstall()

    def should_stop(self, step: int) -> bool:
        """True on every process at the same `step` once any process got SIGTERM/request."""
        if self.mode == LOCAL:
            return self.is_set()
        from jax.experimental import multihost_utils

        if self.mode == JAX_SYNC:
            return multihost_utils.reached_preemption_sync_point(step) or self.is_set()
        import numpy as np

        flags = multihost_utils.process_allgather(np.asarray([self.is_set()], np.int32))
        return bool(np.any(flags))
