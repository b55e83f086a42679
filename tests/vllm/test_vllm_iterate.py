"""`iterate` with vLLM as the sampler, μ_i = π_{i−1}, in the two set-ups of
docs/integrations.md: the vLLM host as iterate's child process (`iterate.vllm_host: local`)
and as a separate process sharing only the run directory (`external`), each side killed at
several points and restarted with the same command.

Independent checks: the trainer's own log-probs (the score stage) of every iteration's vLLM
records agree with vLLM's to float32 precision, so iteration 2 was sampled from π_1's weights,
reloaded in place (π_1 differs from π_0 by more than that); the run killed four times ends
with the same records, weights and evaluation as the uninterrupted one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.xla_flags import ONE_DEVICE

pytestmark = [pytest.mark.slow]

ITERATE_YAML = """\
name: vllm_iterate
seed: 0
run_dir: runs/it
model: {{source: hf, path: {model}}}
loss: {{name: topr}}
optim: {{name: adamw, learning_rate: 0.003}}
train: {{steps: 3, batch_size: 8, max_seq_len: 64, log_every: 1, checkpoint_every: 1}}
generate: {{backend: vllm, n: 4, temperature: 1.0, max_new_tokens: 16, batch_size: 8,
           chunk_prompts: 4}}
data: {{task: arithmetic, num_prompts: 8}}
eval: {{n: 2, num_questions: 8, batch_size: 8, maj_k: [1, 2], bootstrap_trials: 4}}
iterate: {{iterations: 2, vllm_host: {host}}}
"""


def env() -> dict[str, str]:
    e = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    e["XLA_FLAGS"] = ONE_DEVICE
    return e


def command(*args: str) -> list[str]:
    return [str(Path(sys.executable).with_name("jaxrl-llm")), *args]


def run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(command(*args), cwd=cwd, env=env(), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"{args} exit {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def start(cwd: Path, name: str, *args: str) -> subprocess.Popen:
    log = open(cwd / f"{name}.log", "ab")
    return subprocess.Popen(command(*args), cwd=cwd, env=env(), stdout=log,
                            stderr=subprocess.STDOUT)


def kill_when(proc: subprocess.Popen, ready: Callable[[], bool], what: str,
              timeout: float = 600) -> None:
    """SIGKILL `proc` as soon as `ready()` holds (polled); the event must happen while it runs."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} in {timeout} s"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(60) == -signal.SIGKILL, f"{what}: the process had already exited"


def finish(*procs: subprocess.Popen) -> None:
    for proc in procs:
        assert proc.wait(900) == 0, f"{proc.args} exited {proc.returncode}"


def stages(run_dir: Path, i: int) -> dict:
    path = run_dir / f"iter_{i}" / "stages.json"
    return json.loads(path.read_text()) if path.exists() else {}


def records(directory: Path) -> list:
    from jaxrl_llm.data.shards import RecordSource

    return list(RecordSource(str(directory)))


def weights(directory: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(directory / "model.safetensors"))


def test_one_host_engine_reloaded_in_place(tmp_path, tiny_hf) -> None:
    (tmp_path / "it.yaml").write_text(ITERATE_YAML.format(model=tiny_hf, host="local"))
    run(tmp_path, "iterate", "--config", "it.yaml")
    run_dir = tmp_path / "runs" / "it"
    host_log = (run_dir / "vllm_host.log").read_text()
    assert host_log.count("engine started") == 1 and host_log.count("reloaded weights in place") == 1
    for i in (1, 2):
        s = stages(run_dir, i)
        assert s["generate"]["backend"] == "vllm"
        assert s["score"]["mismatch/mean_abs_logprob_diff"] < 1e-5, (i, s["score"])
        assert s["score"]["mismatch/max_abs_seq_logprob_diff"] < 1e-4, (i, s["score"])
    # π_1 is not π_0: a reload that kept π_0's weights could not have passed the check above.
    before, after = weights(tiny_hf), weights(run_dir / "iter_1" / "export")
    assert max(np.abs(before[k] - after[k]).max() for k in before) > 1e-3


def test_two_hosts_killed_at_several_points_end_as_one_uninterrupted_run(tmp_path, tiny_hf) -> None:
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    for cwd in (ref, cut):
        cwd.mkdir()
        (cwd / "it.yaml").write_text(ITERATE_YAML.format(model=tiny_hf, host="external"))
    host_args = ("vllm", "host", "--config", "it.yaml", "--poll-seconds", "0.2")
    trainer_args = ("iterate", "--config", "it.yaml", "--no-progress")

    finish(start(ref, "host", *host_args), start(ref, "trainer", *trainer_args))

    run_dir = cut / "runs" / "it"
    records_1 = run_dir / "iter_1" / "records"
    trainer = start(cut, "trainer", *trainer_args)
    host = start(cut, "host", *host_args)
    # 1. the host, mid-iteration: one of iteration 1's two chunks written
    kill_when(host, lambda: (records_1 / "progress.json").exists(), "the first chunk")
    host = start(cut, "host", *host_args)
    # 2. the trainer, mid-training: a checkpoint of iteration 1 on disk
    kill_when(trainer, lambda: any((run_dir / "iter_1" / "train" / "checkpoints").glob("[0-9]*")),
              "iteration 1's first checkpoint")
    # 3. the host again, waiting for π_1's export (iteration 1's records complete)
    kill_when(host, lambda: (records_1 / "manifest.json").exists(), "iteration 1's records")
    host = start(cut, "host", *host_args)
    trainer = start(cut, "trainer", *trainer_args)
    # 4. the trainer again, waiting for iteration 2's records (π_1 exported)
    kill_when(trainer, lambda: "export" in stages(run_dir, 1), "π_1's export")
    trainer = start(cut, "trainer", *trainer_args)
    finish(host, trainer)

    assert "resuming after 1 of 2 complete chunks" in (cut / "host.log").read_text()
    for i in (1, 2):
        a, b = records(ref / "runs" / "it" / f"iter_{i}" / "records"), records(run_dir / f"iter_{i}" / "records")
        assert len(a) == len(b) == 32
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x.completion_ids, y.completion_ids)
            np.testing.assert_array_equal(x.behavior_logprobs, y.behavior_logprobs)
    wa, wb = weights(ref / "runs" / "it" / "iter_2" / "export"), weights(run_dir / "iter_2" / "export")
    assert wa.keys() == wb.keys() and all(np.array_equal(wa[k], wb[k]) for k in wa)
    ea, eb = (json.loads((d / "iter_2" / "eval" / "eval.json").read_text())
              for d in (ref / "runs" / "it", run_dir))
    assert ea["pass_at_1"] == eb["pass_at_1"] and ea["cardinality"] == eb["cardinality"]
