"""One way to stop (jaxrl_llm/core/signals.py): inside a stop point the first signal is noted and
the stage stops at its next check; elsewhere, or a second Ctrl-C, exits at once. Each case
runs `supervise` (what `cli.main` runs every command under) in a fresh process and signals it
from the command itself, so what happened is read from its exit code and output."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

_PRELUDE = textwrap.dedent("""
    import os, signal, sys, time
    from jaxrl_llm.core.signals import Interrupted, stop_point, supervise

    def wait_for(condition):  # the main thread takes the signal within moments
        for _ in range(3000):
            if condition():
                return True
            time.sleep(0.01)
        return False
""")


# A command inside a stop point, Ctrl-C'ed once (what follows is indented as its body).
_CTRL_C_NOTED = """
        with stop_point("the test step") as stop:
            stop.check("test")  # no signal yet: goes on
            os.kill(os.getpid(), signal.SIGINT)
            print("noted" if wait_for(stop.stopping) else "not noted", flush=True)
"""


def _run(command: str, cwd: Path) -> subprocess.CompletedProcess:
    script = _PRELUDE + "def command():\n" + textwrap.indent(textwrap.dedent(command), "    ") + \
        textwrap.dedent("""
            try:
                sys.exit(supervise(command))
            except Interrupted as err:
                print("Interrupted:", err, flush=True)
                sys.exit(err.exit_code)
        """)
    return subprocess.run([sys.executable, "-c", script], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_first_ctrl_c_in_a_stop_point_stops_at_the_check_then_resumes_nothing_else(tmp_path):
    proc = _run(_CTRL_C_NOTED + """
            stop.check("test")
            print("went on after the check", flush=True)
        return 0
    """, tmp_path)
    assert proc.returncode == 130, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [
        "noted", "Interrupted: test stopped by Ctrl-C (SIGINT); re-run the same command to resume"]
    assert "stopping after the test step (Ctrl-C again to exit at once)" in proc.stderr


def test_second_ctrl_c_exits_at_once(tmp_path):
    proc = _run(_CTRL_C_NOTED + """
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)  # a compile that does not return: the main thread exits anyway
            print("slept", flush=True)
        return 0
    """, tmp_path)
    assert (proc.returncode, proc.stdout) == (130, "noted\n"), proc.stdout + proc.stderr
    assert "second Ctrl-C: exiting now" in proc.stderr


def test_sigterm_in_a_stop_point_exits_143_and_a_second_is_ignored(tmp_path):
    proc = _run("""
        with stop_point("the test step") as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            wait_for(stop.stopping)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)  # (had the second SIGTERM exited, nothing below would print)
            print("still running", flush=True)
            stop.check("test")
        return 0
    """, tmp_path)
    assert proc.returncode == 143, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [
        "still running", "Interrupted: test stopped by SIGTERM; re-run the same command to resume"]


def test_a_signal_outside_a_stop_point_exits_at_once(tmp_path):
    for sig, code in (("SIGINT", 130), ("SIGTERM", -15)):  # (-15: killed, as unhandled)
        proc = _run(f"""
            os.kill(os.getpid(), signal.{sig})
            time.sleep(30)
            print("slept", flush=True)
            return 0
        """, tmp_path)
        assert (proc.returncode, proc.stdout) == (code, ""), proc.stdout + proc.stderr
        assert "jaxrl-llm: interrupted" in proc.stderr


def test_a_stop_point_that_takes_no_signal_exits_at_once(tmp_path):
    """(A multi-host `score`, or `train` where JAX's preemption sync handles SIGTERM.)"""
    proc = _run("""
        with stop_point("the test step", ()):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)
            print("slept", flush=True)
        return 0
    """, tmp_path)
    assert (proc.returncode, proc.stdout) == (130, ""), proc.stdout + proc.stderr


def test_the_commands_exception_and_exit_code_come_back(tmp_path):
    assert _run("return 7", tmp_path).returncode == 7
    proc = _run("raise ValueError('bad input')", tmp_path)
    assert proc.returncode == 1 and "ValueError: bad input" in proc.stderr


def test_a_ctrl_c_whose_check_does_not_come_within_the_grace_exits_at_once(tmp_path):
    """A stage with a grace (generate, evaluate) stuck where no check comes (XLA compiling)
    exits 130 once the grace is over, instead of waiting for the compile; without a grace the
    same Ctrl-C waits for the check."""
    stuck = """
        with stop_point("the test segment", grace_s=0.5) as stop:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(600)  # no check comes: the process timeout fails the test if it waits
            stop.check("test")
        return 0
    """
    proc = _run(stuck, tmp_path)
    assert proc.returncode == 130, proc.stdout + proc.stderr
    assert "stopping after the test segment (Ctrl-C again to exit at once); exiting in 0.5 s " \
        "at the latest" in proc.stderr
    assert "the test segment did not come within 0.5 s" in proc.stderr
    assert "Interrupted" not in proc.stdout  # it did not get to the check
    waits = stuck.replace(", grace_s=0.5", "").replace("time.sleep(600)", "time.sleep(1)")
    proc = _run(waits + "", tmp_path)
    assert proc.returncode == 130, proc.stdout + proc.stderr
    assert "Interrupted: test stopped by Ctrl-C (SIGINT)" in proc.stdout
    assert "did not come within" not in proc.stderr
