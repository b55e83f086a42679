"""Issue 42 item 6, papercuts a TRL user met, each run as they ran it (`jaxrl-llm` in a
temporary working directory with relative paths): a key put in the wrong section gets the
right one suggested; a relative `data.task_path` is absolute in the resolved config like every
other path; a checkpointing command prints no Orbax "Type handler registry" warning."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.user.cli import jaxrl


def test_a_key_in_the_wrong_section_gets_the_right_section(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("train: {warmup_steps: 3}\n")
    done = jaxrl(tmp_path, "train", "--config", "c.yaml", "train.learning_rate=1e-5")
    assert done.returncode == 2
    assert ("unknown key 'train.learning_rate' (from override 'train.learning_rate=1e-5'); "
            "did you mean 'optim.learning_rate'?") in done.stderr
    assert ("unknown key 'train.warmup_steps' (from file c.yaml); "
            "did you mean 'optim.warmup_steps'?") in done.stderr


def test_task_paths_are_absolute_in_the_resolved_config(tmp_path: Path) -> None:
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "c.yaml").write_text(
        "data: {task: gsm8k, task_path: my_gsm8k.jsonl}\neval: {task_path: test.jsonl}\n"
        "run_dir: runs/x\n")
    done = jaxrl(tmp_path, "config", "--config", "conf/c.yaml")
    assert done.returncode == 0, done.stderr
    resolved = yaml.safe_load(done.stdout)
    # against the working directory, as run_dir is (docs/tasks.md), not conf/
    assert resolved["run_dir"] == str(tmp_path / "runs" / "x")
    assert resolved["data"]["task_path"] == str(tmp_path / "my_gsm8k.jsonl")
    assert resolved["eval"]["task_path"] == str(tmp_path / "test.jsonl")
    done = jaxrl(tmp_path, "config", "data.task_path=hf://openai/gsm8k:main")
    assert yaml.safe_load(done.stdout)["data"]["task_path"] == "hf://openai/gsm8k:main"


@pytest.mark.slow
def test_checkpointing_commands_print_no_orbax_type_handler_warning(tmp_path: Path) -> None:
    from jaxrl_llm.data.shards import write_records
    from tests.data.helpers import make_records

    records = make_records(8, vocab=50, group_size=2)
    for r in records:
        r.reward, r.correct = 1.0, True
    write_records(tmp_path / "recs", records, scored_by="test")
    (tmp_path / "c.yaml").write_text(
        "run_dir: run\nmesh: {data: 1}\ndata: {records: recs}\n"
        "train: {steps: 2, batch_size: 8, max_seq_len: 32, checkpoint_every: 1}\n")
    trained = jaxrl(tmp_path, "train", "--config", "c.yaml", "--no-progress")
    assert trained.returncode == 0, trained.stderr
    exported = jaxrl(tmp_path, "export", "--checkpoint", "run", "--out", "hf")
    assert exported.returncode == 0, exported.stderr
    for done in (trained, exported):
        # Orbax logged it on every command when our jax.Array handler replaced its default
        assert "Type handler registry" not in done.stderr, done.stderr
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["2"]
