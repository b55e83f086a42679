"""`jaxrl-llm online` as a user runs it (a subprocess in a temp cwd): `train.eval_every` and the
`eval:` section evaluate before, during (counted in updates) and after the run, one metrics
row per evaluation, equal to `jaxrl-llm evaluate` of the same checkpoint; the log shows each
round once; Ctrl-C stops after a round, names the checkpoint it kept, and the same command
resumes to the uninterrupted run's state."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import numpy as np
import pytest

from tests.faults.harness import base_env, cli, interrupt, when
from tests.online.helpers import final_arrays, metric_rows, tiny, write_yaml

TIMING = ("time", "seconds_sampling", "seconds_scoring", "seconds_training")
EVAL = {"n": 4, "num_questions": 6, "temperature": 1.0, "max_new_tokens": 8, "batch_size": 6,
        "split": "test"}


@pytest.mark.slow  # a CLI run with three evaluations (~25 s): the default suite's budget
def test_online_evaluates_before_during_and_after_one_row_each(tmp_path: Path) -> None:
    env = {**base_env(tmp_path / "jax-cache"), "JAXRL_PROGRESS_INTERVAL_S": "0"}
    write_yaml(tmp_path / "online.yaml", tiny("run", train={"eval_every": 2}, eval=EVAL))
    _, output = cli(["online", "--config", "online.yaml"], cwd=tmp_path, env=env)
    rows = metric_rows(tmp_path / "run")
    # 3 rounds of one update each; evaluations at update 0 (before), 2, and 3 (the last)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [("eval/pass_at_1" in r) for r in rows] == [True, False, True, True]
    assert all("eval/pass_at_1_se" in r for r in rows if "eval/pass_at_1" in r)
    assert "loss" not in rows[0] and rows[3]["updates"] == 3
    # The log shows each round once (a line per update of the bar, none for its postfix).
    for k in (1, 2, 3):
        assert len(re.findall(rf"online: {k}/3 rounds", output)) == 1, output
    # The last evaluation is `jaxrl-llm evaluate` of the final checkpoint (same seed, questions).
    cli(["evaluate", "--config", "online.yaml", "--model", "run", "--out", "ev"], cwd=tmp_path,
        env=env)
    summary = json.loads((tmp_path / "ev/eval.json").read_text())
    assert rows[3]["eval/pass_at_1"] == pytest.approx(summary["pass_at_1"]["mean"])
    assert rows[3]["eval/pass_at_1_se"] == pytest.approx(summary["pass_at_1"]["se"])
    assert rows[3]["eval/invalid"] == pytest.approx(summary["proportions"]["invalid"])


@pytest.mark.slow  # a free-running CLI run with three evaluations (~30 s)
def test_free_running_online_evaluates_on_the_trainer_s_clock(tmp_path: Path) -> None:
    """`online.pipeline: free` evaluates as the other modes do (issue 55 item 11): a row at
    step 0, then when the updates reach a multiple of train.eval_every, and after the last;
    the last equals `jaxrl-llm evaluate` of the final checkpoint."""
    env = {**base_env(tmp_path / "jax-cache"), "JAXRL_PROGRESS_INTERVAL_S": "0",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    write_yaml(tmp_path / "online.yaml", tiny("run", train={"eval_every": 2}, eval=EVAL,
                                              online={"pipeline": "free", "max_staleness": 2,
                                                      "sampler_devices": 1}))
    cli(["online", "--config", "online.yaml"], cwd=tmp_path, env=env)
    rows = metric_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [("eval/pass_at_1" in r) for r in rows] == [True, False, True, True]
    assert "loss" not in rows[0] and [r["updates"] for r in rows[1:]] == [1, 2, 3]
    cli(["evaluate", "--config", "online.yaml", "--model", "run", "--out", "ev"], cwd=tmp_path,
        env={**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"})
    summary = json.loads((tmp_path / "ev/eval.json").read_text())
    assert rows[3]["eval/pass_at_1"] == pytest.approx(summary["pass_at_1"]["mean"])


def _logged(round_: int):
    def check(cwd: Path) -> bool:
        path = cwd / "run" / "metrics.jsonl"
        return path.is_file() and len(path.read_text().splitlines()) >= round_
    return check


@pytest.mark.slow
def test_ctrl_c_on_online_names_its_checkpoint_and_the_same_command_resumes(tmp_path: Path) -> None:
    env = base_env(tmp_path / "jax-cache")
    tree = tiny("run", online={"rounds": 6, "staleness": 1, "checkpoint_every": 3})
    args = ["online", "--config", "online.yaml", "--no-progress"]
    for name in ("whole", "stopped"):
        (tmp_path / name).mkdir()
        write_yaml(tmp_path / name / "online.yaml", tree)
    cli(args, cwd=tmp_path / "whole", env=env)
    # Ctrl-C once round 1 is logged (checkpoint_every 3: none is due before round 3).
    stop = interrupt(args, cwd=tmp_path / "stopped", env=env, sig=signal.SIGINT,
                     trigger=when(_logged(1), "round 1 logged"))
    assert stop.landed and stop.returncode == 130, stop.describe() + stop.output
    said = re.search(r"stopped by Ctrl-C \(SIGINT\) after round (\d+) \((\d+) updates\); "
                     r"checkpoint (\S+); run the same command to resume", stop.output)
    assert said, stop.output
    at = int(said.group(1))
    assert 1 <= at < 7 and Path(said.group(3)) == tmp_path / "stopped/run/checkpoints" / str(at)
    assert (Path(said.group(3)) / "_CHECKPOINT_METADATA").is_file()  # kept, off-schedule
    assert "Traceback" not in stop.output
    cli(args, cwd=tmp_path / "stopped", env=env)
    step_a, whole = final_arrays(tmp_path / "whole/run")
    step_b, resumed = final_arrays(tmp_path / "stopped/run")
    assert step_a == step_b == 7  # 6 training rounds + 1 that filled the queue
    assert [k for k in whole if not np.array_equal(whole[k], resumed[k])] == []

    def comparable(rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]

    assert comparable(metric_rows(tmp_path / "whole/run")) == \
        comparable(metric_rows(tmp_path / "stopped/run"))
