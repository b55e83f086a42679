"""Tiny quickstart tokenizers and the GGUF-metadata BPE builder (no model, no torch)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from jaxrl_llm.models.tokenizer import (
    GGUFTokenizerMetadata,
    TokenizerMetadataError,
    build_char_tokenizer,
    tokenizer_from_gguf_metadata,
    train_bpe_tokenizer,
)

CHAT_TEMPLATE = (
    "{% for m in messages %}<bos>{{ m['role'] }}: {{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<bos>assistant: {% endif %}"
)
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")


def test_char_tokenizer_ids_follow_specials_then_alphabet():
    alphabet = "0123456789+-= "
    tok = build_char_tokenizer(alphabet, SPECIALS)
    expected = {s: i for i, s in enumerate(SPECIALS)} | {
        c: len(SPECIALS) + i for i, c in enumerate(alphabet)
    }
    assert tok.get_vocab() == expected
    assert tok("12+7=")["input_ids"] == [expected[c] for c in "12+7="]
    assert tok.decode(tok("3 - 4 = 9")["input_ids"]) == "3 - 4 = 9"
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    # A character outside the alphabet becomes <unk>, never silently dropped.
    assert tok("1x2")["input_ids"] == [expected["1"], 3, expected["2"]]
    # Special tokens written in text stay whole.
    assert tok("<bos>1<eos>")["input_ids"] == [1, expected["1"], 2]


def test_char_tokenizer_rejects_bad_alphabet():
    with pytest.raises(ValueError, match="single characters"):
        build_char_tokenizer(["ab", "c"], SPECIALS)
    with pytest.raises(ValueError, match="duplicates"):
        build_char_tokenizer("abc", ("<pad>", "<pad>"))


def test_char_tokenizer_save_and_autotokenizer_reload(tmp_path):
    tok = build_char_tokenizer("abc123 :", SPECIALS, chat_template=CHAT_TEMPLATE)
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    text = "abc 123 cab"
    assert again(text)["input_ids"] == tok(text)["input_ids"]
    assert again.eos_token == "<eos>" and again.pad_token == "<pad>"
    messages = [{"role": "user", "content": "1 2"}]
    rendered = again.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<bos>user: 1 2<eos><bos>assistant: "


def test_trained_bpe_round_trips_any_text_and_reloads(tmp_path):
    corpus = [f"What is {a} + {b}? The answer is {a + b}." for a in range(40) for b in range(40)]
    tok = train_bpe_tokenizer(corpus, vocab_size=300, specials=SPECIALS,
                              chat_template=CHAT_TEMPLATE)
    assert len(tok) <= 300
    assert tok.convert_tokens_to_ids(list(SPECIALS)) == [0, 1, 2, 3]
    # Frequent words were merged into single tokens by training.
    assert len(tok("What is")["input_ids"]) < len("What is")
    # Digits are always single tokens (split before BPE).
    digits = tok.convert_ids_to_tokens(tok(" 1234567")["input_ids"])
    assert digits[-7:] == list("1234567")
    # Byte-level: text never seen in training (unicode, emoji) still round-trips exactly.
    for text in ["héllo wörld 日本 🤖", "  two  spaces\n\ttab", "x=3*4"]:
        assert tok.decode(tok(text)["input_ids"]) == text
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    sample = "What is 12 + 30? The answer is 42."
    assert again(sample)["input_ids"] == tok(sample)["input_ids"]
    assert again.decode(again(sample)["input_ids"]) == sample


def test_bpe_vocab_too_small_is_an_error():
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe_tokenizer(["abc"], vocab_size=100, specials=SPECIALS)


def _toy_gguf_metadata(**changes) -> GGUFTokenizerMetadata:
    # A byte-level BPE where "Ġ" is the space byte; merges build "ab" and "Ġab".
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "Ġ", "1", "2", "ab", "Ġab"]
    fields = dict(model="gpt2", pre="smollm", tokens=tokens, merges=["a b", "Ġ ab"],
                  token_types=[3, 3, 3] + [1] * 7, bos_token_id=1, eos_token_id=2,
                  unk_token_id=0, pad_token_id=2, chat_template="{{ messages[0]['content'] }}")
    fields.update(changes)
    return GGUFTokenizerMetadata(**fields)


def test_gguf_metadata_tokenizer_on_a_toy_vocabulary():
    tok = tokenizer_from_gguf_metadata(_toy_gguf_metadata())
    # "ab ab" -> "ab", "Ġab" by the two merges; "12" splits into digits; specials stay whole.
    assert tok("ab ab")["input_ids"] == [8, 9]
    assert tok("<|im_start|>ab12<|im_end|>")["input_ids"] == [1, 8, 6, 7, 2]
    assert tok.decode([8, 9]) == "ab ab"
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"


def test_gguf_metadata_tokenizer_adds_bos_when_asked():
    tok = tokenizer_from_gguf_metadata(_toy_gguf_metadata(add_bos_token=True))
    assert tok("ab")["input_ids"] == [1, 8]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model": "llama"}, "tokenizer.ggml.model='llama'"),
        ({"pre": "mystery"}, "tokenizer.ggml.pre='mystery'"),
        ({"merges": []}, "merges"),
        ({"merges": ["a b c"]}, r"merges\[0\]"),
        ({"bos_token_id": 99}, "bos_token_id=99"),
        ({"token_types": [1, 1]}, "token_type has 2"),
    ],
)
def test_gguf_metadata_errors_name_the_field(changes, message):
    with pytest.raises(TokenizerMetadataError, match=message):
        tokenizer_from_gguf_metadata(_toy_gguf_metadata(**changes))
