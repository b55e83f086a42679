"""Episodes through the API (issue 56 items 2–3): `Policy.rollout(problems, env=...)` on the
packaged SmolLM2-135M-Instruct (its own ChatML template), playing `countdown_game`: the
model's turns end on <|im_end|>, the verifier's feedback comes back as a user turn of
template tokens, and the model tries again in the same slot.

Oracles: (a) every model token's sampler log-prob equals the trainer's own forward over the
whole episode (`Policy.score`, environment tokens as context); (b) the environment's tokens
are exactly the chat template's rendering of the feedback message after the model's turn
(transformers' `apply_chat_template` on the conversation, compared token for token);
(c) the record's reward is the task's own score of the last try."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # SmolLM2-135M decoding ~100-token turns on the CPU


@pytest.fixture(scope="module")
def rollout():
    import jax

    from jaxrl_llm.api import load_policy
    from jaxrl_llm.config import config_from_dict
    from jaxrl_llm.parallel.mesh import make_mesh

    config = config_from_dict({
        "name": "episodes", "model": {"source": "smollm2"},
        "data": {"task": "countdown", "chat_template": True},
        "env": {"name": "countdown_game", "max_turns": 3, "timeout_s": 20},
        "generate": {"n": 2, "temperature": 1.0, "max_new_tokens": 160, "batch_size": 4},
        "train": {"batch_size": 4, "max_seq_len": 384}})
    # one device, as a user's laptop (the tests' 8 fake CPU devices would split the slots)
    policy = load_policy(config=config, mesh=make_mesh(config.mesh, jax.devices()[:1]))
    problems = policy.task.load(split="train", num=2, seed=0)
    return policy, problems, policy.rollout(problems, seed=0)


def test_model_tokens_carry_the_trainers_log_probs_over_the_whole_episode(rollout):
    policy, _, records = rollout
    assert len(records) == 4
    assert any(r.metadata["episode"]["num_turns"] > 1 for r in records), \
        "SmolLM2 should fail some countdown tries and get feedback"
    mu = policy.score(records, temperature=1.0)
    for record, scored in zip(records, mu, strict=True):
        mask = record.action_mask.astype(bool)
        assert mask[0] and (~mask).any() == (record.metadata["episode"]["num_turns"] > 1)
        np.testing.assert_allclose(record.behavior_logprobs[mask], np.asarray(scored)[mask],
                                   atol=2e-3)
        assert np.all(record.behavior_logprobs[~mask] == 0.0)


def test_environment_tokens_are_the_templates_rendering_of_the_feedback(rollout):
    policy, _, records = rollout
    tok = policy.tokenizer
    checked = 0
    for record in records:
        ids = record.completion_ids.tolist()
        for span in record.metadata["episode"]["turns"]:
            if span["kind"] != "env" or span["end"] == span["start"]:
                continue
            # the conversation up to this observation, rendered by transformers from text
            convo = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                     *span["messages"]]
            text = tok.apply_chat_template(convo, tokenize=False, add_generation_prompt=True)
            # the model sampled the assistant turn's <|im_end|>: the observation is the rest
            want = text[text.index("y<|im_end|>") + len("y<|im_end|>"):]
            got = ids[span["start"]:span["end"]]
            assert tok.decode(got) == want
            assert got == tok(want, add_special_tokens=False)["input_ids"]
            checked += 1
    assert checked >= 1


def test_reward_is_the_tasks_score_of_the_last_try(rollout):
    policy, problems, records = rollout
    for i, record in enumerate(records):
        problem = problems[i // 2]
        turns = record.metadata["episode"]["turns"]
        last = [t for t in turns if t["kind"] == "model"][-1]
        text = policy.tokenizer.decode(record.completion_ids[last["start"]:last["end"]],
                                       skip_special_tokens=True)
        assert record.reward == policy.task.score(problem, text).reward
        assert record.group_id == i // 2
