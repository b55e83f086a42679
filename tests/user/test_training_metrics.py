"""Issue 33, what a TRL user reads: reward mean/std, completion length, entropy, KL (k3) to μ
and to π_ref in every metrics row, tokens/s on the last row, held-out pass@1 ± SE every
`train.eval_every` steps from the command line, and the report's plots with right labels.

Values are recomputed here by an independent route: the initial policy's full logits
(`log_softmax` over the whole vocabulary in numpy, no chunking) on the records' tokens; the
evaluation numbers by `jaxrl-llm evaluate` on the checkpoint."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from tests.data.helpers import make_records
from tests.tasks.test_custom_task import MODULE
from tests.user.cli import jaxrl

TRAIN = ("run_dir: run\nmesh: {data: 1}\noptim: {learning_rate: 1.0e-3}\n"
         "train: {steps: 1, batch_size: 8, max_seq_len: 32, log_every: 1}\n"
         "data: {records: recs}\n")


def _records(with_ref: bool):
    records = make_records(8, vocab=50, group_size=2)
    rng = np.random.default_rng(1)
    for i, r in enumerate(records):
        r.reward = float(rng.normal())
        if with_ref:
            r.ref_logprobs = (-rng.random(r.completion_ids.size) - 0.01).astype(np.float32)
        r.correct = r.reward > 0
        assert i == r.metadata["i"]
    return records


def _reference(records) -> dict[str, float]:
    """The initial random policy's full softmax on every completion token (numpy)."""
    import jax.numpy as jnp

    from jaxrl_llm.config import config_from_dict
    from jaxrl_llm.weights.loading import load_model

    model = load_model(config_from_dict({}).model, seed=0).model
    ent, k3_mu, k3_ref, count = 0.0, 0.0, 0.0, 0
    for r in records:
        ids = np.concatenate([r.prompt_ids, r.completion_ids])[None, :-1]
        logits = np.asarray(model.logits(model(jnp.asarray(ids))), np.float64)[0]
        logp_all = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1,
                                   keepdims=True)) - logits.max(-1, keepdims=True)
        rows = logp_all[r.prompt_ids.size - 1:]
        logp = rows[np.arange(r.completion_ids.size), r.completion_ids]
        ent += float(-(np.exp(rows) * rows).sum())
        lr = logp - r.mu_logprobs
        k3_mu += float((np.expm1(lr) - lr).sum())
        if r.ref_logprobs is not None:
            d = r.ref_logprobs - logp
            k3_ref += float((np.expm1(d) - d).sum())
        count += r.completion_ids.size
    rewards = np.array([r.reward for r in records])
    return {"entropy": ent / count, "kl/mu_k3": k3_mu / count, "kl/ref_k3": k3_ref / count,
            "reward/mean": rewards.mean(), "reward/std": rewards.std(),
            "completion_length": count / len(records)}


@pytest.mark.slow
@pytest.mark.parametrize("loss,with_ref", [("topr", False), ("off_rl_kl", True)])
def test_metrics_rows_carry_what_trl_users_read(tmp_path: Path, loss: str, with_ref: bool) -> None:
    from jaxrl_llm.data.shards import write_records

    records = _records(with_ref)
    extra = {"ref_logprobs": {"temperature": 1.0, "model": "test"}} if with_ref else {}
    write_records(tmp_path / "recs", records, scored_by="test", extra=extra)
    (tmp_path / "c.yaml").write_text(TRAIN + f"loss: {{name: {loss}}}\n")
    done = jaxrl(tmp_path, "train", "--config", "c.yaml", "--no-progress")
    assert done.returncode == 0, done.stderr
    (row,) = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    want = _reference(records)
    keys = ["entropy", "reward/mean", "reward/std", "completion_length",
            "kl/ref_k3" if with_ref else "kl/mu_k3"]
    for key in keys:
        assert row[key] == pytest.approx(want[key], rel=2e-4, abs=1e-5), key
    assert ("kl/mu_k3" in row) != with_ref  # off_rl_kl reads no μ; topr no π_ref
    assert row["throughput/tokens_per_s"] > 0  # the last (here: only) row was 0 before


@pytest.mark.slow
def test_eval_every_from_the_cli_logs_and_plots_held_out_pass_at_1(tmp_path: Path) -> None:
    from jaxrl_llm.data.shards import write_records

    (tmp_path / "my_tasks").mkdir()
    (tmp_path / "my_tasks" / "__init__.py").write_text("")
    (tmp_path / "my_tasks" / "vowels.py").write_text(MODULE)
    write_records(tmp_path / "recs", _records(False), scored_by="test")
    (tmp_path / "c.yaml").write_text(
        TRAIN.replace("steps: 1", "steps: 2") + "loss: {name: topr}\n"
        "data: {records: recs, task: 'my_tasks.vowels:make_task'}\n"
        "generate: {max_new_tokens: 4, batch_size: 4}\n"
        "eval: {n: 4, num_questions: 6, temperature: 1.0}\n"
        "train: {steps: 4, batch_size: 8, max_seq_len: 32, eval_every: 2}\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           "JAXRL_PROGRESS_INTERVAL_S": "0"}
    done = jaxrl(tmp_path, "train", "--config", "c.yaml", **env)
    assert done.returncode == 0, done.stderr
    # The bar says what the wait is for (it counts steps one late while a step evaluates).
    assert "evaluating step 0" in done.stderr and "evaluating step 4" in done.stderr
    rows = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    # log_every (default 10) > steps: one row per evaluation at its own step (0, 2, 4), each
    # with its own SE, never two evaluations averaged into one row.
    assert [r["step"] for r in rows] == [0, 2, 4]
    assert all("eval/pass_at_1_se" in r for r in rows) and "loss" not in rows[0]
    assert all("loss" in r for r in rows[1:])
    evaluated = rows[2]
    # The same evaluation of the final (step-4) checkpoint by `jaxrl-llm evaluate` (same seed).
    done = jaxrl(tmp_path, "evaluate", "--config", "c.yaml", "--model", "run", "--out", "ev", **env)
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "ev/eval.json").read_text())
    assert evaluated["eval/pass_at_1"] == pytest.approx(summary["pass_at_1"]["mean"])
    assert evaluated["eval/pass_at_1_se"] == pytest.approx(summary["pass_at_1"]["se"])
    assert evaluated["eval/invalid"] == pytest.approx(summary["proportions"]["invalid"])
    done = jaxrl(tmp_path, "report", "run")
    assert done.returncode == 0, done.stderr
    report = (tmp_path / "run/report/report.md").read_text()
    for title in ("Accuracy vs step", "Reward of the trained records", "Policy entropy",
                  "KL to the sampler μ and to π_ref", "Completion length", "Gradient norm",
                  "Learning rate"):
        assert f"### {title}" in report, title

    # DPO's pair accuracy (`loss/reward_accuracy`) is drawn in its own panel, labelled as pairs;
    # it was in "accuracy (fraction of samples correct)".
    from jaxrl_llm.eval.plots import series_panels
    from jaxrl_llm.eval.report import SERIES

    dpo_rows = [{"step": 1, "loss/reward_accuracy": 0.5}, {"step": 2, "loss/reward_accuracy": 0.75}]
    drawn = {stem: ylabel for stem, _, ylabel, patterns in SERIES if series_panels(dpo_rows, patterns, "_se")}
    assert list(drawn) == ["pair_accuracy"] and "pairs" in drawn["pair_accuracy"]


def test_eval_every_without_an_evaluation_is_refused_not_ignored(tmp_path: Path) -> None:
    from jaxrl_llm.config import config_from_dict
    from jaxrl_llm.core.errors import ConfigError
    from jaxrl_llm.data.shards import write_records
    from jaxrl_llm.train.trainer import Trainer

    write_records(tmp_path / "recs", _records(False), scored_by="test")
    config = config_from_dict({"run_dir": str(tmp_path / "run"), "train": {"eval_every": 1},
                               "data": {"records": str(tmp_path / "recs")}})
    with pytest.raises(ConfigError, match="train.eval_every"):
        Trainer(config)
