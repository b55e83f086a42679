"""The trainer gives each loss the data it needs through the one loader constructor: DPO
trains on pairs (not on 0 of them), GRPO on whole groups, and both show it in metrics.jsonl.

Expected counts come from the records written here: a batch of 8 rows holds 4 DPO pairs, or
2 whole groups of 4."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm.config import config_from_dict
from jaxrl_llm.data.curation import curate_directory
from jaxrl_llm.data.records import Record
from jaxrl_llm.data.shards import read_records, write_records
from jaxrl_llm.train.state import build_model
from jaxrl_llm.train.trainer import Trainer

GROUP, NUM_GROUPS, STEPS = 4, 6, 3


def tiny(run_dir: Path, records: Path, loss: str, **train: object) -> object:
    return config_from_dict({
        "run_dir": str(run_dir), "seed": 3,
        "model": {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_layers": 1,
                  "num_heads": 2, "num_kv_heads": 1, "max_position_embeddings": 64},
        "optim": {"name": "adamw", "learning_rate": 1e-2},
        "loss": {"name": loss},
        "data": {"records": str(records), "shuffle_seed": 1},
        "train": {"steps": STEPS, "batch_size": 8, "max_seq_len": 16, "log_every": 1,
                  "checkpoint_every": 100, **train},
    })


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    """6 prompts × 4 samples, 2 correct per prompt (every group mixed), with μ."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(NUM_GROUPS * GROUP):
        c = int(rng.integers(2, 8))
        correct = i % GROUP < 2
        out.append(Record(
            prompt_ids=np.array([1, 2 + i // GROUP]), completion_ids=rng.integers(1, 64, c),
            reward=1.0 if correct else -1.0, correct=correct, group_id=i // GROUP,
            behavior_logprobs=-rng.random(c).astype(np.float32),
            mu_logprobs=-rng.random(c).astype(np.float32)))
    path = tmp_path_factory.mktemp("records") / "gen"
    write_records(path, out, vocab_size=64)
    return path


def params(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def train(config) -> tuple[list[dict], dict[str, np.ndarray], dict[str, np.ndarray]]:
    model = build_model(config)
    before = params(nnx.state(model, nnx.Param))
    trainer = Trainer(config, model=model, progress=False, tensorboard=False)
    try:
        result = trainer.run()
    finally:
        trainer.close()
    rows = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    return rows, before, params(result.state.params)


def assert_moved(before: dict, after: dict) -> None:
    common = before.keys() & after.keys()
    assert common, (sorted(before)[:3], sorted(after)[:3])
    assert any(not np.array_equal(before[k], after[k].astype(before[k].dtype)) for k in common)


def test_dpo_trains_on_pairs(tmp_path, generated):
    curated = tmp_path / "pairs"
    curate_directory(str(generated), str(curated), strategy="dpo")
    pairs = len(read_records(curated)) // 2
    assert pairs == NUM_GROUPS * 2 * 2  # 2 correct × 2 incorrect per prompt
    config = tiny(tmp_path / "run", generated, "dpo", ref_logprobs="model")
    config = config.model_copy(update={"data": config.data.model_copy(update={"curated": str(curated)})})
    rows, before, after = train(config)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # 8 rows a batch = 4 (chosen, rejected) pairs, at every step (24 pairs ≥ 3 × 4)
    assert [r["loss/num_pairs"] for r in rows] == [4.0] * STEPS
    assert all(r["grad_norm"] > 0 for r in rows)
    assert_moved(before, after)


def test_grpo_trains_on_whole_groups(tmp_path, generated):
    rows, before, after = train(tiny(tmp_path / "run", generated, "grpo"))
    assert [r["data/whole_groups"] for r in rows] == [2.0] * STEPS  # 8 rows / 4 a group
    assert [r["data/partial_groups"] for r in rows] == [0.0] * STEPS
    assert_moved(before, after)


# The records' μ log-probs are random in (−1, 0) while the untrained 64-token model puts
# log π ≈ −4.2 on every token: ratios in (e^−4.2, e^−3.2), which IcePop's default α = 0.5 and M2PO's
# default τ = 0.04 would mask entirely (no gradient). Bounds that keep part of the tokens:
STALE_OPTIONS = {"icepop": {"icepop_alpha": 0.03}, "m2po": {"m2po_tau": 12.0}}


def stale(run_dir: Path, records: Path, loss: str, **train: object) -> object:
    config = tiny(run_dir, records, loss, **train)
    options = config.loss.model_dump(exclude_unset=True) | STALE_OPTIONS.get(loss, {})
    return config.model_copy(update={"loss": type(config.loss)(**options)})


@pytest.mark.parametrize("loss,metric", [
    ("cispo", "loss/is_weight_mean"),  # one in the default run; the rest with the slow tests
    pytest.param("gspo", "loss/seq_log_ratio_mean", marks=pytest.mark.slow),
    pytest.param("icepop", "loss/masked_frac", marks=pytest.mark.slow),
    pytest.param("m2po", "loss/m2", marks=pytest.mark.slow),
    pytest.param("vespo", "loss/phi_mean", marks=pytest.mark.slow)])
def test_stale_sample_losses_train_on_whole_groups(tmp_path, generated, loss, metric):
    """cispo/gspo/icepop/m2po/vespo (losses/stale_is.py): whole groups, μ read, a finite loss,
    their own metrics logged, parameters moved; a 16-row batch split into two micro-batches
    gives the step-1 loss of the unsplit batch (advantages from the full batch, kernels
    returning sums) — except M2PO, whose batch-wide token mask refuses micro-batches."""
    rows, before, after = train(stale(tmp_path / "run", generated, loss))
    assert [r["data/whole_groups"] for r in rows] == [2.0] * STEPS
    assert all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows), rows
    assert all(metric in r for r in rows), sorted(rows[0])
    if loss in STALE_OPTIONS:  # the masks act on part of the tokens
        assert all(0 < r["loss/masked_frac"] < 1 for r in rows), [r["loss/masked_frac"] for r in rows]
    assert_moved(before, after)
    if loss == "m2po":
        from jaxrl_llm.config import ConfigError

        with pytest.raises(ConfigError, match="loss.name=m2po couples rows"):
            train(stale(tmp_path / "micro", generated, loss, batch_size=16, micro_batch_size=8))
        return
    whole, _, _ = train(stale(tmp_path / "whole", generated, loss, steps=1, batch_size=16))
    micro, _, _ = train(stale(tmp_path / "micro", generated, loss, steps=1, batch_size=16,
                              micro_batch_size=8))
    np.testing.assert_allclose(micro[0]["loss"], whole[0]["loss"], rtol=1e-5, atol=1e-7)
