"""The flow as a user runs it: `jaxrl-llm` subprocesses in a temporary working directory, one
config file with relative paths, every stage and every loss name the config accepts.

    generate --gold → train (sft) → export        a tiny model that is right some of the time
    generate → score → curate → train (each loss) → export
    export → evaluate → report                     on one trained result

What is asserted comes from the data, not from the code under test: pairs and whole groups are
counted from the curated records; at step 1 the policy *is* the reference and the sampling
policy, so every log-ratio against π_ref or μ must be ≈ 0 (a zero-filled reference would give
the sequence log-prob itself, several nats); trained weights must differ from the start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.xla_flags import ONE_DEVICE

pytestmark = [pytest.mark.slow]

# A model small enough to SFT in seconds on an easy arithmetic task (1 operation, operands
# 1–3), so that at T = 1 its samples are right some of the time: positives and negatives.
FLOW_YAML = """\
name: flow
run_dir: runs/flow
seed: 0
model: {source: random, vocab_size: 128, hidden_size: 64, intermediate_size: 128,
        num_layers: 2, num_heads: 2, num_kv_heads: 1, max_position_embeddings: 256}
optim: {learning_rate: 0.003}
train: {steps: 300, batch_size: 16, max_seq_len: 160, log_every: 1, checkpoint_every: 1000}
generate: {n: 4, temperature: 1.0, max_new_tokens: 48, batch_size: 32, output: data/records}
data: {task: arithmetic, num_prompts: 64, records: data/records,
       task_options: {min_ops: 1, max_ops: 1, max_operand: 3}}
eval: {n: 4, num_questions: 16, batch_size: 32, maj_k: [1, 4], bootstrap_trials: 10}
"""

RL_STEPS = 3
LOSS_NAMES = ("topr", "sft", "reinforce", "opr", "tis", "ppo", "grpo", "dr_grpo", "off_rl",
              "off_rl_kl", "fpa", "dpo", "rpo", "kto", "apo", "cispo", "gspo", "icepop", "m2po",
              "vespo", "dppo", "trm", "oapl", "vcpo", "asymre")


def jaxrl(cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`jaxrl-llm ARGS` as a user types it, from `cwd`, on the CPU."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = ONE_DEVICE  # one real CPU device, as on a user's machine
    exe = Path(sys.executable).with_name("jaxrl-llm")
    proc = subprocess.run([str(exe), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=900)
    if check and proc.returncode != 0:
        raise AssertionError(f"jaxrl-llm {' '.join(args)} exited {proc.returncode}:\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def metrics_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def safetensors_params(directory: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(directory / "model.safetensors"))


def read_records(directory: Path) -> list:
    from jaxrl_llm.data.shards import RecordSource

    return list(RecordSource(str(directory)))


@pytest.fixture(scope="module")
def flow(tmp_path_factory) -> Path:
    """A working directory holding flow.yaml, the SFT-warmed model `models/warm` and its
    generated + scored records (the shared first half of every loss's flow)."""
    cwd = tmp_path_factory.mktemp("flow")
    (cwd / "flow.yaml").write_text(FLOW_YAML)
    jaxrl(cwd, "generate", "--config", "flow.yaml", "--gold", "--out", "data/gold",
          "data.num_prompts=512")
    jaxrl(cwd, "train", "--config", "flow.yaml", "--records", "data/gold", "--no-progress",
          "loss.name=sft", "run_dir=runs/warmup", "train.log_every=50")
    jaxrl(cwd, "export", "--checkpoint", "runs/warmup/checkpoints", "--out", "models/warm")
    # From here on the config names the warmed model: every later stage reads it.
    text = FLOW_YAML.replace("model: {source: random,", "model: {source: hf, path: models/warm,")
    (cwd / "flow.yaml").write_text(text)
    jaxrl(cwd, "generate", "--config", "flow.yaml")
    jaxrl(cwd, "score", "--config", "flow.yaml")
    return cwd


def test_sft_warm_model_samples_positives_and_negatives(flow):
    records = read_records(flow / "data" / "records")
    correct = np.array([r.correct for r in records])
    groups = np.array([r.group_id for r in records])
    mixed = sum(0 < correct[groups == g].sum() < (groups == g).sum() for g in np.unique(groups))
    assert len(records) == 64 * 4
    assert 0 < correct.sum() < len(records) and mixed >= 2, (correct.sum(), mixed)


def test_score_writes_mu_and_reference_logprobs(flow):
    scored = [p for p in (flow / "data").iterdir() if p.name.startswith("records") and p.name != "records"]
    assert len(scored) == 1, sorted(p.name for p in (flow / "data").iterdir())
    records = read_records(scored[0])
    assert all(r.mu_logprobs is not None and r.ref_logprobs is not None for r in records)
    # log-probs of sampled tokens: ≤ 0, and not all zero (a real forward)
    mu = np.concatenate([r.mu_logprobs for r in records])
    ref = np.concatenate([r.ref_logprobs for r in records])
    assert (mu <= 0).all() and (ref <= 0).all() and mu.min() < -0.1 and ref.min() < -0.1
    # sampled at T = 1: μ (at the sampling temperature) and π_ref (at T = 1) are one distribution
    np.testing.assert_allclose(mu, ref, atol=1e-5)
    # and the sampler's own log-probs agree with the trainer's numerics
    behaviour = np.concatenate([r.behavior_logprobs for r in records])
    np.testing.assert_allclose(mu, behaviour, atol=2e-3)


def test_long_generations_through_the_growing_cache_score_like_the_trainer(flow):
    """100 new tokens: the sampler's KV cache grows twice (windows ending at steps 34 and 67,
    `sampler.window_ends`); the score pass recomputes every log-prob with the trainer's
    cache-free forward, so a token attended with a wrongly grown cache would disagree."""
    jaxrl(flow, "generate", "--config", "flow.yaml", "generate.max_new_tokens=100",
          "generate.stop_at_eos=false", "generate.output=data/long", "data.num_prompts=8",
          "generate.n=2")
    jaxrl(flow, "score", "--config", "flow.yaml", "--records", "data/long", "--out",
          "data/long-scored")
    records = read_records(flow / "data" / "long-scored")
    assert len(records) == 16 and {len(r.completion_ids) for r in records} == {100}
    mu = np.stack([r.mu_logprobs for r in records])
    behaviour = np.stack([r.behavior_logprobs for r in records])
    assert mu.min() < -0.1  # a real forward, not zeros
    np.testing.assert_allclose(mu[:, 66:], behaviour[:, 66:], atol=2e-3)  # the last window
    np.testing.assert_allclose(mu, behaviour, atol=2e-3)


def _curation(name: str) -> str:
    from jaxrl_llm.losses.registry import loss_spec

    return "dpo" if loss_spec(name).needs_pairs else "uniform"


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_every_loss_trains_through_the_cli(flow, name):
    from jaxrl_llm.losses.registry import loss_spec

    spec = loss_spec(name)
    curated = f"data/curated-{name}"
    common = ["--config", "flow.yaml", f"loss.name={name}", f"data.curated={curated}",
              f"data.curation={_curation(name)}"]
    jaxrl(flow, "curate", *common)
    records = read_records(flow / curated)
    assert records, name
    if spec.needs_ref or spec.needs_mu:
        assert all(r.mu_logprobs is not None for r in records), "curate read unscored records"
    run = f"runs/{name}"
    jaxrl(flow, "train", *common, "--no-progress", f"run_dir={run}", f"train.steps={RL_STEPS}",
          "optim.learning_rate=0.001")
    rows = metrics_rows(flow / run)
    assert [r["step"] for r in rows] == list(range(1, RL_STEPS + 1))
    first = rows[0]
    assert all(np.isfinite(r["loss"]) for r in rows)
    assert any(r["loss"] != 0 for r in rows) and any(r["grad_norm"] > 0 for r in rows), rows
    if spec.needs_mu:  # μ is the policy at step 1: π/μ ≡ 1
        assert abs(first["loss/log_ratio_mean"]) < 1e-4, first
        assert abs(first["loss/log_ratio_max"]) < 1e-3, first
    if spec.needs_pairs:
        assert first["loss/num_pairs"] > 0, first
    if spec.needs_ref and spec.family == "preference":  # π = π_ref at step 1
        keys = [k for k in first if k.startswith("loss/") and k.endswith("logratio")]
        assert keys, first  # chosen/rejected (DPO, RPO, KTO) or per-record (A*-PO)
        assert all(abs(first[k]) < 1e-3 for k in keys), first
    if name == "off_rl_kl":
        assert abs(first["loss/kl_forward_mean"]) < 1e-3, first
    if spec.needs_groups:
        # whole groups only: the number of groups in a batch is its records / group size
        assert all(r["data/partial_groups"] == 0 for r in rows), rows
        assert all(r["data/whole_groups"] > 0 for r in rows), rows
    jaxrl(flow, "export", "--checkpoint", f"{run}/checkpoints", "--out", f"models/{name}")
    before, after = safetensors_params(flow / "models/warm"), safetensors_params(flow / f"models/{name}")
    assert before.keys() == after.keys()
    moved = [k for k in before if not np.array_equal(before[k], after[k])]
    assert moved, f"{name}: no parameter moved in {RL_STEPS} steps"


def test_export_evaluate_report(flow):
    """The last stages on a trained result, as the README lists them."""
    common = ["--config", "flow.yaml", "data.curated=data/curated-eval", "run_dir=runs/eval"]
    jaxrl(flow, "curate", *common)
    jaxrl(flow, "train", *common, "--no-progress", "train.steps=2", "optim.learning_rate=0.0001")
    jaxrl(flow, "export", "--checkpoint", "runs/eval/checkpoints", "--out", "models/eval")
    jaxrl(flow, "evaluate", *common, "--model", "models/eval", "--out", "runs/eval/eval")
    result = json.loads((flow / "runs/eval/eval/eval.json").read_text())
    # 16 questions × 4 samples, each scored: pass@1 is the mean of the per-question rates
    assert result["num_questions"] == 16 and result["n"] == 4
    shares = result["proportions"]  # correct / incorrect / invalid over the 64 samples
    assert set(shares) == {"correct", "incorrect", "invalid"}
    np.testing.assert_allclose(sum(shares.values()), 1.0)
    # pass@1 is the mean per-question solve rate: with equal n, the overall correct share
    np.testing.assert_allclose(result["pass_at_1"]["mean"], shares["correct"])
    jaxrl(flow, "report", "runs/eval")
    report = flow / "runs/eval/report"
    assert any(p.suffix == ".png" for p in report.iterdir()), sorted(report.iterdir())
    assert any(p.suffix == ".md" for p in report.iterdir())


def test_train_refuses_missing_curated_directory(flow):
    proc = jaxrl(flow, "train", "--config", "flow.yaml", "--no-progress", "run_dir=runs/missing",
                 "data.curated=data/does-not-exist", check=False)
    assert proc.returncode != 0
    assert "data/does-not-exist" in proc.stderr
