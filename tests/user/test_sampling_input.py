"""Issue 44, bad input to the sampler as a user meets it: a prompt longer than the model's
context and max_new_tokens ≤ 0 are refused with the key to change, before anything compiles,
and nothing is written as if complete."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.user.cli import jaxrl

CONFIG = ("run_dir: run\nmesh: {data: 1}\nloss: {name: topr}\n"
          "model: {max_position_embeddings: 16}\n"
          "generate: {n: 2, max_new_tokens: 4, batch_size: 4, output: recs}\n"
          "data: {num_prompts: 4, records: recs}\n")


@pytest.mark.slow  # two CLI processes
def test_generate_refuses_prompts_over_the_context_and_no_new_tokens(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text(CONFIG)
    done = jaxrl(tmp_path, "generate", "--config", "c.yaml")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "more than the model's context of 16 (model.max_position_embeddings)" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "recs").exists()
    done = jaxrl(tmp_path, "generate", "--config", "c.yaml", "generate.max_new_tokens=0")
    assert done.returncode == 2 and "generate.max_new_tokens" in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "recs").exists()
