"""`jaxrl-llm evaluate` on an HF directory writes eval.json consistent with its samples."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxrl_llm.cli import main as cli_main
from jaxrl_llm.tasks import get_task


@pytest.mark.slow  # ≈ 25 s on 2 cores; evaluate keeps its held-out and CLI tests in the default run
def test_evaluate_hf_dir_writes_consistent_eval_json(tmp_path, capsys):
    from flax import nnx

    from jaxrl_llm.models.config import DecoderConfig
    from jaxrl_llm.models.decoder import Decoder
    from jaxrl_llm.models.tokenizer import char_tokenizer
    from jaxrl_llm.weights import hf

    tok = char_tokenizer()
    config = DecoderConfig(family="llama", vocab_size=len(tok), hidden_size=32,
                           intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                           max_position_embeddings=256)
    hf.save_pretrained(Decoder(config, rngs=nnx.Rngs(0)), tmp_path / "hf", tokenizer=tok)

    out = tmp_path / "eval"
    argv = ["evaluate", "--model", str(tmp_path / "hf"), "--task", "arithmetic", "--n", "4",
            "--num-questions", "3", "--out", str(out), "eval.max_new_tokens=6",
            "eval.temperature=1.0", "eval.batch_size=3", "eval.maj_k=[1,2,4]",
            "eval.bootstrap_trials=10", "--verifier", str(tmp_path / "hf"),
            "--verifications", "2"]
    assert cli_main(argv) == 0
    assert "pass@1" in capsys.readouterr().out
    summary = json.loads((out / "eval.json").read_text())
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert summary["n"] == 4 and summary["num_questions"] == 3 and len(rows) == 3
    assert summary["label"] == "hf" and summary["split"] == "test"

    # Re-grade every completion with the task: the flags and the numbers follow.
    task = get_task("arithmetic")
    problems = task.load(split="test", num=3, seed=0)
    correct = np.array([[task.score(p, c).correct for c in row["completions"]]
                        for p, row in zip(problems, rows)])
    invalid = np.array([[task.score(p, c).invalid for c in row["completions"]]
                        for p, row in zip(problems, rows)])
    assert correct.tolist() == [row["correct"] for row in rows]
    assert summary["pass_at_1"]["mean"] == correct.mean()
    assert summary["pass_at_k"]["1"] == correct.mean()
    assert summary["proportions"]["invalid"] == invalid.mean()
    assert sum(summary["cardinality"]) == 3
    assert set(summary["maj_at_k"]) == {"1", "2", "4"}
    # maj@n: the SE over the 3 questions of the majority-correct indicator, a number
    majority = summary["maj_at_k"]["4"]
    assert majority["se_method"] == "questions" and majority["se"] >= 0.0
    assert all(len(row["completions"]) == 4 for row in rows)
    # The (random) verifier's verdicts weight the vote; unparsable ones count as no vote.
    assert set(summary["weighted_sc"]) == {"at_n", "1", "2", "4"}
    assert 0.0 <= summary["verifier_invalid_rate"] <= 1.0
    # A vote can only pick a right answer where some sample has one.
    assert summary["weighted_sc"]["at_n"] <= summary["pass_at_k"]["4"]
