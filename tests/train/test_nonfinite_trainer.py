"""Non-finite values through the public API: NaN injected into a batch through the Trainer's
`on_batch` hook (the loader itself refuses NaN records) is skipped bit-exactly and counted in
the metric rows; `train.max_nonfinite_steps` consecutive skips stop the run; `jaxrl-llm train`
with a diverging learning rate stops with a message naming the step and the quantity."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from jaxrl_llm.train.nonfinite import NonFiniteError
from jaxrl_llm.train.trainer import Trainer
from tests.reliability import record
from tests.train.test_nonfinite import host_bits
from tests.train.test_trainer import records, tiny_config  # noqa: F401 (records: a fixture)

pytestmark = pytest.mark.reliability
SECTION = "non-finite values"


def poison_mu(steps: set[int]):
    """`on_batch` hook: NaN on one completion token of μ at the given loop steps (after the
    trainer's own host check, i.e. as if a bad value appeared inside the step)."""
    def on_batch(step: int, host) -> None:
        if step in steps:
            row = int(np.argmax(host.record_mask))
            host.mu_logprobs[row, int(np.argmax(host.loss_mask[row]))] = np.nan
    return on_batch


def test_trainer_skips_nan_batches_bit_exactly_and_counts_them(tmp_path, records):  # noqa: F811
    snapshots: dict[int, tuple] = {}

    def eval_hook(step, state):
        snapshots[step] = (host_bits(state.params), host_bits(state.opt_state), int(state.step))

    config = tiny_config(tmp_path / "run", records, eval_every=1, max_nonfinite_steps=3)
    trainer = Trainer(config, on_batch=poison_mu({3, 4}), eval_hook=eval_hook,
                      progress=False, tensorboard=False)
    try:
        result = trainer.run()
    finally:
        trainer.close()
    assert result.step == 6 and int(result.state.step) == 4  # 6 batches, 4 updates
    assert snapshots[3] == snapshots[2] and snapshots[4] == snapshots[2]  # bit for bit
    assert snapshots[5][0] != snapshots[4][0] and snapshots[5][1] != snapshots[4][1]
    rows = {r["step"]: r for r in map(json.loads, result.metrics_path.read_text().splitlines())}
    assert sorted(rows) == [2, 4, 6]  # log_every 2
    assert rows[2]["train/nonfinite_skips"] == 0 and rows[2]["update_skipped"] == 0
    assert rows[4]["train/nonfinite_skips"] == 2 and rows[4]["train/consecutive_nonfinite"] == 2
    assert rows[4]["update_skipped"] == 1.0  # both steps of the window
    assert rows[6]["train/nonfinite_skips"] == 2 and rows[6]["train/consecutive_nonfinite"] == 0
    assert "nonfinite_first" not in rows[4]
    record(SECTION, "NaN batches through the Trainer (2 of 6 steps)", runs=6, failures=0,
           detail="steps 3-4 skipped: params and optimizer state bit-identical to step 2; rows "
           "carry train/nonfinite_skips=2, train/consecutive_nonfinite; training continues")


def test_trainer_stops_after_max_consecutive_skips(tmp_path, records):  # noqa: F811
    config = tiny_config(tmp_path / "run", records, max_nonfinite_steps=3)
    trainer = Trainer(config, on_batch=poison_mu({2, 3, 4, 5, 6}), progress=False,
                      tensorboard=False)
    try:
        with pytest.raises(NonFiniteError) as err:
            trainer.run()
    finally:
        trainer.close()
    message = str(err.value)
    assert "3 consecutive steps skipped" in message and "train.max_nonfinite_steps=3" in message
    assert "the first, at step 2, had a non-finite batch field mu_logprobs" in message
    assert message.startswith(("step 4:", "step 5:"))  # 5: metrics read one step late
    record(SECTION, "3 consecutive NaN batches stop the Trainer", runs=1, failures=0,
           detail=message.split(" (loss=")[0])


def jaxrl_llm_command() -> list[str]:
    script = shutil.which("jaxrl-llm", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "jaxrl_llm.cli"]


@pytest.mark.slow
def test_train_command_stops_a_diverging_run_naming_step_and_quantity(tmp_path, records):  # noqa: F811
    """A learning rate of 1e30 overflows the parameters after one update; every later step is
    non-finite, skipped, and the third in a row stops `jaxrl-llm train` (exit 1, no traceback)."""
    shutil.copytree(records, tmp_path / "recs")
    tree = json.loads(tiny_config(tmp_path / "unused", records).model_dump_json())
    tree["run_dir"], tree["data"]["records"] = "run", "recs"  # relative to the cwd
    tree["optim"].update(learning_rate=1e30, name="sgd", clip_norm=None)
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(tree))
    proc = subprocess.run(
        [*jaxrl_llm_command(), "train", "--config", "train.yaml", "--no-progress",
         "train.max_nonfinite_steps=3"],
        cwd=tmp_path, env=dict(os.environ), capture_output=True, text=True, timeout=600,
    )
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = err[-1]
    assert last.startswith("jaxrl-llm train: step "), last
    assert "3 consecutive steps skipped for non-finite values (train.max_nonfinite_steps=3)" in last
    assert "the first, at step 2, had a non-finite " in last, last
    quantity = last.split("had a non-finite ")[1].split(" (loss=")[0]
    assert quantity == "loss" or quantity.startswith("gradient of params["), quantity
    record(SECTION, "`jaxrl-llm train` with a diverging learning rate (1e30)", runs=1,
           failures=0, detail=last.split(" (loss=")[0])
