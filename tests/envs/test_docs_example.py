"""docs/environments.md's example environments, imported by path as a user would name them
(`env.name: my_envs:Retry`) and run through EpisodeRunner: the doc cannot drift from the code."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from jaxrl_llm.envs import get_environment
from jaxrl_llm.envs.episodes import EpisodeRunner
from jaxrl_llm.envs.render import TurnRenderer
from jaxrl_llm.tasks.arithmetic import ArithmeticTask
from tests.envs.helpers import smollm2_tokenizer

DOC = Path(__file__).resolve().parents[2] / "docs" / "environments.md"


@pytest.fixture()
def my_envs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    blocks = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), re.S | re.M)
    [example] = [b for b in blocks if b.startswith("# my_envs.py")]
    (tmp_path / "my_envs.py").write_text(example)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_envs"
    sys.modules.pop("my_envs", None)


def _play(env, problem, turns: list[str]):
    renderer = TurnRenderer(smollm2_tokenizer(), chat_template=True, tools=env.tools())
    runner = EpisodeRunner(env, renderer, max_turns=env.max_turns, max_episode_tokens=2048,
                           timeout_s=30, workers=2)
    episode = runner.begin(problem)
    for text in turns:
        ids = renderer.tokenizer.encode(text, add_special_tokens=False) + [renderer.end_of_turn_id]
        if runner.submit(episode, ids, [-0.5] * len(ids), True).result(timeout=60) is None:
            break
    return runner, episode, runner.finish(episode)


def test_retry_example(my_envs: str):
    task = ArithmeticTask()
    problem = task.load(num=1)[0]
    env = get_environment(f"{my_envs}:Retry", task=task)
    runner, episode, rec = _play(env, problem, ["The answer is 1000001.", "Hmm.",
                                                f"The answer is {problem.answer}."])
    text = runner.renderer.tokenizer.decode(episode.completion_ids)
    assert "Not quite: 1000001 is not right. Try again." in text
    assert "Not quite: no answer found. Try again." in text
    assert rec.reward == 1.0 and rec.metadata["episode"]["turn_rewards"] == [-0.1, -0.1, None]
    assert rec.metadata["episode"]["truncated"] is None


def test_shop_example(my_envs: str):
    env = get_environment(f"{my_envs}:Shop", task=ArithmeticTask())
    assert [t.name for t in env.tools()] == ["unit_price"]
    call = json.dumps({"name": "unit_price", "arguments": {"total": 7.5, "count": 3}})
    problem = ArithmeticTask().load(num=1)[0]
    runner, episode, rec = _play(env, problem, [f"<tool_call>\n{call}\n</tool_call>",
                                                f"The answer is {problem.answer}."])
    assert "<tool_response>\n2.5\n</tool_response>" in runner.renderer.tokenizer.decode(
        episode.completion_ids)
    assert rec.reward == 1.0 and rec.metadata["episode"]["tool_calls"] == 1
