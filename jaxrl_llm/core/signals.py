"""Ctrl-C (SIGINT) and SIGTERM stop a long stage at its next safe point, never mid-write.

Python turns SIGINT into a `KeyboardInterrupt` raised wherever the interpreter happens to be;
inside a callback (JAX's garbage-collection hook, a thread) it is printed as "Exception
ignored" and lost, and the run goes on. So the stages with a safe point — `train` after a
step (it checkpoints), `generate` and `score` after a batch of prompts or records — handle the
signals themselves while they run (`StopSignals`): the first SIGINT or SIGTERM sets a flag the
loop reads, the loop saves and the command exits 128 + the signal number (130 for Ctrl-C, 143
for SIGTERM); re-running the same command resumes. A second Ctrl-C exits at once (130): every
stage is also safe against a kill (RELIABILITY.md: SIGKILL at any point, then resumed).

Outside those stages Ctrl-C is Python's `KeyboardInterrupt`, with one exception
(`CtrlCOutsideImports`): a `KeyboardInterrupt` raised while a compiled extension initialises
(jaxlib's MLIR bindings, array_record) leaves it half-built and the process segfaults or aborts
instead of exiting 130, so a Ctrl-C that lands inside an import is re-delivered once it is over;
and one whose `KeyboardInterrupt` something on the way swallowed is raised again at the end.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

EXIT_SIGINT = 128 + signal.SIGINT  # 130: what shells report for a job stopped by Ctrl-C
EXIT_SIGTERM = 128 + signal.SIGTERM  # 143: what schedulers expect after a preemption
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_last: list[int] = []  # the most recent stop signal this process got (exit codes)


def exit_code(signum: int | None) -> int:
    """The exit code of a command a signal stopped (SIGTERM when not known)."""
    return 128 + (signum if signum is not None else signal.SIGTERM)


def last_signal() -> int | None:
    """The last stop signal a `StopSignals` block received in this process, if any."""
    return _last[-1] if _last else None


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


def _inside_import(frame: Any) -> bool:
    """Whether the interpreter is executing an `import` (any frame of importlib's bootstrap)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


class CtrlCOutsideImports:
    """While active (`with CtrlCOutsideImports():`, main thread only), Ctrl-C raises
    `KeyboardInterrupt` as Python's default handler does, except inside an import: there it is
    sent again every `retry_s` seconds until it lands outside one, or `raise_pending` raises it.
    A stage's own handler (`StopSignals`) takes over while that stage runs, then hands back."""

    def __init__(self, retry_s: float = 0.05) -> None:
        self.retry_s = retry_s
        self._timer: threading.Timer | None = None  # one re-delivery at a time
        self._previous: Any = None
        self._installed = False
        self.raised = False  # a KeyboardInterrupt left this handler (it may have been swallowed)

    def _resend(self) -> None:
        self._timer = None
        os.kill(os.getpid(), signal.SIGINT)

    def _handle(self, signum: int, frame: Any) -> None:
        if not _inside_import(frame):
            self.raised = True
            raise KeyboardInterrupt
        if self._timer is None:
            self._timer = threading.Timer(self.retry_s, self._resend)
            self._timer.daemon = True  # never keeps a finished process alive
            self._timer.start()

    def _cancel(self) -> bool:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        return timer is not None

    def raise_pending(self) -> None:
        """Raise the `KeyboardInterrupt` of a Ctrl-C the command did not end on: one still
        waiting for its import to end (the command finished first), or one raised that code on
        the way swallowed (a broad `except`, a callback whose errors are dropped — seen once
        during `import jax` under load: exit 0, no output). A Ctrl-C is never lost."""
        waiting, swallowed = self._cancel(), self.raised
        self.raised = False
        if waiting or swallowed:
            raise KeyboardInterrupt

    def __enter__(self) -> CtrlCOutsideImports:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self._cancel()
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False


class StopSignals:
    """While active (`with StopSignals(...)`, main thread only), the first of `signals` sets
    `signum`; the loop calls `check(what)` at its safe points. A second SIGINT exits at once."""

    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS, *, what: str = "the batch") -> None:
        self.signals = signals
        self.what = what
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            if signum == signal.SIGINT:
                os.write(2, b"\nsecond Ctrl-C: exiting now (re-run the command to resume)\n")
                os._exit(EXIT_SIGINT)
            return
        self.signum = signum
        _last.append(signum)
        os.write(2, f"\n{signal_name(signum)}: stopping after {self.what} "
                    f"(Ctrl-C again to exit at once)\n".encode())

    def request(self, signum: int = signal.SIGTERM) -> None:
        """Stop as a signal would (tests, hooks)."""
        if self.signum is None:
            self.signum = signum

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may handle signals
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)

    def uninstall(self) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous.clear()

    def __enter__(self) -> StopSignals:
        self.install()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()

    def check(self, stage: str) -> None:
        """Raise `Interrupted` if a signal came; `stage` says what stopped, for the message."""
        if self.signum is not None:
            raise Interrupted(f"{stage} stopped by {signal_name(self.signum)}; re-run the same "
                              "command to resume", self.signum)
