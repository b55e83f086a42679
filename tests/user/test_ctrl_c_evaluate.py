"""Issue 41, "one way to stop": Ctrl-C in `jaxrl-llm evaluate --model smollm2 --task arithmetic
--n 8`, as a user met it. The first Ctrl-C stopped only after the whole prompt batch (over two
minutes on CPU) and the second one waited for XLA; the progress line stood at "0/100 questions
00:00 elapsed" throughout. Now the command runs in a worker thread, the main thread takes the
signals (jaxrl_llm/core/signals.py), and the sampler calls back after every decode segment, which
also shows the decode step (`batch 1/K: token T/512`).

Each case reads the command's own output to know where it is (the "compiling the sampler" line,
the first decode-step line) and checks what happened after the signal, not how long it took:
with a progress line at every update (JAXRL_PROGRESS_INTERVAL_S=0), a stop "at the next decode
segment" means no decode-step line after the stop message beyond the segment already running.
"""

from __future__ import annotations

import re
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from tests.faults.harness import command
from tests.user.cli import user_env

pytestmark = pytest.mark.slow  # loads SmolLM2-135M and compiles its sampler, three times

COMPILING = "prefill (compiling the sampler)"
STOPPING = "stopping after the current decode segment (Ctrl-C again to exit at once)"
# (followed by "; exiting in 5 s at the latest": a compile does not hold a Ctrl-C longer)
DECODE_STEP = re.compile(r"evaluate arithmetic: .*batch \d+/\d+: token \d+/512")


class Evaluate:
    """`jaxrl-llm evaluate` running in `cwd`, its stdout and stderr read line by line."""

    def __init__(self, cwd: Path) -> None:
        self.proc = subprocess.Popen(
            command(["evaluate", "--model", "smollm2", "--task", "arithmetic", "--n", "8"]),
            cwd=cwd, env=user_env(JAXRL_PROGRESS_INTERVAL_S="0"), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._watchdog = threading.Timer(900, self.proc.kill)  # a hang fails, never blocks CI
        self._watchdog.start()

    def wait_for(self, matches: object) -> None:
        """Read until a line `matches` (a substring or a regex); fail if the command ends first."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if (matches.search(line) if isinstance(matches, re.Pattern) else matches in line):
                return
        raise AssertionError(f"exited {self.proc.wait()} before {matches!r}:\n" + self.output)

    def ctrl_c(self) -> None:
        self.proc.send_signal(signal.SIGINT)

    def finish(self) -> int:
        assert self.proc.stdout is not None
        self.lines += [line.rstrip("\n") for line in self.proc.stdout]
        code = self.proc.wait()
        self._watchdog.cancel()
        return code

    @property
    def output(self) -> str:
        return "\n".join(self.lines)


def _stopped_at_the_next_segment(run: Evaluate, cwd: Path) -> None:
    """Exit 130 with the stage's message, no eval.json, and the interrupted batch unfinished:
    after the stop message at most the decode segment already running reported its step
    (its stop check ran before its line), no question was counted and no batch started."""
    after = run.lines[run.lines.index(next(x for x in run.lines if STOPPING in x)):]
    assert sum(bool(DECODE_STEP.search(x)) for x in after) <= 1, run.output
    # at the segment's check, or, when the compile keeps the check away past the stage's
    # grace (STOP_GRACE_S), by the supervisor: either way before the batch finished
    assert ("jaxrl-llm evaluate: evaluate stopped by Ctrl-C (SIGINT); no eval.json was written"
            in run.output or "the current decode segment did not come within" in run.output)
    assert not [x for x in run.lines if re.search(r"evaluate arithmetic: [1-9]\d*/100", x)], run.output
    assert "batch 2/" not in run.output
    assert "Traceback" not in run.output
    assert not list(cwd.rglob("eval.json"))


@pytest.mark.parametrize("where", [COMPILING, DECODE_STEP], ids=["compiling", "decoding"])
def test_ctrl_c_stops_at_the_next_decode_segment(tmp_path, where):
    run = Evaluate(tmp_path)
    run.wait_for(where)
    run.ctrl_c()
    assert run.finish() == 130, run.output
    _stopped_at_the_next_segment(run, tmp_path)


def test_a_second_ctrl_c_exits_at_once_while_xla_compiles(tmp_path):
    run = Evaluate(tmp_path)
    run.wait_for(COMPILING)
    run.ctrl_c()
    run.wait_for(STOPPING)
    run.ctrl_c()
    assert run.finish() == 130, run.output
    assert "second Ctrl-C: exiting now" in run.output
    # It did not wait for the compile: no decode segment ever reported a step.
    assert not [x for x in run.lines if DECODE_STEP.search(x)], run.output
    assert not list(tmp_path.rglob("eval.json"))
