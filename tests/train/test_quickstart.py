"""`jaxrl-llm quickstart` end to end with a tiny override, and `iterate`'s skip-on-re-run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from jaxrl_llm.cli import main as cli_main
from jaxrl_llm.config import load_config
from jaxrl_llm.flows.iterate import IterateConfig
from jaxrl_llm.flows.quickstart import QUICKSTART_DEFAULTS, QuickstartConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

TINY = [
    "model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1",
    "model.num_heads=2", "model.num_kv_heads=1", "tokenizer_vocab_size=300",
    "sft.steps=2", "sft.eval_every=2", "sft.num_prompts=16", "sft.batch_size=8",
    "sft.eval_questions=4", "sft.eval_n=2", "sft.target_pass_at_1=null",
    "train.steps=2", "train.batch_size=8", "train.log_every=1", "train.checkpoint_every=2",
    "generate.n=2", "generate.max_new_tokens=8", "generate.batch_size=4",
    "data.num_prompts=4", "eval.n=2", "eval.num_questions=4", "eval.maj_k=[1,2]",
    "eval.batch_size=4", "eval.bootstrap_trials=5", "iterate.iterations=1",
]


@pytest.mark.slow  # moved out of the default suite (10 min 27 s on 2026-11-28); CI runs it (30 s)
def test_quickstart_tiny_end_to_end_then_rerun_skips(tmp_path, capsys):
    run_dir = tmp_path / "qs"
    assert cli_main(["quickstart", "--no-progress", f"run_dir={run_dir}", *TINY]) == 0
    out = capsys.readouterr().out
    assert "before (π_0)" in out and "after iter 1" in out
    assert "transformers loads the export: ok (LlamaForCausalLM" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    paths = summary["paths"]
    for key in ("checkpoint", "export", "metrics", "plots", "report"):
        assert Path(paths[key]).exists(), key
        assert paths[key] in out
    assert (Path(paths["export"]) / "tokenizer.json").is_file()
    assert (Path(paths["plots"]) / "pass_at_k.png").is_file()
    for side in ("before", "after"):
        evaluation = summary[side]
        assert evaluation["n"] == 2 and evaluation["num_questions"] == 4
        total = sum(evaluation["proportions"].values())
        assert total == pytest.approx(1.0)
    stages = json.loads((run_dir / "iter_1" / "stages.json").read_text())
    assert list(stages) == ["generate", "score", "curate", "train", "export", "evaluate"]
    assert stages["train"]["steps"] == 2
    # 003's training-sample metrics, recomputed from the iteration's records.
    from jaxrl_llm.data.shards import read_records

    records = read_records(run_dir / "iter_1" / "records")
    solved = {r.group_id for r in records if r.correct}
    row = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert row["samples/cumulative_solve_rate"] == len(solved) / 4
    assert row["samples/accuracy"] == pytest.approx(sum(r.correct for r in records) / 8)
    sft = json.loads((run_dir / "sft" / "stages.json").read_text())
    assert sft["train"]["steps"] == 2 and "eval/pass_at_1" in sft["train"]["last"]
    # SFT reads no μ: no π/μ ratio metrics in its log; TOPR's has them.
    assert not any(k.startswith("loss/log_ratio") for k in sft["train"]["last"])
    assert "loss/log_ratio_mean_neg" in stages["train"]["last"]

    # The shipped quickstart config drives the stage commands too (its `iterate:`/`sft:` keys
    # are its own, not errors): evaluate the export on the quickstart's task.
    eval_dir = tmp_path / "eval_export"
    assert cli_main(["evaluate", "--config", str(CONFIGS / "quickstart.yaml"), "--model",
                     paths["export"], "--n", "2", "--num-questions", "3", "--out", str(eval_dir),
                     "eval.batch_size=6", "eval.bootstrap_trials=5", "eval.maj_k=[1,2]",
                     "eval.max_new_tokens=8"]) == 0
    evaluated = json.loads((eval_dir / "eval.json").read_text())
    assert evaluated["num_questions"] == 3 and evaluated["n"] == 2
    assert evaluated["task"] == yaml.safe_load((CONFIGS / "quickstart.yaml").read_text())["data"]["task"]

    # A re-run finds every stage complete and redoes none of them.
    assert cli_main(["quickstart", "--no-progress", f"run_dir={run_dir}", *TINY]) == 0
    assert json.loads((run_dir / "iter_1" / "stages.json").read_text()) == stages
    again = json.loads((run_dir / "summary.json").read_text())
    assert again["after"] == summary["after"] and again["before"] == summary["before"]


def test_shipped_configs_validate_and_match_the_built_in_defaults():
    shipped = yaml.safe_load((CONFIGS / "quickstart.yaml").read_text())
    assert shipped == QUICKSTART_DEFAULTS
    load_config(CONFIGS / "quickstart.yaml", schema=QuickstartConfig)
    for path in sorted(CONFIGS.glob("iterate_*.yaml")):
        config = load_config(path, schema=IterateConfig)
        assert config.iterate.iterations >= 1


@pytest.mark.slow
def test_iterate_command_two_pkpo_iterations(tmp_path, capsys):
    """`jaxrl-llm iterate`: iteration 2 samples from iteration 1's policy, k follows the
    schedule, and every stage lands in iter_i/."""
    config = {
        "run_dir": str(tmp_path / "it"), "seed": 1,
        "model": {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
                  "num_layers": 1, "num_heads": 2, "num_kv_heads": 1},
        "loss": {"name": "reinforce"},
        "train": {"steps": 2, "batch_size": 8, "max_seq_len": 160, "log_every": 1,
                  "checkpoint_every": 2},
        "generate": {"n": 4, "max_new_tokens": 8, "batch_size": 2},
        "data": {"task": "arithmetic", "num_prompts": 2, "reward_scheme": "01",
                 "group_transform": "pkpo"},
        "eval": {"n": 2, "num_questions": 2, "maj_k": [1, 2], "bootstrap_trials": 5,
                 "batch_size": 2},
        "iterate": {"iterations": 2, "pkpo_k": [4, 2]},
    }
    path = tmp_path / "iterate.yaml"
    path.write_text(yaml.safe_dump(config))
    assert cli_main(["iterate", "--config", str(path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "initial" in out and "iter 2" in out
    for index, k in ((1, 4), (2, 2)):
        stages = json.loads((tmp_path / "it" / f"iter_{index}" / "stages.json").read_text())
        assert list(stages) == ["generate", "score", "curate", "train", "export", "evaluate"]
        manifest = json.loads((tmp_path / "it" / f"iter_{index}" / "curated" / "manifest.json")
                              .read_text())
        assert manifest["extra"]["curation"]["pkpo_k"] == k
    rows = [json.loads(r) for r in (tmp_path / "it" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 2]
    # The cumulative solve rate (003), recomputed from the records themselves: a task is a
    # distinct prompt; after iteration i, the tasks with a correct sample in iterations ≤ i,
    # over all 2 × 2 tasks the run samples (fresh prompts each iteration).
    from jaxrl_llm.data.shards import read_records

    seen: set[tuple[int, ...]] = set()
    solved: set[tuple[int, ...]] = set()
    for index, row in zip((1, 2), rows, strict=True):
        records = read_records(tmp_path / "it" / f"iter_{index}" / "records")
        prompts = {tuple(r.prompt_ids.tolist()) for r in records}
        assert len(prompts) == 2 and not prompts & seen  # fresh prompts each iteration
        seen |= prompts
        solved |= {tuple(r.prompt_ids.tolist()) for r in records if r.correct}
        assert row["samples/cumulative_solve_rate"] == len(solved) / 4
        assert row["samples/accuracy"] == pytest.approx(
            sum(r.correct for r in records) / len(records))


def test_sft_stage_keeps_its_weight_whatever_the_rl_baseline():
    """The SFT warm start weighs a gold record by R − SFT_BASELINE whatever `loss.baseline` the
    RL iterations use: two quickstart configs that differ only there build the same SFT
    experiment (so choosing the RL baseline leaves π_0 alone)."""
    from jaxrl_llm.flows.quickstart import SFT_BASELINE, load_quickstart_config, sft_experiment

    a = sft_experiment(load_quickstart_config(None, []))
    b = sft_experiment(load_quickstart_config(None, ["loss.baseline=0.5"]))
    assert a.model_dump() == b.model_dump()
    assert a.loss.name == "sft" and a.loss.baseline == SFT_BASELINE == -0.3
    assert a.optim.learning_rate == QUICKSTART_DEFAULTS["sft"]["learning_rate"]


def test_quickstart_rl_loss_trains_on_positives_only():
    """The quickstart's TOPR baseline (README § Quickstart: measured): with A = R − c (TOPR eq. 7)
    and c = −1 a negative (R = −1) has A = 0, so the configured kernel's gradient on its tokens is
    0 whatever its ratio π/μ, and a positive's is −(1 − c)/|y| per token (its truncation [π/μ]₁¹
    weighs it 1) — written out here from the equation, the kernel called as the train step calls
    it (`spec.kernel_options`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl_llm.flows.quickstart import load_quickstart_config

    config = load_quickstart_config(None, [])
    c = config.loss.baseline
    assert c == -1.0
    spec = config.loss.spec
    options = spec.kernel_options(dict(config.loss))
    rng = np.random.default_rng(0)
    logmu = jnp.asarray(rng.normal(-1.0, 0.3, (4, 5)), jnp.float32)
    logp = logmu + jnp.asarray(rng.normal(0.0, 0.5, (4, 5)), jnp.float32)  # ratios ≠ 1
    mask = jnp.asarray([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]],
                       jnp.float32)
    rewards = jnp.asarray([1.0, -1.0, 1.0, -1.0])

    def total(lp):
        return spec.kernel(lp, logmu, mask, rewards, baseline=c, **options).total

    grad = np.asarray(jax.grad(total)(logp))
    lengths = np.asarray(mask).sum(1)
    expected = np.zeros((4, 5))
    for b in (0, 2):  # the positives
        expected[b] = -(1.0 - c) / lengths[b] * np.asarray(mask)[b]
    np.testing.assert_allclose(grad, expected, rtol=1e-6, atol=1e-7)
