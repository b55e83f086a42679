"""`data.task: package.module:factory`: a task defined in a temporary module (on sys.path)
drives `jaxrl-llm generate` and `evaluate` end to end; its rewards are recomputed here from
the completions by the rule the module states; a path that does not resolve is a clear error."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml

from jaxrl_llm.cli import main as cli_main
from jaxrl_llm.config import ConfigError, config_from_dict
from jaxrl_llm.data.shards import read_manifest, read_records
from jaxrl_llm.tasks import task_from_config

# The documented protocol (docs/custom_tasks.md): a `Task` subclass with load, prompt, score.
MODULE = textwrap.dedent('''
    from jaxrl_llm.tasks import Problem, RewardResult, Task
    from jaxrl_llm.tasks.base import binary_reward


    class VowelTask(Task):
        name = "vowel_start"
        reward_fn = "correct: the completion's first non-space character is a vowel"

        def __init__(self, *, reward_scheme="pm1", prefix="Word"):
            super().__init__(reward_scheme=reward_scheme)
            self.prefix = prefix

        def load(self, *, split="train", num=None, seed=0):
            return [Problem(id=f"v-{split}-{i}", question=f"{self.prefix} {i}", answer="vowel")
                    for i in range(num or 4)]

        def prompt(self, problem):
            return f"Q: {problem.question}\\nA:"

        def score(self, problem, completion):
            text = completion.strip()
            if not text:  # nothing to judge: invalid
                return RewardResult(binary_reward(False, self.reward_scheme), False, True, None)
            ok = text[0].lower() in "aeiou"
            return RewardResult(binary_reward(ok, self.reward_scheme), ok, False, text[0])


    def make_task(**kwargs):
        return VowelTask(**kwargs)


    def not_a_task(**kwargs):
        return object()
''')


def _expected(completion: str) -> tuple[bool, bool]:
    """(correct, invalid) by the module's stated rule, recomputed independently."""
    text = completion.strip()
    return (bool(text) and text[0].lower() in "aeiou", not text)


@pytest.fixture
def custom_module(tmp_path, monkeypatch) -> str:
    pkg = tmp_path / "site" / "my_tasks"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "vowels.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return "my_tasks.vowels:make_task"


def test_import_path_builds_the_task_with_options(custom_module):
    config = config_from_dict({"data": {"task": custom_module, "reward_scheme": "01",
                                        "task_options": {"prefix": "Term"}}})
    task = task_from_config(config)
    assert task.name == "vowel_start" and task.reward_scheme == "01"
    problem = task.load(num=2)[1]
    assert task.prompt(problem) == "Q: Term 1\nA:"
    assert task.score(problem, " apple").reward == 1.0
    assert task.score(problem, " pear").reward == 0.0 and task.score(problem, "  ").invalid
    # The class itself works as the factory too.
    cls_path = custom_module.replace("make_task", "VowelTask")
    assert type(task_from_config(config_from_dict({"data": {"task": cls_path}}))).__name__ \
        == "VowelTask"


@pytest.mark.parametrize("path, named", [
    ("my_tasks.nowhere:make_task", "cannot import module 'my_tasks.nowhere'"),
    ("my_tasks.vowels:missing", "has no attribute 'missing'"),
    ("my_tasks.vowels:not_a_task", "lacks ['load', 'prompt', 'score'"),
    ("my_tasks.vowels", "is not of the form 'package.module:factory'"),
])
def test_unresolvable_import_path_is_a_config_error(custom_module, path, named):
    config = config_from_dict({"data": {"task": path}})
    with pytest.raises(ConfigError, match=f"data.task={path!r}") as err:
        task_from_config(config)
    assert named in str(err.value)


def test_generate_and_evaluate_with_a_custom_task(custom_module, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    Path("exp.yaml").write_text(yaml.safe_dump({
        "run_dir": "run", "seed": 0,
        "model": {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
                  "num_layers": 1, "num_heads": 2, "num_kv_heads": 1},
        "data": {"task": custom_module, "num_prompts": 4},
        "generate": {"n": 4, "max_new_tokens": 3, "batch_size": 16, "temperature": 1.0,
                     "output": "recs"},
        "eval": {"n": 4, "num_questions": 4, "maj_k": [1], "bootstrap_trials": 4},
    }))
    assert cli_main(["generate", "--config", "exp.yaml"]) == 0
    records = read_records("recs")
    assert len(records) == 16 and read_manifest("recs").task == "vowel_start"
    for r in records:
        correct, invalid = _expected(r.completion_text)
        assert (r.correct, r.invalid) == (correct, invalid), r.completion_text
        assert r.reward == (1.0 if correct else -1.0)
        assert r.prompt_text.startswith("Q: Word ")
    assert cli_main(["evaluate", "--config", "exp.yaml"]) == 0
    summary = json.loads((tmp_path / "run" / "eval" / "eval.json").read_text())
    samples = [json.loads(x) for x in
               (tmp_path / "run" / "eval" / "samples.jsonl").read_text().splitlines()]
    recomputed = [_expected(c)[0] for s in samples for c in s["completions"]]
    assert len(recomputed) == 16
    assert summary["pass_at_1"]["mean"] == pytest.approx(np.mean(recomputed))
    assert cli_main(["generate", "--config", "exp.yaml", "--out", "recs2",
                     "data.task=my_tasks.nowhere:make_task"]) == 2
    assert "cannot import module 'my_tasks.nowhere'" in capsys.readouterr().err
