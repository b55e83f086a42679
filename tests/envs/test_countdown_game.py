"""countdown_game: the verifier's reason comes back for another try, and the reward is the
Countdown task's own score of the last try."""

from __future__ import annotations

from jaxrl_llm.envs.countdown_game import CountdownGame
from jaxrl_llm.envs.episodes import EpisodeRunner
from jaxrl_llm.envs.render import TurnRenderer
from jaxrl_llm.tasks.base import Problem
from jaxrl_llm.tasks.countdown import CountdownTask
from tests.envs.helpers import smollm2_tokenizer

# 3 * 5 + 8 = 23 uses each of 3, 5, 8 once: the only kind of answer that ends the game.
PUZZLE = Problem(id="cd-0", question="Using the numbers [3, 5, 8], create an equation that "
                 "equals 23.", answer="23", metadata={"numbers": [3, 5, 8], "target": 23})


def _runner(max_turns: int = 4) -> EpisodeRunner:
    env = CountdownGame(task=CountdownTask(), max_turns=max_turns)
    renderer = TurnRenderer(smollm2_tokenizer(), chat_template=True, tools=env.tools())
    return EpisodeRunner(env, renderer, max_turns=max_turns, max_episode_tokens=2048,
                         timeout_s=30, workers=2)


def _turn(runner: EpisodeRunner, episode, text: str) -> str | None:
    tok = runner.renderer.tokenizer
    ids = list(tok.encode(text, add_special_tokens=False)) + [runner.renderer.end_of_turn_id]
    obs = runner.submit(episode, ids, [-0.3] * len(ids), True).result(timeout=60)
    return None if obs is None else tok.decode(obs)


def test_feedback_then_a_solution():
    runner = _runner()
    episode = runner.begin(PUZZLE)
    prompt = runner.renderer.tokenizer.decode(episode.prompt_ids)
    assert "Using the numbers [3, 5, 8], create an equation that equals 23" in prompt
    assert "up to 4 tries" in prompt
    assert "not every number is used" in _turn(runner, episode, "<answer> 3 * 8 </answer>")
    assert "evaluates to 16, not 23" in _turn(runner, episode, "<answer> 3 + 5 + 8 </answer>")
    assert "no <answer>" in _turn(runner, episode, "I give up")
    assert _turn(runner, episode, "<think>3 * 5 = 15</think> <answer> 3 * 5 + 8 </answer>") is None
    rec = runner.finish(episode)
    # Countdown's reward (tasks/countdown.py): format +1, valid equation +1.
    assert rec.reward == 2.0 and rec.correct
    meta = rec.metadata["episode"]
    assert meta["num_turns"] == 4 and meta["truncated"] is None
    assert [t["info"].get("reason") for t in meta["turns"] if t["kind"] == "env"] == [
        "not every number is used", "evaluates to 16, not 23", "no <answer> ... </answer> block",
        None]


def test_out_of_tries_is_the_task_reward_of_the_last_try():
    runner = _runner(max_turns=2)
    episode = runner.begin(PUZZLE)
    _turn(runner, episode, "<answer> 3 * 8 </answer>")
    assert _turn(runner, episode, "<answer> 8 * 3 - 5 + 5 </answer>") is None
    rec = runner.finish(episode)
    assert rec.metadata["episode"]["truncated"] == "max_turns"
    assert rec.reward == 0.0 and not rec.correct  # format +1, validity -1
