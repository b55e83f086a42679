"""μ is the policy at step 0: generate → score → loader → first train step gives π/μ = 1.

The records are sampled (JAX backend) from a tiny random model at T = 0.7 and scored by the
same model; the trainer starts from that model, takes the temperature from the records'
manifest (the config leaves it unset), and its first step's log π − log μ must be ≈ 0: any
difference is numerics (kernels, sharding, batch shapes) or a wrong temperature. The same
holds for log π − log π_ref of a reference-reading loss with the reference from the records.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxrl_llm.config import config_from_dict
from jaxrl_llm.generate.jax_backend import generate_records
from jaxrl_llm.policy.opener import open_model
from jaxrl_llm.tasks import task_from_config
from jaxrl_llm.train.score import score_records
from jaxrl_llm.train.trainer import Trainer

SAMPLING_T = 0.7
# bf16 parameters and compute: the score pass and the train step run the same bf16 model, so
# the per-record log-ratio is rounding of differently fused bf16 forwards (the log-softmax
# itself accumulates in fp32). Measured on the 2-core CPU: |mean| 1.8e-7 (fp32: exactly 0);
# the bound leaves three orders of magnitude for other backends' fusions.
BF16_BOUND = 1e-3
FP32_BOUND = 1e-5


def experiment(tmp: Path, dtype: str, loss: str, **generate: object) -> dict:
    return {
        "run_dir": str(tmp / f"run-{loss}-{dtype}"), "seed": 1,
        "model": {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_layers": 1,
                  "num_heads": 2, "num_kv_heads": 1, "max_position_embeddings": 256,
                  "param_dtype": dtype, "compute_dtype": dtype},
        "loss": {"name": loss},
        "optim": {"learning_rate": 1e-3},
        "train": {"steps": 1, "batch_size": 8, "max_seq_len": 160, "log_every": 10},
        "generate": {"n": 2, "max_new_tokens": 12, **generate},
        "data": {"task": "arithmetic", "num_prompts": 4, "task_options": {"min_ops": 1, "max_ops": 1}},
    }


def generate_and_score(tmp: Path, dtype: str, temperature: float) -> tuple[object, Path]:
    config = config_from_dict(experiment(tmp, dtype, "topr", temperature=temperature))
    opened = open_model(None, config)
    model, tokenizer = opened.model, opened.tokenizer
    task = task_from_config(config)
    g = config.generate
    records = tmp / f"records-{dtype}-{temperature}"
    generate_records(model, tokenizer, task, task.load(num=config.data.num_prompts), str(records),
                     n=g.n, temperature=g.temperature, max_new_tokens=g.max_new_tokens,
                     batch_size=8, seed=0, progress=False)
    scored = tmp / f"scored-{dtype}-{temperature}"
    score_records(model, str(records), str(scored), batch_size=8, progress=False)
    return model, scored


def first_row(tmp: Path, dtype: str, loss: str, model: object, scored: Path,
              **generate: object) -> dict:
    """Train one step on `scored` and return the logged row; `generate` (default: unset, so a
    μ-reading loss takes the records' temperature) is the train config's section."""
    tree = experiment(tmp, dtype, loss)
    tree["generate"] = dict(generate)
    tree["data"]["records"] = str(scored)
    trainer = Trainer(config_from_dict(tree), model=model, progress=False, tensorboard=False)
    try:
        if loss == "topr" and not generate:
            assert trainer.config.generate.temperature == pytest.approx(
                json.loads((scored / "manifest.json").read_text())["extra"]["score_temperature"])
        result = trainer.run()
    finally:
        trainer.close()
    rows = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    return rows[0]


# both dtypes run with the slow tests (≈ 30 s each on 2 cores); the default run keeps the
# reference-policy cases below, which generate and score the same way
@pytest.mark.slow
@pytest.mark.parametrize("dtype, bound", [("float32", FP32_BOUND), ("bfloat16", BF16_BOUND)])
def test_first_step_log_ratio_is_zero(tmp_path, dtype, bound):
    model, scored = generate_and_score(tmp_path, dtype, SAMPLING_T)
    row = first_row(tmp_path, dtype, "topr", model, scored)
    # log π − log μ, per record summed over its tokens (TOPR's sequence-level ratio).
    assert abs(row["loss/log_ratio_mean"]) < bound, row
    assert abs(row["loss/log_ratio_max"]) < 10 * bound, row
    # The first row names step 1's own value whatever train.log_every is.
    assert row["step1/loss/log_ratio_mean"] == row["loss/log_ratio_mean"]


@pytest.mark.parametrize("sampling, train", [
    (1.0, {}),
    (SAMPLING_T, {}),
    (SAMPLING_T, {"temperature": SAMPLING_T}),
])
def test_first_step_reference_log_ratio_is_zero(tmp_path, sampling, train):
    """A*-PO's log π − log π_ref with π_ref from the records (train.ref_logprobs=batch), also
    when the one config of the whole flow says generate.temperature=0.7."""
    model, scored = generate_and_score(tmp_path, "float32", sampling)
    row = first_row(tmp_path, "float32", "apo", model, scored, **train)
    assert abs(row["loss/logratio"]) < FP32_BOUND, row

def test_a_config_at_another_temperature_is_refused(tmp_path):
    """The records say T = 0.7 (score pass); an explicit generate.temperature=1.0 would give
    π/μ ≠ 1 at step 0: refused, naming both values, the manifest and the key."""
    from jaxrl_llm.config import ConfigError

    model, scored = generate_and_score(tmp_path, "float32", SAMPLING_T)
    tree = experiment(tmp_path, "float32", "topr", temperature=1.0)
    tree["data"]["records"] = str(scored)
    with pytest.raises(ConfigError) as err:
        Trainer(config_from_dict(tree), model=model, progress=False, tensorboard=False)
    text = str(err.value)
    for part in ("generate.temperature=1.0", "temperature 0.7", str(scored / "manifest.json"),
                 "extra.score_temperature"):
        assert part in text, text
