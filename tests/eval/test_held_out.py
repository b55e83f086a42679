"""Held-out means held-out everywhere (issue 55 item 10): `Policy.evaluate`, `train.eval_every`'s
hook and `jaxrl-llm evaluate` grade the `eval:` section's questions (`eval.task_path`), never
the training file of `data.task_path`; unset, `eval.task_path` falls back to `data.task_path`
in all three alike (docs/configuration.md). The hook shows its own progress (item 15)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from jaxrl_llm.api import Policy, load_policy
from jaxrl_llm.config import config_from_dict
from jaxrl_llm.eval.during_training import make_eval_hook
from tests.online.helpers import tiny

# Countdown rows (the task reads a local JSON-lines file): 5 to train on, 3 held out.
TRAIN = [{"nums": [1, 2, 3], "target": 6}, {"nums": [2, 2, 5], "target": 9},
         {"nums": [3, 4, 1], "target": 8}, {"nums": [6, 1, 1], "target": 4},
         {"nums": [9, 3, 2], "target": 1}]
TEST = [{"nums": [7, 5, 2], "target": 14}, {"nums": [8, 4, 3], "target": 5},
        {"nums": [5, 5, 1], "target": 11}]


def _write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Policy:
    tmp = tmp_path_factory.mktemp("held_out")
    tree = tiny(tmp / "run", model={"max_position_embeddings": 512},
                data={"task": "countdown", "task_path": _write(tmp / "train.jsonl", TRAIN)},
                eval={"task_path": _write(tmp / "test.jsonl", TEST), "n": 2,
                      "max_new_tokens": 4, "batch_size": 4, "bootstrap_trials": 2})
    del tree["online"]  # an experiment config (load_policy's), not an online one
    return load_policy(config=tree)


def test_policy_evaluate_grades_the_eval_file_not_the_training_file(policy: Policy) -> None:
    assert len(policy.task.load()) == len(TRAIN)  # rollouts sample the training file
    summary = policy.evaluate()  # eval.num_questions (100) covers either file whole
    assert summary["num_questions"] == len(TEST) and summary["n"] == 2
    assert sum(summary["cardinality"]) == len(TEST)
    assert policy.evaluate(num_questions=2)["num_questions"] == 2


def test_without_eval_task_path_every_evaluation_reads_data_task_path(policy: Policy) -> None:
    # `jaxrl-llm evaluate`'s documented default (eval.task_path: "default: data.task_path")
    tree = policy.config.model_dump(mode="json")
    tree["eval"]["task_path"] = None
    unset = Policy(config_from_dict(tree), policy.state, policy.tokenizer, policy.mesh)
    assert unset.evaluate()["num_questions"] == len(TRAIN)


def test_in_training_evaluation_shows_its_progress_on_the_eval_file(
        policy: Policy, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JAXRL_PROGRESS_INTERVAL_S", "0")  # a line at every count
    hook = make_eval_hook(policy.config, policy.tokenizer, progress=True)
    numbers = hook(7, policy.state)
    assert 0.0 <= numbers["pass_at_1"] <= 1.0
    err = capsys.readouterr().err
    counts = re.findall(r"^evaluate countdown at step 7: (\d+)/(\d+) questions", err, re.M)
    assert counts and counts[0] == ("0", "3") and counts[-1] == ("3", "3"), err
    # and without `progress` (train --no-progress) the hook stays silent
    make_eval_hook(policy.config, policy.tokenizer)(7, policy.state)
    assert "evaluate countdown" not in capsys.readouterr().err
