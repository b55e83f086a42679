"""Ctrl-C (SIGINT) and SIGTERM: every command stops within moments, never mid-write.

One mechanism for every command (`cli.main` runs each one through `supervise`):

- The command runs in a worker thread; the main thread only waits for it and takes the
  signals. Python runs a signal handler on the main thread between bytecodes, so a handler
  never waits for an XLA compile or a long device program to return, and no
  `KeyboardInterrupt` is ever raised inside the command (one that landed inside an import left
  jaxlib's extension half-built and the process crashed; one a library caught became its own
  error, or was lost).
- A stage that keeps progress, or says what it kept, declares where it can stop: `with
  stop_point(what) as stop:` and `stop.check(stage)` at its safe points (`train` after a
  step and `online` after a round, which they checkpoint; `generate` and `evaluate` after a
  decode segment, about 2 s; `score` after a batch; vLLM after a chunk). The first SIGINT/SIGTERM inside one is noted
  ("stopping after <what>"; during a compile, the check comes once it returns, or, for the
  stages with a grace — generate, evaluate, score —, the command exits when the grace of a few
  seconds runs out first, so that no Ctrl-C waits for XLA), and `check`
  raises `Interrupted`, which `cli.main` turns into exit 128 + the signal number (130 for
  Ctrl-C, 143 for SIGTERM); re-running the command resumes. The signal stays noted until the
  command ends, so a later stage's first `check` stops it too.
- Anywhere else (loading, compiling outside a stage, `curate`, `export`) the first
  Ctrl-C exits 130 at once, as does a second Ctrl-C anywhere, and SIGTERM kills the process
  as it would without a handler (143 is a graceful stop): every output is written atomically
  (`jaxrl_llm/core/atomic.py`) and every command is safe against a kill at any point
  (RELIABILITY.md), so nothing partial is left. A second SIGTERM is ignored.

Several processes (a multi-host job) must stop at the same step: `train/preemption.py` decides
that (JAX's preemption sync point handles SIGTERM itself there, with its own C++ handler).
Without `supervise` (a library call on the main thread, tests) a `stop_point` installs the
handlers itself while it is active.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

EXIT_SIGINT = 128 + signal.SIGINT  # 130: what shells report for a job stopped by Ctrl-C
EXIT_SIGTERM = 128 + signal.SIGTERM  # 143: what schedulers expect after a preemption
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
POLL_S = 0.1  # how long the main thread waits between looks (a signal delivered to another
# thread only wakes the main thread at its next look)

_points: list[StopPoint] = []  # active stop points, innermost last
_noted: list[int] = []  # the signal a stop point took (at most one until the command ends)
_noted_at: list[float] = []  # when it came (time.monotonic), for a stop point's grace
_supervised = threading.Event()  # `supervise` runs a command now (its handlers are installed)


def exit_code(signum: int | None) -> int:
    """The exit code of a command a signal stopped (SIGTERM when not known)."""
    return 128 + (signum if signum is not None else signal.SIGTERM)


def signal_name(signum: int | None) -> str:
    """How messages name the signal; None (JAX's multi-host preemption sync, which catches
    SIGTERM itself, or a programmatic request) is SIGTERM, as its exit code 143 says."""
    return "Ctrl-C (SIGINT)" if signum == signal.SIGINT else "SIGTERM"


class Interrupted(Exception):
    """A stage stopped at a safe point on a signal; `exit_code` is 128 + its number."""

    def __init__(self, message: str, signum: int | None) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = exit_code(signum)


def _exit_now(code: int, message: str, *, by_signal: bool = False) -> None:
    """Leave at once (no cleanup runs: it could wait on the worker), after the output so far;
    `by_signal`: killed by SIGTERM, as without a handler (a graceful stop is what exits 143)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os.write(2, f"\n{message}\n".encode())
    if by_signal:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    os._exit(code)


def _handle(signum: int, frame: Any) -> None:
    if _noted:  # a second signal
        if signum == signal.SIGINT:
            _exit_now(EXIT_SIGINT, "jaxrl-llm: second Ctrl-C: exiting now "
                      "(re-run the command to resume)")
        return
    try:
        point = _points[-1]
    except IndexError:
        point = None
    if point is None or signum not in point.signals:
        name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
        _exit_now(exit_code(signum), f"jaxrl-llm: interrupted ({name}); every output written so "
                  "far is whole, none is partial (outputs are written atomically)",
                  by_signal=signum == signal.SIGTERM)
    _noted.append(signum)
    _noted_at[:] = [time.monotonic()]
    later = (f"; exiting in {point.grace_s:g} s at the latest" if point.grace_s is not None
             and signum == signal.SIGINT else "")
    os.write(2, f"\n{signal_name(signum)}: stopping after {point.what} "
                f"(Ctrl-C again to exit at once){later}\n".encode())


def _overdue() -> None:
    """A Ctrl-C whose stop point has a grace and has not stopped within it (XLA compiling, or
    a long program) exits now: only what the stage had not finished is dropped, as with a kill."""
    point = _points[-1] if _points else None
    if (point is None or point.grace_s is None or _noted[-1:] != [signal.SIGINT]
            or time.monotonic() - _noted_at[0] < point.grace_s):
        return
    _exit_now(EXIT_SIGINT, f"jaxrl-llm: {point.what} did not come within {point.grace_s:g} s (XLA "
              "compiling, or a long program running): exiting now; every output written so far "
              "is whole, none is partial (re-run the command to resume)")


@contextlib.contextmanager
def _handlers(signals: tuple[int, ...]) -> Iterator[None]:
    """`_handle` takes `signals` while active (main thread only), then the previous ones."""
    previous = {s: signal.signal(s, _handle) for s in signals}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def supervise(command: Callable[[], int]) -> int:
    """Run `command()` in a worker thread while the main thread takes SIGINT and SIGTERM;
    its return value, or its exception raised again here. Off the main thread: just call it."""
    if threading.current_thread() is not threading.main_thread() or _supervised.is_set():
        return command()
    outcome: dict[str, Any] = {}
    context = contextvars.copy_context()  # the worker sees the caller's context variables

    def work() -> None:
        try:
            outcome["code"] = context.run(command)
        except BaseException as err:  # raised again on the main thread
            outcome["error"] = err

    worker = threading.Thread(target=work, name="jaxrl-llm command", daemon=True)
    with _handlers(STOP_SIGNALS):
        _supervised.set()
        try:
            worker.start()
            while worker.is_alive():
                worker.join(POLL_S)  # returns to the interpreter, which runs a pending handler
                _overdue()
        finally:
            _supervised.clear()
            _noted.clear()
            _noted_at.clear()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["code"]


class StopPoint:
    """An active stop point (`stop_point`): `check(stage)` raises `Interrupted` once a signal
    it takes came."""

    def __init__(self, what: str, signals: tuple[int, ...], grace_s: float | None = None) -> None:
        self.what = what
        self.signals = signals
        self.grace_s = grace_s
        self._after: list[int] | None = None  # what `signum` says once the point has ended

    @property
    def signum(self) -> int | None:
        """The signal to stop on; None when none came."""
        noted = _noted if self._after is None else self._after
        return noted[-1] if noted else None

    def stopping(self) -> bool:
        return self.signum is not None

    def check(self, stage: str, then: str = "re-run the same command to resume") -> None:
        """Raise `Interrupted` if a signal came; the message says `stage` stopped, and `then`."""
        if self.signum is not None:
            raise Interrupted(f"{stage} stopped by {signal_name(self.signum)}; {then}",
                              self.signum)


@contextlib.contextmanager
def stop_point(what: str, signals: tuple[int, ...] = STOP_SIGNALS, *,
               grace_s: float | None = None) -> Iterator[StopPoint]:
    """While active, the first of `signals` is noted and the stage stops at its next `check`
    ("stopping after `what`"); other signals, and a second Ctrl-C, still exit at once.
    `grace_s`: under `supervise`, a Ctrl-C whose `check` has not come within that many seconds
    exits at once (for stages whose checks come every few seconds once compiled, so that a
    Ctrl-C during a compile does not wait for it; `train` has none: it saves at its step)."""
    point = StopPoint(what, signals, grace_s)
    own = (not _supervised.is_set() and not _points and signals
           and threading.current_thread() is threading.main_thread())
    with _handlers(signals) if own else contextlib.nullcontext():
        _points.append(point)
        try:
            yield point
        finally:
            _points.remove(point)
            point._after = list(_noted)
            if own:
                _noted.clear()  # a library call's signal ends with it
