"""When to stop training on SIGTERM (preemption), decided at the same step on every process.

A multi-host job must stop at one step everywhere: a host that leaves the loop to checkpoint
while another enters the next train step waits forever in mismatched collectives. So the
decision goes through a sync point:

- one process: SIGTERM or Ctrl-C is noted (`jaxrl_llm/core/signals.py`'s `stop_point`) and read
  after each step;
- several processes with JAX's preemption sync manager (started by
  `jax.distributed.initialize`, on by default: `jax_enable_preemption_service`): JAX catches
  SIGTERM itself (a C++ handler), tells every host through the coordination service, and
  `multihost_utils.reached_preemption_sync_point(step)` returns True on every host at the same
  step (one after the largest step any host had reached). A Python SIGTERM handler would
  replace JAX's, so none is installed in this mode (JAX's, installed by
  `jax.distributed.initialize`, replaced the one `signals.supervise` installed before it), and
  a Ctrl-C on one host exits that host at once. Measured with two local CPU processes: only
  one gets SIGTERM and both leave the loop after the same step;
- several processes without that manager: each step all-gathers the local flags (one
  scalar collective) and stops when any is set.

`request()` is the programmatic stop (tests, hooks); with several processes, call it on every
process at the same step (hooks run the same program everywhere).
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np
from jax._src import distributed
from jax.experimental import multihost_utils

from jaxrl_llm.core.signals import STOP_SIGNALS, stop_point

LOCAL, JAX_SYNC, ALLGATHER = "local", "jax_sync_point", "allgather"


def sync_mode() -> str:
    """How this job agrees on a stop step: LOCAL, JAX_SYNC or ALLGATHER (see module doc)."""
    if jax.process_count() == 1:
        return LOCAL
    if getattr(distributed.global_state, "preemption_sync_manager", None) is not None:
        return JAX_SYNC
    return ALLGATHER


class StopSync:
    """The stop decision of one training loop: `install()` before it, `should_stop(step)`
    after every step on every process, `uninstall()` after it. SIGTERM and Ctrl-C (SIGINT)
    both stop it (a `signals.stop_point`), except in JAX_SYNC mode, where JAX handles SIGTERM
    and a Ctrl-C on one host exits it at once."""

    def __init__(self, mode: str | None = None, *,
                 what: str = "the current step and its checkpoint") -> None:
        self.mode = mode if mode is not None else sync_mode()
        self.what = what  # what the first signal waits for ("stopping after <what>")
        self._signals = () if self.mode == JAX_SYNC else STOP_SIGNALS
        self._active = contextlib.ExitStack()
        self._point = None
        self._requested = False

    def request(self) -> None:
        self._requested = True

    def is_set(self) -> bool:
        """Whether this process was asked to stop (not yet agreed with the others)."""
        return self._requested or (self._point is not None and self._point.stopping())

    @property
    def signum(self) -> int | None:
        """The signal that stopped this process (None: a request, or JAX's preemption)."""
        return self._point.signum if self._point is not None else None

    def install(self) -> None:
        """Take the stop signals from here on (`uninstall` ends it)."""
        self._point = self._active.enter_context(
            stop_point(self.what, self._signals))

    def uninstall(self) -> None:
        self._active.close()

    def should_stop(self, step: int) -> bool:
        """True on every process at the same `step` once any process got SIGTERM/request."""
        if self.mode == LOCAL:
            return self.is_set()

        if self.mode == JAX_SYNC:
            return multihost_utils.reached_preemption_sync_point(step) or self.is_set()

        flags = multihost_utils.process_allgather(np.asarray([self.is_set()], np.int32))
        return bool(np.any(flags))
