"""Kill-safety of the storage pipeline (`online.exchange`): the trainer or the worker killed
with SIGKILL at a point chosen by what has happened (a weight version or a record shard
appearing, a checkpoint committed), then started again with the same command while the other
side keeps running, ends in the serial loop's state bit for bit: nothing lost, nothing
trained twice. Free-running (not reproducible): the bound and the accounting survive a kill."""

from __future__ import annotations

import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.faults.harness import base_env, cli, interrupt, when
from tests.online.exchange_helpers import assert_serial_equal, finish, readme_commands, setup, start
from tests.online.helpers import metric_rows
from tests.reliability import record

# Slow (each case: two sides, a kill and a restart, ~1 min): CI runs them in its reliability step.
pytestmark = [pytest.mark.reliability, pytest.mark.slow]


def _exists(relative: str) -> Callable[[Path], bool]:
    return lambda cwd: (cwd / relative).exists()


POINTS = {  # (side killed, what has happened, its trigger)
    "trainer-v1": ("trainer", "once θ_1 is published (mid-round 3, before its checkpoint)",
                   _exists("exchange/weights/v00000001-p000of001.bin")),
    "trainer-ckpt4": ("trainer", "after round 4's checkpoint",
                      _exists("run/checkpoints/4/_CHECKPOINT_METADATA")),
    "worker-r1": ("worker", "once its round-1 shard is written",
                  _exists("exchange/rounds/r00000001.bin")),
    "worker-r4": ("worker", "once its round-4 shard is written (waiting for θ_3)",
                  _exists("exchange/rounds/r00000004.bin")),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The uninterrupted serial run (`serial/`) and the compilation cache it filled."""
    root = tmp_path_factory.mktemp("serial")
    setup(root)
    cli(["online", "--config", "serial.yaml", "--no-progress"], cwd=root,
        env=base_env(root / "jax-cache"))
    return root / "serial", root / "jax-cache"


def kill_and_rerun(argv: list[str], trigger: Any, cwd: Path, env: dict[str, str]) -> None:
    """SIGKILL one side's command when `trigger` fires, then run the same command to the end."""
    kill = interrupt(argv, cwd=cwd, env=env, sig=signal.SIGKILL, trigger=trigger)
    assert kill.landed and kill.returncode == -signal.SIGKILL, kill.describe()
    cli(argv, cwd=cwd, env=env)  # the same command


@pytest.mark.parametrize("point", list(POINTS))
def test_sigkill_of_either_side_then_the_same_command_gives_the_serial_state(
        tmp_path: Path, reference: tuple[Path, Path], point: str) -> None:
    side, what, fires = POINTS[point]
    serial, cache = reference
    env = base_env(cache)
    setup(tmp_path)
    shutil.copytree(serial, tmp_path / "serial")
    args = dict(zip(("trainer", "worker"), (a + ["--no-progress"] for a in readme_commands())))
    other = "worker" if side == "trainer" else "trainer"
    background = start(args[other], tmp_path, env, f"{other}.log")
    failures = 0
    try:
        kill_and_rerun(args[side], when(fires, what), tmp_path, env)
        finish(background, tmp_path, f"{other}.log")
        assert_serial_equal(tmp_path)
        assert not list((tmp_path / "exchange/rounds").glob("r*.bin"))  # all consumed, collected
    except AssertionError:
        failures = 1
        raise
    finally:
        if background.poll() is None:
            background.kill()
            background.wait()
        record("fault injection", f"online exchange: SIGKILL the {side} {what}, then the same "
               "command", runs=1, failures=failures,
               detail="trainer and worker as separate processes sharing only the exchange "
               "directory; final params, optimizer state, step, RNG, checkpoints' state and "
               "queue, metric rows bitwise equal to the uninterrupted serial loop's; "
               "staleness 2")


def test_sigkill_of_the_free_running_trainer_keeps_the_bound_and_the_accounting(
        tmp_path: Path, reference: tuple[Path, Path]) -> None:
    # Free-running is not reproducible: what a kill must not break is the bound and the
    # accounting across the restart (each sample trained at most once, none lost).
    env = base_env(reference[1])
    setup(tmp_path, pipeline="free", staleness=0, max_staleness=1, mu_source="sampler")
    args = dict(zip(("trainer", "worker"), (a + ["--no-progress"] for a in readme_commands())))
    worker = start(args["worker"], tmp_path, env, "worker.log")
    failures = 0
    try:
        kill_and_rerun(args["trainer"], when(_exists("exchange/weights/v00000002-p000of001.bin"),
                                             "once θ_2 is published"), tmp_path, env)
        finish(worker, tmp_path, "worker.log")
        rows = metric_rows(tmp_path / "run")
        assert [r["updates"] for r in rows] == [1, 2, 3, 4]  # each round once
        assert [r["pipeline/trained_total"] for r in rows] == [8.0, 16.0, 24.0, 32.0]
        for r in rows:
            assert r["pipeline/lag_max"] <= 1.0
            assert r["pipeline/received_total"] == (r["pipeline/trained_total"]
                                                    + r["pipeline/dropped_total"]
                                                    + r["pipeline/waiting"])
    except AssertionError:
        failures = 1
        raise
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        record("fault injection", "online exchange (free-running): SIGKILL the trainer once "
               "θ_2 is published, then the same command", runs=1, failures=failures,
               detail="every trained version lag within online.max_staleness=1; received = "
               "trained + dropped + waiting in every row; 4 updates of 8 samples, each "
               "round's row once")
