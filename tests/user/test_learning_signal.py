"""Issue 42, item 2: records that give the loss nothing to learn. With no positive record TOPR
only pushes probability down, and a group whose rewards are all equal gives GRPO advantage 0;
`curate` warns with the fractions and `train` refuses (exit 2, naming
`train.allow_no_signal`) unless that key is set. Through the CLI, in a temporary directory;
the counts in the messages are the ones written into the records here."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.data.helpers import make_records
from tests.user.cli import jaxrl

KEY = "train.allow_no_signal"
CONFIG = ("run_dir: run\nmesh: {data: 1}\noptim: {learning_rate: 1.0e-3}\n"
          "train: {steps: 1, batch_size: 8, max_seq_len: 32, log_every: 1}\n"
          "data: {records: recs, curated: cur}\n")


def _write(cwd: Path, correct: list[bool], loss: str = "topr") -> None:
    """16 records in groups of 4, reward ±1 by `correct`, μ present; config for `loss`."""
    from jaxrl_llm.data.shards import write_records

    records = make_records(16, vocab=50, group_size=4)
    for r, ok in zip(records, correct, strict=True):
        r.correct, r.reward = ok, 1.0 if ok else -1.0
    write_records(cwd / "recs", records, scored_by="test")
    (cwd / "c.yaml").write_text(CONFIG + f"loss: {{name: {loss}}}\n")


def _curate(cwd: Path) -> str:
    done = jaxrl(cwd, "curate", "--config", "c.yaml")
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_measure_counts_by_hand() -> None:
    from jaxrl_llm.data.signal import measure

    rewards = np.array([1, -1, -1, -1, -1, -1, -1, -1], float)  # group 0 mixed, group 1 not
    groups = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    correct = rewards > 0
    topr = measure(rewards, correct, groups, rule="baseline", baseline=0.0)
    assert (topr.positives, topr.raised, topr.num_groups, topr.equal_groups) == (1, 1, 2, 1)
    # A baseline below −1 makes every A = R − b positive: every record is raised.
    assert measure(rewards, correct, groups, rule="baseline", baseline=-1.5).raised == 8
    assert measure(rewards, correct, groups, rule="group").raised == 4  # group 0's records
    assert measure(rewards, correct, groups, rule="correct").raised == 1
    flat = measure(-np.ones(8), np.zeros(8, bool), groups, rule="group")
    assert (flat.raised, flat.equal_groups) == (0, 2)


@pytest.mark.slow
def test_no_positives_warned_by_curate_refused_by_train_unless_allowed(tmp_path: Path) -> None:
    _write(tmp_path, [False] * 16)
    said = _curate(tmp_path)
    assert "0 of 16 (0 %) records are positive" in said, said
    assert "4 of 4 (100 %) groups have all-equal rewards" in said
    assert "only pushes probability down" in said and KEY in said

    refused = jaxrl(tmp_path, "train", "--config", "c.yaml", "--no-progress")
    assert refused.returncode == 2, refused.stderr
    assert f"{KEY}=true" in refused.stderr and "0 of 16 (0 %)" in refused.stderr
    assert "generate.n" in refused.stderr  # how to get positives
    assert "Traceback" not in refused.stderr
    assert not (tmp_path / "run").exists()  # nothing trained, nothing written

    allowed = jaxrl(tmp_path, "train", "--config", "c.yaml", "--no-progress", f"{KEY}=true")
    assert allowed.returncode == 0, allowed.stderr
    assert "warning:" in allowed.stderr and "training anyway" in allowed.stderr
    assert (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_a_mixed_dataset_trains_without_a_word(tmp_path: Path) -> None:
    _write(tmp_path, [i % 2 == 0 for i in range(16)])  # every group 2 right, 2 wrong
    assert "warning:" not in _curate(tmp_path)
    done = jaxrl(tmp_path, "train", "--config", "c.yaml", "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "warning:" not in done.stderr and KEY not in done.stderr


@pytest.mark.slow
def test_group_loss_refused_when_every_group_is_uniform(tmp_path: Path) -> None:
    """Groups 0 and 2 all right, 1 and 3 all wrong: half the records are positive, but every
    GRPO advantage is 0. TOPR on the same records learns (it is warned, not refused)."""
    _write(tmp_path, [(i // 4) % 2 == 0 for i in range(16)], loss="grpo")
    said = _curate(tmp_path)
    assert "8 of 16 (50 %) records are positive" in said
    assert "4 of 4 (100 %) groups have all-equal rewards" in said and "advantage 0" in said
    refused = jaxrl(tmp_path, "train", "--config", "c.yaml", "--no-progress")
    assert refused.returncode == 2 and f"{KEY}=true" in refused.stderr, refused.stderr
    assert "learns from 0 records in 0 groups" in refused.stderr
    topr = jaxrl(tmp_path, "train", "--config", "c.yaml", "--no-progress", "loss.name=topr")
    assert topr.returncode == 0, topr.stderr
    assert "warning:" in topr.stderr and "raises only records with R − loss.baseline > 0" \
        in topr.stderr and ": 8 here" in topr.stderr


def test_curate_again_is_refused_before_work_and_overwrite_replaces(tmp_path: Path) -> None:
    # Found on the issue-42 journey: a second `curate` curated, then died with a traceback on
    # the first run's output. It is refused up front, naming the directory and the fix.
    _write(tmp_path, [True, False, False, False] * 4)
    _curate(tmp_path)
    again = jaxrl(tmp_path, "curate", "--config", "c.yaml")
    assert again.returncode == 2, again.stderr
    assert "cur already holds curated records" in again.stderr and "--overwrite" in again.stderr
    assert "Traceback" not in again.stderr
    done = jaxrl(tmp_path, "curate", "--config", "c.yaml", "--overwrite")
    assert done.returncode == 0, done.stderr
