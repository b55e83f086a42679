"""Ctrl-C and SIGTERM mean the same in every online mode (issue 55 items 1 and 14): the
deterministic and free-running pipelines and the storage trainer stop after the current
round, save a checkpoint, exit 130 (Ctrl-C) or 143 (SIGTERM) and say where the checkpoint is
and that the same command resumes; a signal during an in-training evaluation is not
swallowed; the sampler thread is joined, not abandoned. The resumed deterministic run equals
the uninterrupted one bit for bit. Each case runs `jaxrl-llm online` as a user does: a
subprocess in a temporary working directory with a relative run_dir."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import numpy as np
import pytest

from tests.faults.harness import base_env, cli, interrupt, random_delay, when
from tests.online.exchange_helpers import finish, start
from tests.online.helpers import final_arrays, tiny, write_yaml
from tests.reliability import record

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

ONLINE = {"rounds": 4, "staleness": 1, "mu_source": "trainer", "checkpoint_every": 100}
EVAL = {"n": 2, "num_questions": 4, "maj_k": [1]}
STOPPED = re.compile(r"jaxrl-llm online: stopped by (SIGTERM|Ctrl-C \(SIGINT\)) after round (\d+) "
                     r"\((\d+) updates\); checkpoint (\S+); run the same command to resume")


def _env(directory: Path) -> dict[str, str]:
    env = base_env(directory / "jax-cache")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"  # 1 samples, 1 trains
    env["JAXRL_PROGRESS_INTERVAL_S"] = "0"  # every progress line written: the triggers read them
    return env


def _config(directory: Path, name: str, *, evaluate: bool = True, **online: object) -> str:
    write_yaml(directory / name, tiny(Path("run"), train={"eval_every": 1} if evaluate else {},
                                      eval=EVAL, online={**ONLINE, **online}))
    return name


def _log_says(text: str):
    """A trigger: the interrupted command's own output (harness.interrupt writes it to
    `.fault-*.log` in its working directory) contains `text`."""
    return when(lambda cwd: any(text in p.read_text(errors="replace")
                                for p in cwd.glob(".fault-*.log")), f"once it prints {text!r}")


def _stopped(kill, code: int) -> re.Match:
    assert kill.landed and kill.returncode == code, kill.describe() + "\n" + kill.output
    said = STOPPED.search(kill.output)
    assert said, kill.output
    return said


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[tuple, float]:
    """The uninterrupted deterministic pipeline run: its final arrays and wall time."""
    root = tmp_path_factory.mktemp("reference")
    args = ["online", "--config", _config(root, "det.yaml", pipeline="deterministic",
                                          sampler_devices=1)]
    seconds, _ = cli(args, cwd=root, env=_env(root))
    return final_arrays(root / "run"), seconds


def _equal(got: tuple[int, dict], want: tuple[int, dict]) -> None:
    """The same checkpoint step and every array bit for bit."""
    assert got[0] == want[0] and got[1].keys() == want[1].keys()
    for key in want[1]:
        np.testing.assert_array_equal(got[1][key], want[1][key], err_msg=key)


def test_signals_in_every_mode(tmp_path: Path, reference: tuple[dict, float]) -> None:
    want, runtime = reference
    failures, cases = 0, []
    try:
        # 1. deterministic pipeline, SIGTERM during an in-training evaluation: not swallowed
        d = tmp_path / "eval"
        d.mkdir()
        args = ["online", "--config", _config(d, "det.yaml", pipeline="deterministic",
                                              sampler_devices=1)]
        kill = interrupt(args, cwd=d, env=_env(d), sig=signal.SIGTERM,
                         trigger=_log_says("evaluate"))
        said = _stopped(kill, 143)
        assert Path(d / said.group(4)).is_dir() or Path(said.group(4)).is_dir()
        cli(args, cwd=d, env=_env(d))  # the same command resumes, to the end
        _equal(final_arrays(d / "run"), want)
        cases.append("deterministic, SIGTERM during an evaluation")
        # 2. deterministic pipeline, Ctrl-C at a random time (a round, a hand-off, a save)
        d = tmp_path / "random"
        d.mkdir()
        args = ["online", "--config", _config(d, "det.yaml", pipeline="deterministic",
                                              sampler_devices=1)]
        kill = interrupt(args, cwd=d, env=_env(d), sig=signal.SIGINT,
                         trigger=_after_first_row(random_delay(55, runtime, 0.1, 0.4)))
        if kill.returncode != 0:  # 0: it had finished its last round
            _stopped(kill, 130)
        cli(args, cwd=d, env=_env(d))
        _equal(final_arrays(d / "run"), want)
        cases.append("deterministic, Ctrl-C at a random time")
        # 3. free-running pipeline, SIGTERM after its first row
        d = tmp_path / "free"
        d.mkdir()
        args = ["online", "--config", _config(d, "free.yaml", evaluate=False, pipeline="free",
                                              staleness=0, max_staleness=2,
                                              sampler_devices=1)]
        kill = interrupt(args, cwd=d, env=_env(d), sig=signal.SIGTERM,
                         trigger=_log_says("trainer: 1/4"))
        rounds = int(_stopped(kill, 143).group(2))
        assert 1 <= rounds < 4
        _, out = cli(args, cwd=d, env=_env(d))
        assert '"updates": 4' in out, out
        cases.append("free, SIGTERM after a round")
        # 4. the storage trainer (a worker beside it), SIGTERM after its first row: the
        # worker waits, the same trainer command resumes, both finish
        d = tmp_path / "exchange"
        d.mkdir()
        env = _env(d)
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
        config = _config(d, "ex.yaml", pipeline="deterministic", exchange="exchange",
                         worker_timeout_s=240)
        trainer = ["online", "--config", config, "--role", "trainer"]
        worker = start(["online", "--config", config, "--role", "worker", "--worker", "0"],
                       d, env, "worker.log")
        try:
            kill = interrupt(trainer, cwd=d, env=env, sig=signal.SIGTERM,
                             trigger=_log_says("trainer: 1/4"))
            _stopped(kill, 143)
            cli(trainer, cwd=d, env=env)
        finally:
            finish(worker, d, "worker.log")
        _equal(final_arrays(d / "run"), want)
        cases.append("storage trainer, SIGTERM after a round")
    except AssertionError:
        failures = 1
        raise
    finally:
        record("fault injection", "online: Ctrl-C and SIGTERM in every mode", runs=4,
               failures=failures, detail="deterministic pipeline: SIGTERM during an "
               "in-training evaluation, and Ctrl-C at a random time; free-running pipeline: "
               "SIGTERM after a round; the storage trainer beside a worker: SIGTERM after a "
               "round. Each exits 143/130 with 'stopped by … checkpoint …; run the same "
               "command to resume', and the same command resumes; the deterministic runs "
               "then equal the uninterrupted run bit for bit")


def _after_first_row(delay: float):
    """A trigger: `delay` seconds after the run's first metrics row."""
    seen: dict[str, float] = {}

    def fires(cwd: Path, t: float) -> bool:
        rows = cwd / "run" / "metrics.jsonl"
        if "at" not in seen and rows.exists() and rows.read_text().strip():
            seen["at"] = t
        return "at" in seen and t >= seen["at"] + delay

    from tests.faults.harness import Trigger

    return Trigger(fires, f"{delay:.2f} s after the first row")
