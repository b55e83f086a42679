"""Run a `jaxrl-llm` command as a subprocess in a working directory, signal it at a chosen
or a random point, and run it again to resume.

- chosen point: `when(predicate)` fires as soon as `predicate(cwd)` holds (a trace line, a
  temporary checkpoint directory, a shard file, a stage in `stages.json` ...), polled every
  few milliseconds while the command runs;
- random point: `after(seconds)` fires after a delay the caller draws from a seeded RNG
  within the command's measured runtime (`random_delay`).

`interrupt(...)` returns a `Kill` saying whether the signal landed (the process was still
running) and how it ended; `cli(...)` runs a command to completion (the resume).
Subprocesses run on one CPU device with a shared persistent compilation cache, so a cycle
costs little more than JAX's start-up.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.xla_flags import ONE_DEVICE

POLL_S = 0.002  # trigger polling interval
TIMEOUT_S = 300  # no tiny command takes this long; a hang fails the case


def base_env(cache_dir: Path) -> dict[str, str]:
    """The subprocesses' environment: CPU, one device, compilation cache in `cache_dir`."""
    env = dict(os.environ)
    env.update({
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": ONE_DEVICE,  # one host device (tests/conftest.py forces 8 for the sharding tests)
        "JAX_COMPILATION_CACHE_DIR": str(cache_dir),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "PYTHONUNBUFFERED": "1",
    })
    return env


def command(args: list[str]) -> list[str]:
    """The user's command line: the `jaxrl-llm` script of this environment."""
    script = shutil.which("jaxrl-llm", path=str(Path(sys.executable).parent))
    return [script, *args] if script else [sys.executable, "-m", "jaxrl_llm.cli", *args]


@dataclass(frozen=True)
class Trigger:
    fires: Callable[[Path, float], bool]  # (cwd, seconds since start) -> send the signal now
    description: str


def after(seconds: float) -> Trigger:
    return Trigger(lambda cwd, t: t >= seconds, f"after {seconds:.2f} s")


def when(predicate: Callable[[Path], bool], description: str) -> Trigger:
    def fires(cwd: Path, t: float) -> bool:
        try:
            return predicate(cwd)
        except (OSError, ValueError):  # a file caught mid-write: look again next poll
            return False

    return Trigger(fires, description)


def random_delay(seed: int, runtime: float, low: float = 0.2, high: float = 1.0) -> float:
    """A delay uniform in [low, high] · `runtime` (the uninterrupted command's wall time)."""
    return random.Random(seed).uniform(low, high) * runtime


@dataclass
class Kill:
    signal: int
    trigger: str
    landed: bool  # the signal reached a running process
    returncode: int
    seconds: float  # from start to the signal (or to the exit, if it did not land)
    output: str  # the tail of stdout + stderr

    def describe(self) -> str:
        name = signal.Signals(self.signal).name
        where = "landed" if self.landed else "missed (process had exited)"
        return f"{name} {self.trigger}: {where} at {self.seconds:.2f} s, exit {self.returncode}"


def _tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


def interrupt(args: list[str], *, cwd: Path, env: dict[str, str], sig: int, trigger: Trigger,
              timeout: float = TIMEOUT_S) -> Kill:
    """Start `jaxrl-llm args` in `cwd`, send `sig` when `trigger` fires, wait for the exit."""
    log = cwd / f".fault-{time.monotonic_ns()}.log"
    with log.open("w") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(command(args), cwd=cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        landed, fired_at = False, None
        try:
            while proc.poll() is None:
                elapsed = time.perf_counter() - start
                if elapsed > timeout:
                    raise TimeoutError(f"{args[0]} still running after {timeout} s")
                if trigger.fires(cwd, elapsed):
                    proc.send_signal(sig)
                    landed, fired_at = proc.poll() is None, elapsed
                    break
                time.sleep(POLL_S)
            code = proc.wait(timeout=timeout)
            if sig == signal.SIGKILL and code == 0:
                landed = False  # it arrived while the process was already exiting: a miss
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    seconds = fired_at if fired_at is not None else time.perf_counter() - start
    text = _tail(log)
    log.unlink()
    return Kill(sig, trigger.description, landed, code, seconds, text)


def cli(args: list[str], *, cwd: Path, env: dict[str, str], timeout: float = TIMEOUT_S,
        ok: tuple[int, ...] = (0,)) -> tuple[float, str]:
    """Run `jaxrl-llm args` to completion in `cwd`; (wall seconds, output). An exit code not
    in `ok` raises with the output's tail."""
    start = time.perf_counter()
    proc = subprocess.run(command(args), cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    seconds = time.perf_counter() - start
    output = (proc.stdout + proc.stderr)[-3000:]
    if proc.returncode not in ok:
        raise RuntimeError(f"jaxrl-llm {' '.join(args)} exited {proc.returncode}:\n{output}")
    return seconds, output


def expected_exit(kill: Kill) -> bool:
    """Whether the interrupted command ended as its signal should make it: SIGKILL kills;
    SIGTERM kills (no handler), or `train` (also inside `iterate`), `generate` and `score`
    stop gracefully with 143 after a checkpoint or a batch, or it finishes with 0 when the
    signal came during its last step; Ctrl-C (SIGINT) does the same with 130."""
    if not kill.landed:
        return kill.returncode == 0
    if kill.signal == signal.SIGKILL:
        return kill.returncode == -signal.SIGKILL
    if kill.signal == signal.SIGINT:
        # Ctrl-C: every command stops and exits 130 (jaxrl_llm/core/signals.py); -SIGINT if it
        # came before Python had started the command (its default: die by the signal)
        return kill.returncode in (-signal.SIGINT, 130, 0)
    return kill.returncode in (-signal.SIGTERM, 143, 0)
