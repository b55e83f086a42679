"""The commands accept environments (issue 56 item 3), as a user runs them: subprocesses in a
temporary directory, one config with `env:`, the real SmolLM2-135M-Instruct playing
`countdown_game` (its turns end on its template's <|im_end|>; wrong tries get the verifier's
reason and another try):

    generate → score → curate → train → evaluate, and online (the serial loop)

Checked from outside: the records are episodes (action mask, turns); the score pass writes μ at
model tokens only and it agrees with the sampler's; training reads the episodes (a finite
loss over model tokens); evaluate reports pass@k with turns and tool calls per episode; an
online round trains on episodes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.seams.test_cli_flow import jaxrl, metrics_rows, read_records

pytestmark = [pytest.mark.slow]

YAML = """\
name: env_flow
run_dir: runs/env_flow
seed: 0
model: {source: smollm2}
loss: {name: topr}
optim: {learning_rate: 1.0e-6}
train: {steps: 1, batch_size: 4, max_seq_len: 512, log_every: 1, checkpoint_every: 10,
       allow_no_signal: true}
generate: {n: 2, temperature: 1.0, max_new_tokens: 128, batch_size: 4, output: data/records}
data: {task: countdown, num_prompts: 2, chat_template: true, records: data/records,
       curated: data/curated}
env: {name: countdown_game, max_turns: 2, timeout_s: 30}
eval: {n: 2, num_questions: 2, batch_size: 4, maj_k: [1], bootstrap_trials: 2}
online: {rounds: 1, prompts_per_round: 2}
"""


@pytest.fixture(scope="module")
def flow(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("env_flow")
    (cwd / "flow.yaml").write_text(YAML)
    jaxrl(cwd, "generate", "--config", "flow.yaml")
    jaxrl(cwd, "score", "--config", "flow.yaml")
    return cwd


def test_generate_and_score_write_episodes(flow):
    scored = [p for p in (flow / "data").iterdir() if p.name.startswith("records")
              and p.name != "records"]
    assert len(scored) == 1
    records = read_records(scored[0])
    assert len(records) == 4
    for r in records:
        ep = r.metadata["episode"]
        mask = r.action_mask.astype(bool)
        assert ep["environment"] == "countdown_game" and 1 <= ep["num_turns"] <= 2
        assert (~mask).any() == (ep["num_turns"] > 1)
        np.testing.assert_allclose(r.mu_logprobs[mask], r.behavior_logprobs[mask], atol=2e-3)
        assert np.all(r.mu_logprobs[~mask] == 0)
    assert any(r.metadata["episode"]["num_turns"] > 1 for r in records)


def test_curate_and_train_on_episodes(flow):
    jaxrl(flow, "curate", "--config", "flow.yaml")
    jaxrl(flow, "train", "--config", "flow.yaml", "--no-progress")
    rows = [r for r in metrics_rows(flow / "runs" / "env_flow") if "loss" in r]
    assert rows and all(np.isfinite(r["loss"]) for r in rows)


def test_evaluate_reports_episodes(flow):
    jaxrl(flow, "evaluate", "--config", "flow.yaml", "--out", "ev")
    summary = json.loads((flow / "ev" / "eval.json").read_text())
    ep = summary["episodes"]
    assert ep["episodes"] == 4 and 1 <= ep["turns_per_episode"] <= 2
    assert "tool_calls_per_episode" in ep and "pass_at_k" in summary


def test_online_trains_on_episodes(flow):
    jaxrl(flow, "online", "--config", "flow.yaml", "run_dir=runs/online", "--no-progress")
    rows = metrics_rows(flow / "runs" / "online")
    assert any("loss" in r and np.isfinite(r["loss"]) for r in rows)
