"""Exact resume of `jaxrl-llm online` (the serial loop, and the pipeline with its sampler
thread ahead): SIGKILL mid-run, then the same command, ends in the same state as an
uninterrupted run — params, optimizer state, step and RNG bit for bit, and the same metric rows — with a non-empty staleness queue in the checkpoint it resumed from."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest

from jaxrl_llm.online.queue import StalenessQueue
from tests.faults.harness import base_env, cli, interrupt, when
from tests.online.helpers import final_arrays, metric_rows, saved_queue, tiny, write_yaml
from tests.reliability import record

# Slow (two kill-and-resume runs, ~1 min): CI runs it in its reliability step.
pytestmark = [pytest.mark.reliability, pytest.mark.slow]

TIMING = ("time", "seconds_sampling", "seconds_scoring", "seconds_training")


def _setup(directory: Path, **online: object) -> list[str]:
    directory.mkdir()
    tree = tiny(Path("run"), online={"rounds": 4, "staleness": 2, "checkpoint_every": 1,
                                     "mu_source": "trainer", **online},
                loss={"name": "topr"}, train={"keep_checkpoints": 100})
    write_yaml(directory / "online.yaml", tree)
    return ["online", "--config", "online.yaml", "--no-progress"]


def _committed(step: int):
    def check(cwd: Path) -> bool:
        return (cwd / "run" / "checkpoints" / str(step) / "_CHECKPOINT_METADATA").is_file()
    return check


def _comparable(rows: list[dict]) -> list[dict]:
    """Rows without timing (the pipeline's: its seconds and sync counts; lags and versions kept)."""
    return [{k: v for k, v in r.items() if k not in TIMING and (
        not k.startswith("pipeline/") or k.startswith("pipeline/lag") or k == "pipeline/version")}
        for r in rows]


@pytest.mark.parametrize("point", [2, 4])
def test_sigkill_then_same_command_gives_the_uninterrupted_state(tmp_path: Path, point: int) -> None:
    env = base_env(tmp_path / "jax-cache")
    args = _setup(tmp_path / "whole")
    cli(args, cwd=tmp_path / "whole", env=env)
    _setup(tmp_path / "killed")
    kill = interrupt(args, cwd=tmp_path / "killed", env=env, sig=signal.SIGKILL,
                     trigger=when(_committed(point), f"round {point}'s checkpoint committed"))
    failures = 0
    try:
        assert kill.landed and kill.returncode == -signal.SIGKILL, kill.describe()
        meta = tmp_path / "killed/run/checkpoints" / str(point) / "meta" / "metadata"
        assert "queue" not in json.loads(meta.read_text())["online"]  # its own item
        # the checkpoint resumed from holds the two batches waiting in the queue, whole
        queue = StalenessQueue.from_bytes(2, saved_queue(tmp_path / "killed/run", point),
                                          where="queue").batches()
        assert len(queue) == 2 and all(len(batch) == 8 for batch in queue)
        assert all(r.task == "arithmetic" and r.prompt_text and r.metadata.get("problem_id")
                   for batch in queue for r in batch)
        cli(args, cwd=tmp_path / "killed", env=env)
        step_a, whole = final_arrays(tmp_path / "whole" / "run")
        step_b, resumed = final_arrays(tmp_path / "killed" / "run")
        assert step_a == step_b == 6  # 4 training rounds + 2 that filled the queue
        assert whole.keys() == resumed.keys()
        differ = [k for k in whole if not np.array_equal(whole[k], resumed[k])]
        assert not differ, differ
        _, first = final_arrays(tmp_path / "whole" / "run", step=1)  # no update yet
        assert any(not np.array_equal(first[k], whole[k]) for k in whole if "params" in k)
        assert _comparable(metric_rows(tmp_path / "whole/run")) == \
            _comparable(metric_rows(tmp_path / "killed/run"))
    except AssertionError:
        failures = 1
        raise
    finally:
        record("fault injection", f"online: SIGKILL after round {point}'s checkpoint, then the "
               "same command", runs=1, failures=failures,
               detail="final params, optimizer state, step, RNG bitwise equal to an "
               "uninterrupted run; metric rows equal; staleness 2 (queue of 2 batches saved)")


@pytest.mark.parametrize("point", [1, 3])
def test_sigkill_of_the_pipeline_then_same_command_gives_the_uninterrupted_state(
        tmp_path: Path, point: int) -> None:
    # online.pipeline: deterministic on 1 sampler + 1 trainer device: the kill lands while
    # the sampler thread has sampled rounds the trainer has not trained on (lost, resampled)
    env = base_env(tmp_path / "jax-cache")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    pipe = {"pipeline": "deterministic", "sampler_devices": 1}
    args = _setup(tmp_path / "whole", **pipe)
    cli(args, cwd=tmp_path / "whole", env=env)
    _setup(tmp_path / "killed", **pipe)
    kill = interrupt(args, cwd=tmp_path / "killed", env=env, sig=signal.SIGKILL,
                     trigger=when(_committed(point), f"round {point}'s checkpoint committed"))
    failures = 0
    try:
        assert kill.landed and kill.returncode == -signal.SIGKILL, kill.describe()
        cli(args, cwd=tmp_path / "killed", env=env)
        step_a, whole = final_arrays(tmp_path / "whole" / "run")
        step_b, resumed = final_arrays(tmp_path / "killed" / "run")
        assert step_a == step_b == 6 and whole.keys() == resumed.keys()
        assert not [k for k in whole if not np.array_equal(whole[k], resumed[k])]
        rows = metric_rows(tmp_path / "whole/run")
        assert [r.get("pipeline/lag_max") for r in rows] == [None, None, 0.0, 1.0, 2.0, 2.0]
        assert _comparable(rows) == _comparable(metric_rows(tmp_path / "killed/run"))
    except AssertionError:
        failures = 1
        raise
    finally:
        record("fault injection", f"online pipeline: SIGKILL after round {point}'s "
               "checkpoint (sampler thread ahead), then the same command", runs=1,
               failures=failures, detail="final params, optimizer state, step, RNG bitwise "
               "equal to an uninterrupted pipeline run; metric rows (lag, versions) equal; "
               "staleness 2, 1 sampler + 1 trainer device")
