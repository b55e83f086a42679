"""SIGTERM on one host of a two-process job: both processes leave the loop after the same
step, save that step together, exit 143; resuming ends with the parameters of an
uninterrupted run."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from flax import nnx

from jaxrl_llm.core.signals import EXIT_SIGTERM
from jaxrl_llm.data.records import Record
from jaxrl_llm.data.shards import write_records
from jaxrl_llm.train.checkpoint import CHECKPOINT_DIR, Checkpointer, restore_model

from .helpers import free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORKER = Path(__file__).with_name("sigterm_worker.py")
ROOT = Path(__file__).resolve().parents[2]
STEPS = 40
KILL_AFTER = 3  # SIGTERM process 1 once it has finished this step
DELAY = 0.1  # seconds per step, so the agreed stop step comes before STEPS


def _records(path: Path) -> Path:
    rng = np.random.default_rng(0)
    out = []
    for i in range(32):
        completion = rng.integers(1, 64, size=int(rng.integers(3, 9)))
        out.append(Record(
            prompt_ids=np.array([1, 2 + i]), completion_ids=completion,
            reward=1.0 if i % 3 == 0 else -1.0, correct=i % 3 == 0, group_id=i // 4,
            behavior_logprobs=-rng.random(completion.size).astype(np.float32),
            mu_logprobs=-rng.random(completion.size).astype(np.float32),
        ))
    write_records(path, out, vocab_size=64)
    return path


def _config(tmp: Path, run_dir: Path, records: Path) -> Path:
    tree = {
        "run_dir": str(run_dir), "seed": 3,
        "model": {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                  "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
                  "max_position_embeddings": 64},
        "optim": {"name": "adamw", "learning_rate": 1e-2},
        "loss": {"name": "topr"},
        "mesh": {"data": 2, "fsdp": 1, "tensor": 1},
        "data": {"records": str(records), "shuffle_seed": 5},
        "train": {"steps": STEPS, "batch_size": 8, "max_seq_len": 16, "log_every": 5,
                  "checkpoint_every": 1000},
    }
    path = tmp / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def _launch(config: Path, tmp: Path, tag: str) -> list[tuple[subprocess.Popen, Path]]:
    port = free_port()
    procs = []
    for i in range(2):
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env.update(PYTHONPATH=str(ROOT), JAX_NUM_CPU_DEVICES="1",
                   JAXRL_COORDINATOR=f"127.0.0.1:{port}", JAXRL_NUM_PROCESSES="2",
                   JAXRL_PROCESS_ID=str(i))
        progress = tmp / f"{tag}_progress{i}"
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), str(config), str(progress), str(DELAY)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        procs.append((proc, progress))
    return procs


def _finish(procs: list[tuple[subprocess.Popen, Path]]) -> list[tuple[int, str]]:
    outputs = []
    for proc, _ in procs:
        out = proc.communicate(timeout=600)[0]
        outputs.append((proc.returncode, out))
    return outputs


def _params(run_dir: Path) -> list[np.ndarray]:
    model = restore_model(run_dir).model
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def test_sigterm_on_one_host_stops_both_at_one_step_then_resume_matches(tmp_path):
    records = _records(tmp_path / "records")

    # Uninterrupted reference (same two-process layout: each host reads its own records).
    straight = _finish(_launch(_config(tmp_path, tmp_path / "straight", records), tmp_path, "s"))
    for code, out in straight:
        assert code == 0 and f"trained {STEPS} steps" in out, out[-3000:]

    run_dir = tmp_path / "preempted"
    config = _config(tmp_path, run_dir, records)
    procs = _launch(config, tmp_path, "p")
    proc1, progress1 = procs[1]
    deadline = time.monotonic() + 300
    while not (progress1.exists() and progress1.read_text().strip()
               and int(progress1.read_text()) >= KILL_AFTER):
        assert proc1.poll() is None, proc1.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "process 1 never reached the kill step"
        time.sleep(0.05)
    os.kill(proc1.pid, signal.SIGTERM)  # only process 1 is told
    results = _finish(procs)
    stop_steps = []
    for code, out in results:
        assert code == EXIT_SIGTERM, out[-3000:]
        found = re.search(r"stopped by SIGTERM at step (\d+)", out)
        assert found, out[-3000:]
        stop_steps.append(int(found.group(1)))
    assert stop_steps[0] == stop_steps[1], stop_steps
    stop = stop_steps[0]
    assert KILL_AFTER <= stop < STEPS
    # Both hosts saved that one step together (a committed checkpoint, nothing later).
    ckpt = Checkpointer(run_dir / CHECKPOINT_DIR, async_save=False)
    assert ckpt.all_steps() == [stop]
    assert ckpt.read_meta()["optimizer_step"] == stop
    ckpt.close()

    resumed = _finish(_launch(config, tmp_path, "r"))
    for code, out in resumed:
        assert code == 0 and f"trained {STEPS} steps" in out, out[-3000:]
    for a, b in zip(_params(tmp_path / "straight"), _params(run_dir), strict=True):
        np.testing.assert_array_equal(a, b)
