"""Answer equivalence with math-verify in worker PROCESSES under a hard per-call timeout.

math-verify's own timeout uses `signal.alarm`, which only works on the main thread; called
from a worker thread it fails and — caught as "not equal" — scored every MATH answer 0
elsewhere. Here each check runs in a spawned worker process; the parent waits at most
`timeout_s` and kills a worker that overruns (its replacement starts in the background, so
the call returns at the deadline, not after a restart). Outcomes are "ok", "timeout" or
"error", and the verifier counts each kind (`metrics()`), so a failure is never a silent 0.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing as mp
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from jaxrl_llm.tasks.answers import normalize_number

STARTUP_TIMEOUT_S = 120.0  # spawning a worker imports sympy: seconds on a busy machine
MAX_ANSWER_CHARS = 2000  # longer "answers" are not parsed at all (status "error")


@dataclasses.dataclass(frozen=True)
class VerifyOutcome:
    correct: bool
    status: str  # "ok" | "timeout" | "error"
    detail: str = ""


def _check(gold: str, pred: str) -> bool:
    from math_verify import parse, verify

    # Our own hard timeout is the guard; math-verify's signal timeouts stay off.
    g = parse(f"${gold}$", parsing_timeout=None, raise_on_error=True)
    p = parse(f"${pred}$", parsing_timeout=None, raise_on_error=True)
    return bool(verify(g, p, timeout_seconds=None, raise_on_error=True))


def _worker_main(conn: Connection) -> None:
    # We disable math-verify's signal timeouts on purpose (the parent enforces a hard one).
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    _check("1", "1")  # import and warm up before "ready": job timeouts exclude start-up
    conn.send("ready")
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        gold, pred = job
        try:
            conn.send(("ok", _check(gold, pred), ""))
        except Exception as err:  # report every verifier failure to the parent
            conn.send(("error", False, f"{type(err).__name__}: {err}"))


def quick_equal(gold: str, pred: str) -> bool:
    """Cheap exact matches that need no verifier: same text or the same plain number."""
    if gold.replace(" ", "") == pred.replace(" ", ""):
        return True
    a, b = normalize_number(gold), normalize_number(pred)
    return a is not None and b is not None and a == b


class _Worker:
    """One verifier process; `ready` once it has imported math-verify."""

    def __init__(self, ctx: Any) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        self.ready = False
        self.startup_deadline = time.monotonic() + STARTUP_TIMEOUT_S

    def take_ready(self) -> None:
        """Consume the "ready" message (call when `conn` is readable)."""
        try:
            ok = self.conn.recv() == "ready"
        except EOFError:  # e.g. spawn cannot re-import a __main__ read from stdin
            ok = False
        if not ok:
            self.kill()
            raise RuntimeError(
                f"math verifier worker process failed to start (exit code {self.proc.exitcode}); "
                "run from a file or module, not stdin"
            )
        self.ready = True

    def wait_ready(self) -> None:
        """Block until the worker has imported math-verify (start-up is not a job's time)."""
        if self.ready:
            return
        if not self.conn.poll(max(0.0, self.startup_deadline - time.monotonic())):
            self.kill()
            raise RuntimeError(f"math verifier worker process did not start within {STARTUP_TIMEOUT_S}s")
        self.take_ready()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class MathVerifier:
    """A pool of `workers` verifier processes; `verify_many` checks pairs in parallel."""

    def __init__(self, *, workers: int = 2, timeout_s: float = 5.0) -> None:
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"need workers >= 1 and timeout_s > 0, got {workers}, {timeout_s}")
        self.num_workers, self.timeout_s = workers, timeout_s
        self._ctx = mp.get_context("spawn")  # no fork: the parent may hold JAX threads
        self._workers: list[_Worker] = []
        self.counts = {"calls": 0, "quick": 0, "ok": 0, "timeout": 0, "error": 0}
        atexit.register(self.close)

    def _ensure_workers(self) -> None:
        """Start missing workers; block on start-up only while no worker is ready at all."""
        self._workers += [_Worker(self._ctx) for _ in range(self.num_workers - len(self._workers))]
        if not any(w.ready for w in self._workers):
            for worker in self._workers:  # all started first: the imports run in parallel
                worker.wait_ready()

    def wait_ready(self) -> None:
        """Start every worker and wait until all have imported math-verify (e.g. to time calls)."""
        self._ensure_workers()
        for worker in self._workers:
            worker.wait_ready()

    def verify(self, gold: str, pred: str) -> VerifyOutcome:
        return self.verify_many([(gold, pred)])[0]

    def verify_many(self, pairs: Sequence[tuple[str, str]]) -> list[VerifyOutcome]:
        results: list[VerifyOutcome | None] = [None] * len(pairs)
        pending: list[int] = []
        for i, (gold, pred) in enumerate(pairs):
            self.counts["calls"] += 1
            if len(pred) > MAX_ANSWER_CHARS:
                results[i] = VerifyOutcome(False, "error", f"answer longer than {MAX_ANSWER_CHARS} chars")
                self.counts["error"] += 1
            elif quick_equal(gold, pred):
                results[i] = VerifyOutcome(True, "ok", "exact match")
                self.counts["quick"] += 1
            else:
                pending.append(i)
        if pending:
            self._run(pairs, pending, results)
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    def _run(self, pairs: Sequence[tuple[str, str]], pending: list[int], results: list) -> None:
        self._ensure_workers()
        queue = list(reversed(pending))
        busy: dict[int, tuple[int, float]] = {}  # worker slot -> (job index, deadline)
        while queue or busy:
            for slot, worker in enumerate(self._workers):
                if slot not in busy and queue and worker.ready:
                    job = queue.pop()
                    worker.conn.send(pairs[job])
                    busy[slot] = (job, time.monotonic() + self.timeout_s)
            # A replacement worker still starting up is waited on only while jobs are queued.
            starting = [w for w in self._workers if not w.ready] if queue else []
            deadlines = [d for _, d in busy.values()] + [w.startup_deadline for w in starting]
            conns = [self._workers[s].conn for s in busy] + [w.conn for w in starting]
            ready = wait(conns, timeout=max(0.0, min(deadlines) - time.monotonic()))
            now = time.monotonic()
            for worker in starting:
                if worker.conn in ready:
                    worker.take_ready()
                elif now >= worker.startup_deadline:
                    worker.wait_ready()  # raises: the replacement never came up
            for slot in list(busy):
                job, deadline = busy[slot]
                worker = self._workers[slot]
                if worker.conn in ready:
                    try:
                        status, correct, detail = worker.conn.recv()
                    except EOFError:  # the worker died (e.g. out of memory)
                        status, correct, detail = "error", False, "verifier process died"
                        worker.kill()
                        self._workers[slot] = _Worker(self._ctx)
                    results[job] = VerifyOutcome(bool(correct), status, detail)
                    self.counts[status] += 1
                    del busy[slot]
                elif now >= deadline:
                    # Killing is the only reliable way to stop a runaway sympy call. The
                    # replacement starts in the background: this call returns without waiting.
                    worker.kill()
                    self._workers[slot] = _Worker(self._ctx)
                    results[job] = VerifyOutcome(False, "timeout", f"over {self.timeout_s}s")
                    self.counts["timeout"] += 1
                    del busy[slot]

    def metrics(self) -> dict[str, float]:
        return {f"verifier/{k}": float(v) for k, v in self.counts.items()}

    def close(self) -> None:
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            worker.proc.join(timeout=2)
            if worker.proc.is_alive():
                worker.kill()
        self._workers = []
