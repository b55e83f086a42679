"""EpisodeRunner: token bookkeeping, the reward from `score` alone, and every way an
environment can fail ending as a truncated episode, never a crash."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jaxrl_llm.envs.base import EnvResponse
from jaxrl_llm.envs.episodes import EpisodeRunner
from jaxrl_llm.envs.render import TurnRenderer
from jaxrl_llm.tasks.base import RewardResult
from tests.envs.helpers import Gate, Scripted, problem, qwen_tokenizer
from tests.reliability import record

SECTION = "environment failures"
FEEDBACK = EnvResponse([{"role": "user", "content": "Not yet, try again."}], done=False,
                       reward=5.0, info={"note": "feedback"})
DONE = EnvResponse([], done=True)


def runner_for(env, *, tokens: int = 512, timeout_s: float = 30.0, workers: int = 4, **kw):
    renderer = TurnRenderer(qwen_tokenizer(), chat_template=True, tools=env.tools())
    return EpisodeRunner(env, renderer, max_turns=env.max_turns, max_episode_tokens=tokens,
                         timeout_s=timeout_s, workers=workers, **kw)


def model_ids(runner, text: str, *, end: bool = True) -> list[int]:
    ids = list(runner.renderer.tokenizer.encode(text, add_special_tokens=False))
    return ids + [runner.renderer.end_of_turn_id] if end else ids


def play(runner, texts: list[str], pid: int = 0):
    """Run model turns until the runner says the episode is over; the episode."""
    episode = runner.begin(problem(pid))
    for text in texts:
        ids = model_ids(runner, text)
        obs = runner.submit(episode, ids, [-0.25] * len(ids), True).result(timeout=60)
        if obs is None:
            break
    return episode


def test_tokens_mask_logprobs_spans_and_record():
    env = Scripted([FEEDBACK, DONE])
    runner = runner_for(env)
    episode = runner.begin(problem())
    m1 = model_ids(runner, "I think it is 41.")
    obs = runner.submit(episode, m1, [-0.5] * len(m1), True).result(timeout=60)
    expected_obs = runner.renderer.observation_ids(FEEDBACK.messages)
    assert obs == expected_obs
    m2 = model_ids(runner, "It is 42.")
    assert runner.submit(episode, m2, [-0.125] * len(m2), True).result(timeout=60) is None
    assert episode.done and episode.truncated is None
    assert episode.completion_ids == m1 + obs + m2
    assert episode.action_mask == [1] * len(m1) + [0] * len(obs) + [1] * len(m2)
    assert episode.behavior_logprobs == [-0.5] * len(m1) + [0.0] * len(obs) + [-0.125] * len(m2)
    a, b = len(m1), len(m1) + len(obs)
    assert [(t["kind"], t["start"], t["end"]) for t in episode.turns] == [
        ("model", 0, a), ("env", a, b), ("model", b, b + len(m2)), ("env", b + len(m2), b + len(m2))]
    rec = runner.finish(episode, group_id=3)
    assert rec.reward == 1.0 and rec.correct and rec.group_id == 3  # score: "42" in the last turn
    np.testing.assert_array_equal(rec.action_mask, episode.action_mask)
    np.testing.assert_array_equal(rec.completion_ids, episode.completion_ids)
    meta = rec.metadata["episode"]
    assert meta["num_turns"] == 2 and meta["truncated"] is None
    assert meta["turn_rewards"] == [5.0, None]  # kept, never added to the reward
    assert meta["turns"][1]["messages"] == FEEDBACK.messages
    assert rec.metadata["scored_turns"] == 2
    assert rec.prompt_text.endswith("<|im_start|>user\nquestion 0<|im_end|>\n"
                                    "<|im_start|>assistant\n")


def test_sampled_tokens_are_kept_even_when_they_are_not_the_canonical_tokenisation():
    env = Scripted([DONE])
    runner = runner_for(env)
    tok = runner.renderer.tokenizer
    canonical = tok.encode("assistant", add_special_tokens=False)
    letters = [tok.convert_tokens_to_ids(c) for c in "assistant"]  # one token per letter
    assert letters != canonical
    episode = runner.begin(problem())
    ids = letters + [runner.renderer.end_of_turn_id]
    runner.submit(episode, ids, [-1.0] * len(ids), True).result(timeout=60)
    assert episode.completion_ids == ids
    assert env.responses and episode.model_turns == ["assistant"]


def _raise(state, text):
    raise RuntimeError("the environment broke")


@pytest.mark.reliability
@pytest.mark.parametrize(("name", "response", "message"), [
    ("respond raises", _raise, "RuntimeError: the environment broke"),
    ("non-string content", EnvResponse([{"role": "tool", "content": 84}], done=False),
     "content is int, not a string"),
    ("a role the environment may not take",
     EnvResponse([{"role": "assistant", "content": "I am the model now"}], done=False),
     "has role 'assistant'"),
    ("not an EnvResponse", {"messages": [], "done": True}, "returned dict, not EnvResponse"),
    ("not done and nothing to say", EnvResponse([], done=False), "not done but no message"),
])
def test_a_broken_environment_truncates_the_episode(name, response, message):
    env = Scripted([response])
    runner = runner_for(env)
    episode = play(runner, ["The answer is 42."])
    assert episode.done and episode.truncated == "env_error"
    assert message in episode.turns[-1]["info"]["error"]
    rec = runner.finish(episode)
    # The reward is score's for the turns there are (the last says 42), nothing invented.
    assert rec.reward == 1.0 and rec.metadata["episode"]["truncated"] == "env_error"
    record(SECTION, f"environment: {name}", runs=1, failures=0,
           detail=f"-> truncated env_error, the error kept in the turn ({message}); reward from "
           "score() alone")


@pytest.mark.reliability
def test_a_hung_environment_times_out_and_its_slot_is_freed():
    gate = Gate()
    hung = runner_for(Scripted([gate]), timeout_s=0.2, workers=1)
    episode = play(hung, ["The answer is 41."])
    assert episode.truncated == "env_timeout" and hung.abandoned == 1
    assert "did not return within 0.2 s" in episode.turns[-1]["info"]["error"]
    assert hung.finish(episode).reward == -1.0
    # The only worker slot is free again: the next call runs although the first still hangs.
    hung.env.responses = [DONE]
    second = play(hung, ["The answer is 42."], pid=1)
    assert second.truncated is None and hung.finish(second).reward == 1.0
    assert gate.running == 1  # the abandoned call is still blocked (a thread cannot be killed)
    gate.release.set()
    record(SECTION, "environment hangs (respond never returns)", runs=1, failures=0,
           detail="-> truncated env_timeout after env.timeout_s, the call abandoned and counted, "
           "its worker slot freed for the next episode; reward from score() alone")


def test_at_most_workers_calls_at_once():
    gate = Gate()
    runner = runner_for(Scripted([gate]), workers=2)
    episodes = [runner.begin(problem(i)) for i in range(5)]
    futures = []
    for e in episodes:
        ids = model_ids(runner, "hm")
        futures.append(runner.submit(e, ids, [0.0] * len(ids), True))
    assert gate.entered.acquire(timeout=60) and gate.entered.acquire(timeout=60)
    assert gate.running == 2 and not any(f.done() for f in futures)
    gate.release.set()
    assert all(f.result(timeout=60) is not None for f in futures)
    assert gate.most == 2


@pytest.mark.reliability
def test_an_observation_longer_than_the_tokens_left_truncates():
    long = EnvResponse([{"role": "tool", "content": "word " * 400}], done=False)
    runner = runner_for(Scripted([long]), tokens=64)
    episode = play(runner, ["The answer is 42."])
    span = episode.turns[-1]
    assert episode.truncated == "max_tokens" and span["start"] == span["end"]
    assert span["info"]["observation_tokens"] > span["info"]["tokens_left"]
    assert span["dropped_messages"] == long.messages  # kept for the record, never fed
    assert all(m == 1 for m in episode.action_mask)  # no observation token went in
    capped = runner_for(Scripted([long]), tokens=4096, max_observation_tokens=32)
    episode = play(capped, ["The answer is 42."])
    assert episode.truncated == "max_observation_tokens"
    record(SECTION, "observation longer than the tokens left", runs=2, failures=0,
           detail="-> truncated max_tokens (or max_observation_tokens over env."
           "max_observation_tokens), never cut silently: no token fed, the messages kept in "
           "the turn as dropped_messages")


def test_model_out_of_tokens_or_stopping_on_eos_ends_without_the_environment():
    env = Scripted([FEEDBACK])
    runner = runner_for(env)
    episode = runner.begin(problem())
    ids = model_ids(runner, "The answer", end=False)
    assert runner.submit(episode, ids, [0.0] * len(ids), False).result(timeout=60) is None
    assert episode.truncated == "max_tokens" and env.calls == 0
    episode = runner.begin(problem(1))
    ids = model_ids(runner, "The answer is 42.", end=False) + [runner.renderer.tokenizer.eos_token_id]
    assert runner.submit(episode, ids, [0.0] * len(ids), True).result(timeout=60) is None
    assert episode.done and episode.truncated is None and env.calls == 0
    assert episode.turns[-1]["stop"] == "stop"


def test_messages_of_a_finished_episode_are_kept_not_fed():
    farewell = EnvResponse([{"role": "user", "content": "Well done."}], done=True, reward=1.5)
    episode = play(runner_for(Scripted([farewell])), ["It is 42."])
    assert episode.done and episode.truncated is None
    assert all(m == 1 for m in episode.action_mask)
    assert episode.turns[-1]["dropped_messages"] == farewell.messages
    assert episode.turns[-1]["reward"] == 1.5


def test_turn_limit():
    env = Scripted([FEEDBACK], max_turns=2)
    runner = runner_for(env)
    episode = play(runner, ["41", "43", "44"])
    assert episode.truncated == "max_turns" and len(episode.model_turns) == 2 and env.calls == 2
    assert episode.turns[-1]["dropped_messages"] == FEEDBACK.messages
    assert runner.finish(episode).metadata["episode"]["turn_rewards"] == [5.0, 5.0]


def test_misuse_is_refused():
    runner = runner_for(Scripted([Gate()]), timeout_s=60)
    episode = runner.begin(problem())
    with pytest.raises(ValueError, match="3 tokens with 2 log-probs"):
        runner.submit(episode, [5, 6, 7], [0.0, 0.0], True)
    ids = model_ids(runner, "hm")
    runner.submit(episode, ids, [0.0] * len(ids), True)
    with pytest.raises(RuntimeError, match="waiting for its environment"):
        runner.submit(episode, ids, [0.0] * len(ids), True)
    with pytest.raises(RuntimeError, match="not over"):
        runner.finish(episode)
    runner.env.responses[0].release.set()


@pytest.mark.parametrize(("result", "error"), [
    ("1.0", "returned str, not a RewardResult"),
    (RewardResult(math.nan, False, True, None), "non-finite reward"),
])
def test_a_bad_score_is_an_error_naming_the_environment(result, error):
    env = Scripted([DONE])
    env.score = lambda state, problem, turns: result
    runner = runner_for(env)
    episode = play(runner, ["42"])
    with pytest.raises((TypeError, ValueError), match=error) as info:
        runner.finish(episode)
    assert "environment 'scripted'" in str(info.value)
