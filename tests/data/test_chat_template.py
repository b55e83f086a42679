"""`data.chat_template`: task prompts as a user turn of the tokenizer's chat template."""

from __future__ import annotations

import pytest

from jaxrl_llm.config import ConfigError
from jaxrl_llm.generate.completions import encode_prompts, format_prompts
from jaxrl_llm.models.tokenizer import build_char_tokenizer

PROMPT = "Question: What is 4 - 6?\nFinish with 'The answer is N.'\nAnswer:\n"


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from jaxrl_llm.weights.gguf import read_gguf
    from jaxrl_llm.weights.packaged import smollm2_gguf_path

    return read_gguf(smollm2_gguf_path())[2]


def test_smollm2_prompt_is_its_chatml_user_turn(smollm2_tokenizer):
    tok = smollm2_tokenizer
    # SmolLM2-Instruct's template (its model card): a default system turn, then the user turn,
    # then an opened assistant turn — written out here by hand.
    expected = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                "Hugging Face<|im_end|>\n<|im_start|>user\n" + PROMPT
                + "<|im_end|>\n<|im_start|>assistant\n")
    [text] = format_prompts(tok, [PROMPT], chat_template=True)
    assert text == expected
    [ids] = encode_prompts(tok, [text], chat_template=True)
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    # The template brings its own special tokens: no BOS prepended on top of <|im_start|>.
    assert ids[0] == im_start and ids[1] != im_start
    assert ids.count(im_start) == 3
    assert tok.decode(ids) == expected


def test_raw_prompts_are_unchanged(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert format_prompts(tok, [PROMPT]) == [PROMPT]
    assert encode_prompts(tok, [PROMPT]) == [list(tok.encode(PROMPT, add_special_tokens=True))]


def test_a_tokenizer_without_a_template_is_a_config_error():
    tok = build_char_tokenizer("0123456789 ", ("<pad>", "<bos>", "<eos>", "<unk>"))
    with pytest.raises(ConfigError, match="data.chat_template"):
        format_prompts(tok, [PROMPT], chat_template=True)


def test_the_notice_is_said_once_and_only_where_a_template_is_applied_unasked(capsys,
                                                                             monkeypatch):
    # Issue 55 item 16: it was printed wherever prompts were formatted, templates or not.
    from jaxrl_llm.generate import completions

    monkeypatch.setattr(completions, "_SAID", [])  # this process has said nothing yet
    plain = build_char_tokenizer("0123456789 ", ("<pad>", "<bos>", "<eos>", "<unk>"))
    encode_prompts(plain, format_prompts(plain, ["1 2"], chat_template=None), chat_template=None)
    assert capsys.readouterr().err == ""  # raw text: nothing to say
    chat = build_char_tokenizer("0123456789 ", ("<pad>", "<bos>", "<eos>", "<unk>"),
                                chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    for forced in (True, False):
        format_prompts(chat, ["1 2"], chat_template=forced)
    assert capsys.readouterr().err == ""  # set explicitly: the user chose
    for _ in range(2):  # every round of a run, the eval hook, ...: once a process
        encode_prompts(chat, format_prompts(chat, ["1 2"], chat_template=None), chat_template=None)
    err = capsys.readouterr().err
    assert err.count("data.chat_template is unset") == 1, err
    assert "has a chat template, so prompts go through it" in err
