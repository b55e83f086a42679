"""GGUF export (`jaxrl-llm export --format gguf`): the file loads in transformers' own GGUF
loader (an independent reader, PyTorch) and in ours (`weights/gguf.py`), with the same logits
and greedy tokens as the model that was written.

Tolerances (max |Δlogit| relative to max |logit|): the two readers of one file agree to 1e-5
(both dequantise the same stored values); against the float32 model, f16 storage to 5e-3 and
q8_0 (8-bit blocks of 32 with an f16 scale) to 3e-2.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from flax import nnx

from jaxrl_llm.cli import main as cli_main
from jaxrl_llm.data.records import Record
from jaxrl_llm.data.shards import write_records
from jaxrl_llm.models.config import DecoderConfig
from jaxrl_llm.models.decoder import Decoder
from jaxrl_llm.models.tokenizer import build_char_tokenizer, train_bpe_tokenizer
from jaxrl_llm.weights.gguf import load_gguf, read_gguf
from jaxrl_llm.weights.gguf_export import GGUFExportError, write_gguf

TEXTS = ["What is 12 + 7? The answer is 19.", "hello world, héllo wörld", "3 * (4 - 1) = 9"]
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
TOL = {"f16": 5e-3, "q8_0": 3e-2}
PROMPT = np.array([[1, 40, 41, 60, 75, 90, 120, 200]], np.int64)


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe_tokenizer(TEXTS * 10, 300, chat_template=TEMPLATE)


def _config(tied: bool, **overrides) -> DecoderConfig:
    fields = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, tie_embeddings=tied, rope_theta=10_000.0,
                  rms_norm_eps=1e-5, max_position_embeddings=128, bos_token_id=1,
                  eos_token_id=2)
    return DecoderConfig(**{**fields, **overrides})


def _model(tied: bool, seed: int = 0) -> Decoder:
    return Decoder(_config(tied), rngs=nnx.Rngs(seed))


@nnx.jit
def _forward(model, tokens):
    return model.logits(model(tokens))


def _ours_logits(model, tokens: np.ndarray) -> np.ndarray:
    return np.asarray(_forward(model, tokens.astype(np.int32)))


def _ours_greedy(model, tokens: np.ndarray, steps: int) -> list[int]:
    """Greedy decoding by full forwards over one fixed-length buffer (causal: the padding
    after position t does not change the logits at t), so it compiles once."""
    length = tokens.shape[1]
    seq = np.concatenate([tokens, np.zeros((1, steps), tokens.dtype)], axis=1)
    for t in range(length, length + steps):
        seq[0, t] = int(np.argmax(_ours_logits(model, seq)[0, t - 1]))
    return seq[0, length:].tolist()


def _transformers(path: Path):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return torch, model, tok


def _check_file(path: Path, model: Decoder, tokenizer, gguf_type: str) -> None:
    """Both readers against each other and against `model`: logits, greedy tokens, ids."""
    torch, theirs, their_tok = _transformers(path)
    loaded = load_gguf(path)
    with torch.no_grad():
        hf_logits = theirs(torch.from_numpy(PROMPT)).logits.numpy()
        hf_greedy = theirs.generate(torch.from_numpy(PROMPT), max_new_tokens=6, do_sample=False,
                                    attention_mask=torch.ones_like(torch.from_numpy(PROMPT)),
                                    eos_token_id=None, pad_token_id=0
                                    )[0, PROMPT.shape[1]:].tolist()
    back = _ours_logits(loaded.model, PROMPT)
    want = _ours_logits(model, PROMPT)
    scale = np.abs(want).max()
    np.testing.assert_allclose(hf_logits, back, atol=1e-5 * scale)
    assert np.abs(back - want).max() <= TOL[gguf_type] * scale
    assert _ours_greedy(loaded.model, PROMPT, 6) == hf_greedy
    if gguf_type == "f16":
        assert hf_greedy == _ours_greedy(model, PROMPT, 6)
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert their_tok(text, add_special_tokens=False)["input_ids"] == ids
        assert loaded.tokenizer(text)["input_ids"] == ids
    reader, info, _ = read_gguf(path)
    assert info.chat_template == TEMPLATE
    kinds = set(info.tensor_types.values())
    assert kinds == {"F32", {"f16": "F16", "q8_0": "Q8_0"}[gguf_type]}
    assert info.metadata["llama.attention.head_count_kv"] == 2
    # One token per embedding row, as llama.cpp needs: padded up to vocab_size.
    assert len(reader.fields["tokenizer.ggml.token_type"].data) == 320


@pytest.mark.parametrize("gguf_type, tied", [("f16", False), ("q8_0", True)])
def test_gguf_file_matches_in_transformers_and_ours(tmp_path, tokenizer, gguf_type, tied):
    model = _model(tied)
    path = write_gguf(model, tmp_path / f"m-{gguf_type}.gguf", tokenizer=tokenizer,
                      gguf_type=gguf_type)
    _check_file(path, model, tokenizer, gguf_type)


@pytest.mark.parametrize("overrides, gguf_type, named", [
    ({"family": "qwen2"}, "f16", "GGUF type 'f16' is not supported for architecture 'qwen2'"),
    ({"family": "gemma2"}, "q8_0", "GGUF type 'q8_0' is not supported for architecture 'gemma2'"),
    ({}, "q4_k", "GGUF type 'q4_k' is not supported"),
    ({"hidden_size": 48, "num_heads": 4, "num_kv_heads": 2}, "q8_0", "hidden_size"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "f16", "rope_scaling"),
])
def test_unsupported_is_a_clear_error_and_no_file(tmp_path, tokenizer, overrides, gguf_type,
                                                  named):
    # Abstract (no values): the checks run before any weight is read.
    model = nnx.eval_shape(lambda: Decoder(_config(False, **overrides), rngs=nnx.Rngs(0)))
    with pytest.raises(GGUFExportError, match=named):
        write_gguf(model, tmp_path / "x.gguf", tokenizer=tokenizer, gguf_type=gguf_type)
    assert not (tmp_path / "x.gguf").exists()


def test_char_tokenizer_is_refused(tmp_path):
    with pytest.raises(GGUFExportError, match="not byte-level BPE"):
        write_gguf(nnx.eval_shape(lambda: _model(True)), tmp_path / "x.gguf",
                   tokenizer=build_char_tokenizer("abc"))


@pytest.mark.slow  # a short training run to make the checkpoint (~30 s on 2 cores)
def test_export_command_writes_gguf(tmp_path, tokenizer, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    tokenizer.save_pretrained("tok")
    rng = np.random.default_rng(0)
    records = [Record(prompt_ids=np.array([1, 5 + i]), completion_ids=rng.integers(3, 280, 6),
                      reward=1.0 if i % 2 else -1.0, correct=bool(i % 2), group_id=i,
                      mu_logprobs=np.full(6, -5.0, np.float32)) for i in range(8)]
    write_records("recs", records, vocab_size=320)
    Path("exp.yaml").write_text(yaml.safe_dump({
        "run_dir": "run", "seed": 0,
        "model": {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
                  "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "tie_embeddings": False},
        "optim": {"learning_rate": 1e-2}, "data": {"records": "recs", "tokenizer": "tok"},
        "train": {"steps": 1, "batch_size": 8, "max_seq_len": 8, "log_every": 1},
    }))
    assert cli_main(["train", "--config", "exp.yaml", "--no-progress"]) == 0
    from jaxrl_llm.train.checkpoint import restore_model

    trained = restore_model("run").model
    assert cli_main(["export", "--checkpoint", "run", "--format", "gguf", "--gguf-type", "q8_0",
                     "--out", "out/model-q8_0.gguf"]) == 0
    _check_file(tmp_path / "out" / "model-q8_0.gguf", trained, tokenizer, "q8_0")
    assert cli_main(["export", "--checkpoint", "run", "--format", "gguf",
                     "--out", "out/model-f16.gguf"]) == 0
    _check_file(tmp_path / "out" / "model-f16.gguf", trained, tokenizer, "f16")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "model-f16.gguf", "model-q8_0.gguf"]  # no temporary files left
    with pytest.raises(FileExistsError, match="--overwrite"):
        cli_main(["export", "--checkpoint", "run", "--format", "gguf",
                  "--out", "out/model-f16.gguf"])
    capsys.readouterr()
    build_char_tokenizer("abc123").save_pretrained("chartok")
    assert cli_main(["export", "--checkpoint", "run", "--format", "gguf", "--tokenizer",
                     "chartok", "--out", "out/char.gguf"]) == 2
    assert "not byte-level BPE" in capsys.readouterr().err
    assert not (tmp_path / "out" / "char.gguf").exists()
