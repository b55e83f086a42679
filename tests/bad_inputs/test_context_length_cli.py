"""A row longer than the model's context (its max_position_embeddings, after `model.rope_scaling`)
is refused through the public command, as a user meets it (`jaxrl-llm` in a subprocess, a
temporary cwd, relative paths): exit 2, no traceback, a message naming both figures and the
keys that fix it, before any weights load or compile, nothing written.

train: `train.max_seq_len` over an HF checkpoint's 128 positions, and the same row accepted once
`model.rope_scaling` (YaRN, factor × 128) covers it; random models: `model.max_position_embeddings`.
generate (JAX sampler): `generate.max_new_tokens` alone past the context (before the weights
load), then the longest prompt + `generate.max_new_tokens`. score: records whose rows are longer
than the model's context. (vLLM: tests/vllm/test_vllm_bad_inputs.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxrl_llm.data.shards import write_records
from tests.bad_inputs.test_bad_models_cli import write_hf
from tests.data.helpers import make_records
from tests.user.cli import jaxrl

pytestmark = pytest.mark.slow  # CLI subprocesses, a few seconds each

TRAIN = ("run_dir: run\nloss: {name: topr}\ndata: {records: recs}\n"
         "train: {steps: 1, batch_size: 8, max_seq_len: 256}\n")


def refused(cwd: Path, *args: str, named: tuple[str, ...]) -> str:
    done = jaxrl(cwd, *args)
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    for text in named:
        assert text in done.stderr, (text, done.stderr[-2000:])
    assert not (cwd / "run").exists() and not (cwd / "out").exists()
    return done.stderr


@pytest.fixture
def cwd(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    write_hf("hf128")  # a Llama config.json with max_position_embeddings 128, no RoPE scaling
    write_records("recs", make_records(16, group_size=4), records_per_shard=8)
    (tmp_path / "c.yaml").write_text(TRAIN)
    return tmp_path


def test_train_rows_past_a_checkpoints_context(cwd) -> None:
    model = ["model.source=hf", "model.path=hf128"]
    refused(cwd, "train", "--config", "c.yaml", *model,
            named=("train.max_seq_len=256", "max_position_embeddings=128",
                   str(Path("hf128") / "config.json"), "lower train.max_seq_len",
                   "model.rope_scaling"))
    # YaRN over the file's 128 positions: 1.5 × 128 = 192 still falls short of 256 ...
    yarn = "model.rope_scaling={rope_type: yarn, original_max_position_embeddings: 128, factor: %s}"
    refused(cwd, "train", "--config", "c.yaml", *model, yarn % 1.5,
            named=("train.max_seq_len=256", "max_position_embeddings=192",
                   "after model.rope_scaling"))
    # ... 2 × 128 = 256 covers it: the same rows train
    done = jaxrl(cwd, "train", "--config", "c.yaml", *model, yarn % 2.0, "--no-progress")
    assert done.returncode == 0 and "trained 1 steps" in done.stdout, done.stderr[-2000:]


def test_train_rows_past_a_random_models_context(cwd) -> None:
    refused(cwd, "train", "--config", "c.yaml", "model.max_position_embeddings=64",
            named=("train.max_seq_len=256", "max_position_embeddings=64",
                   "raise model.max_position_embeddings"))


def test_generate_past_the_context(cwd) -> None:
    from jaxrl_llm.models.tokenizer import char_tokenizer
    from jaxrl_llm.tasks.arithmetic import ArithmeticTask

    gen = ["generate", "--config", "c.yaml", "--out", "out", "data.num_prompts=4",
           "model.max_position_embeddings=256", "generate.n=1", "generate.batch_size=4"]
    # no prompt can fit: refused before the model is built
    refused(cwd, *gen, "generate.max_new_tokens=256",
            named=("generate.max_new_tokens=256", "max_position_embeddings=256"))
    # the prompts fit, the prompt + the new tokens do not
    tok = char_tokenizer()
    task = ArithmeticTask()
    longest = max(len(tok(task.prompt(p))["input_ids"])
                  for p in task.load(split="train", num=4, seed=0))
    assert longest < 256 - 1
    new = 256 - longest + 1
    refused(cwd, *gen, f"generate.max_new_tokens={new}",
            named=(f"generate.max_new_tokens={new}", f"{longest + new} positions",
                   "context of 256", f"at most {256 - longest}", "model.rope_scaling"))


def test_score_records_longer_than_the_context(cwd) -> None:
    from jaxrl_llm.data.shards import RecordSource

    rows = [r.prompt_ids.size + r.completion_ids.size - 1 for r in RecordSource("recs")]
    longest = max(rows)
    assert longest > 8
    refused(cwd, "score", "--config", "c.yaml", "--out", "out",
            "model.max_position_embeddings=8",
            named=(f"a row of {longest} tokens", "max_position_embeddings=8",
                   "recs/records-", "model.rope_scaling"))
