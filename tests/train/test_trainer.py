"""The trainer: resume after SIGKILL is bit-identical to an uninterrupted run, SIGTERM
checkpoints and stops, metrics rows are written."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxrl_llm.config import config_from_dict
from jaxrl_llm.data.records import Record
from jaxrl_llm.data.shards import write_records
from jaxrl_llm.train import trainer as trainer_module
from jaxrl_llm.train.checkpoint import CHECKPOINT_DIR
from jaxrl_llm.train.trainer import Trainer

N = 3  # steps before the kill; the full run is 2N


def tiny_config(run_dir: Path, records: Path, model: dict | None = None,
                **train: object) -> object:
    return config_from_dict({
        "run_dir": str(run_dir), "seed": 3,
        "model": {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                  "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
                  "max_position_embeddings": 64, **(model or {})},
        "optim": {"name": "adamw", "learning_rate": 1e-2},
        "loss": {"name": "topr"},
        "data": {"records": str(records), "shuffle_seed": 5},
        "train": {"steps": 2 * N, "batch_size": 8, "max_seq_len": 16, "log_every": 2,
                  "checkpoint_every": N, **train},
    })


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> Path:
    """20 distinct records (so a record's tokens identify it), with μ log-probs."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(20):
        completion = rng.integers(1, 64, size=int(rng.integers(3, 9)))
        out.append(Record(
            prompt_ids=np.array([1, 2 + i % 50, 3 + i // 50]), completion_ids=completion,
            reward=1.0 if i % 3 == 0 else -1.0, correct=i % 3 == 0, group_id=i // 4,
            behavior_logprobs=-rng.random(completion.size).astype(np.float32),
            mu_logprobs=-rng.random(completion.size).astype(np.float32),
        ))
    path = tmp_path_factory.mktemp("records") / "recs"
    write_records(path, out, vocab_size=64)
    return path


def fingerprint(batch) -> list[str]:
    """Per-row digest of a batch's tokens (identifies the records it consumed)."""
    rows = []
    for inputs, mask in zip(np.asarray(batch.inputs), np.asarray(batch.record_mask)):
        rows.append(hashlib.sha1(inputs.tobytes()).hexdigest()[:12] if mask else "pad")
    return rows


KILLED_RUN = textwrap.dedent(
    """
    import json, os, signal, sys
    sys.path.insert(0, sys.argv[1])
    from test_trainer import tiny_config, fingerprint
    from pathlib import Path
    from jaxrl_llm.train.trainer import Trainer

    run_dir, records, log = Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
    N = int(sys.argv[5])

    def on_batch(step, batch):
        with log.open("a") as f:
            f.write(json.dumps([step, fingerprint(batch)]) + "\\n")

    def on_step(step, trainer):
        if step == N + 1:  # checkpoint N committed, step N+1 trained but not saved
            trainer.checkpointer.wait()
            os.kill(os.getpid(), signal.SIGKILL)

    Trainer(tiny_config(run_dir, records), on_batch=on_batch, on_step=on_step,
            progress=False, tensorboard=False).run()
    """
)


def params_of(state) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(state.params)]


def test_resume_after_sigkill_is_bit_identical(tmp_path, records):
    straight_batches: list[tuple[int, list[str]]] = []
    straight = Trainer(
        tiny_config(tmp_path / "straight", records), progress=False, tensorboard=False,
        on_batch=lambda step, b: straight_batches.append((step, fingerprint(b))),
    )
    result = straight.run()
    straight.close()
    compiled_steps = len(trainer_module._STEP_CACHE)
    assert result.step == 2 * N and not result.stopped
    assert sorted(int(p.name) for p in (result.checkpoint_dir).iterdir()
                  if p.name.isdigit()) == [2 * N]  # train.keep_checkpoints: 1 by default

    killed_dir, log = tmp_path / "killed", tmp_path / "consumed.jsonl"
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_RUN, str(Path(__file__).parent), str(killed_dir),
         str(records), str(log), str(N)],
        env=dict(os.environ), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    before_kill = [json.loads(line) for line in log.read_text().splitlines()]
    assert [s for s, _ in before_kill] == list(range(1, N + 2))

    resumed_batches: list[tuple[int, list[str]]] = []
    resumed = Trainer(
        tiny_config(killed_dir, records), progress=False, tensorboard=False,
        on_batch=lambda step, b: resumed_batches.append((step, fingerprint(b))),
    )
    again = resumed.run()
    resumed.close()
    assert again.step == 2 * N
    assert len(trainer_module._STEP_CACHE) == compiled_steps  # reused, not recompiled
    # Records: the first N steps of the killed run, then the resumed run's, are the straight
    # run's sequence (step N+1 is consumed again after the restore).
    consumed = [tuple(x) for x in before_kill[:N]] + resumed_batches
    assert [(s, tuple(f)) for s, f in consumed] == [(s, tuple(f)) for s, f in straight_batches]
    for a, b in zip(params_of(result.state), params_of(again.state), strict=True):
        np.testing.assert_array_equal(a, b)
    # The metrics file reads as one run: the killed run logged step 2; the resumed one 4 and 6.
    steps = [json.loads(r)["step"] for r in (killed_dir / "metrics.jsonl").read_text().split("\n")
             if r.strip()]
    assert steps == [2, 4, 6]
    row = json.loads((killed_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert np.isfinite(row["loss"]) and row["throughput/tokens_per_s"] > 0


def test_sigterm_checkpoints_then_stops(tmp_path, records):
    """A real SIGTERM mid-run reaches the trainer's handler (not the one installed before the
    run), stops the loop after that step with a checkpoint of it, and the earlier handler is
    back afterwards."""
    outer_calls: list[int] = []

    def outer(signum, frame):
        outer_calls.append(signum)

    def on_step(step, trainer):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, outer)
    try:
        trainer = Trainer(tiny_config(tmp_path / "run", records, checkpoint_every=100),
                          on_step=on_step, progress=False, tensorboard=False)
        result = trainer.run()
        trainer.close()
        handler_after = signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert outer_calls == []  # the trainer's handler took the signal
    assert handler_after is outer  # and put the earlier handler back
    assert result.stopped and result.step == 2 < 2 * N
    assert trainer.checkpointer.all_steps() == [2]  # checkpoint_every=100: saved on stop
    meta = trainer.checkpointer.read_meta()
    assert meta["step"] == 2 and meta["optimizer_step"] == 2
    assert meta["config"]["train"]["steps"] == 2 * N
    assert (tmp_path / "run" / CHECKPOINT_DIR / "2").is_dir()
    # Without a signal the same run trains every step and is not "stopped".
    again = Trainer(tiny_config(tmp_path / "full", records, checkpoint_every=100),
                    progress=False, tensorboard=False)
    full = again.run()
    again.close()
    assert not full.stopped and full.step == 2 * N


def test_train_command_runs_a_yaml_config(tmp_path, records, capsys):
    import yaml

    from jaxrl_llm.cli import main as cli_main
    from jaxrl_llm.config import dump_config

    config_path = tmp_path / "train.yaml"
    config_path.write_text(dump_config(tiny_config(tmp_path / "run", records)))
    assert cli_main(["train", "--config", str(config_path), "--no-progress",
                     "train.log_every=3"]) == 0
    assert f"trained {2 * N} steps" in capsys.readouterr().out
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["train"]["log_every"] == 3
    steps = [json.loads(r)["step"] for r in (tmp_path / "run" / "metrics.jsonl").read_text()
             .splitlines()]
    assert steps == [3, 6]
    # Run again: the final checkpoint is complete, so nothing is trained twice.
    assert cli_main(["train", "--config", str(config_path), "--no-progress"]) == 0
    assert f"trained {2 * N} steps" in capsys.readouterr().out
