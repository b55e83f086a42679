"""TurnRenderer: prompt + model tokens + observations equal the chat template's own
tokenisation of the whole conversation, and the model's tokens are never re-tokenised."""

from __future__ import annotations

import json

import pytest

from jaxrl_llm.envs.calculator import CALCULATOR
from jaxrl_llm.envs.render import TemplateError, TurnRenderer
from tests.envs.helpers import qwen_tokenizer, smollm2_tokenizer

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 7"}}\n</tool_call>'
FINAL = "So 12 * 7 is 84. The answer is 84."


def _ids(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def _model_turn(tok, renderer, text: str) -> list[int]:
    """A model turn as a sampler gives it: the text's tokens, then the end-of-turn token."""
    return _ids(tok, text) + [renderer.end_of_turn_id]


def _episode_ids(tok, renderer, system, user, turns) -> list[int]:
    """prompt_ids + (model turn + observation)* + last model turn."""
    ids = renderer.prompt_ids(system, user)
    for model_text, messages in turns:
        ids += _model_turn(tok, renderer, model_text)
        if messages:
            ids += renderer.observation_ids(messages)
    return ids


def test_qwen25_template_lists_tools_and_deltas_equal_the_whole_conversation():
    tok = qwen_tokenizer()
    renderer = TurnRenderer(tok, chat_template=None, tools=[CALCULATOR])
    assert renderer.native_tools  # Qwen2.5's template renders tools= itself
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert renderer.stop_ids == (im_end, tok.eos_token_id)
    tool_msg = {"role": "tool", "name": "calculator", "content": "84"}
    ours = _episode_ids(tok, renderer, "Be brief.", "What is 12 * 7?",
                        [(CALL, [tool_msg]), (FINAL, None)])
    # The reference: the template renders the whole conversation, tokenised in one go.
    conversation = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "What is 12 * 7?"},
                    {"role": "assistant", "content": CALL}, tool_msg,
                    {"role": "assistant", "content": FINAL}]
    text = tok.apply_chat_template(conversation, tools=[CALCULATOR.schema], tokenize=False)
    reference = _ids(tok, text)
    assert reference[:len(ours)] == ours
    assert tok.decode(reference[len(ours):]) == "\n"  # the template's newline after the turn
    assert json.dumps(CALCULATOR.schema) in tok.decode(ours)  # tools listed by the template


def test_observation_is_template_tokens_after_the_end_of_turn():
    tok = qwen_tokenizer()
    renderer = TurnRenderer(tok, chat_template=True, tools=[CALCULATOR])
    obs = renderer.observation_ids([{"role": "tool", "content": "84"},
                                    {"role": "tool", "content": "7"}])
    # Written out by hand from Qwen2.5's template: consecutive tool results share a user turn.
    expected = ("\n<|im_start|>user\n<tool_response>\n84\n</tool_response>\n<tool_response>\n7"
                "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(obs) == expected
    assert obs == _ids(tok, expected)


def test_smollm2_template_without_tools_gets_the_hermes_system_turn():
    tok = smollm2_tokenizer()
    renderer = TurnRenderer(tok, chat_template=None, tools=[CALCULATOR])
    assert not renderer.native_tools  # SmolLM2's ChatML template ignores tools=
    assert renderer.stop_ids == (tok.convert_tokens_to_ids("<|im_end|>"),)  # its EOS too
    prompt = tok.decode(renderer.prompt_ids("Be brief.", "What is 12 * 7?"))
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert f"<tools>\n{json.dumps(CALCULATOR.schema)}\n</tools>" in prompt
    assert prompt.endswith("<|im_start|>user\nWhat is 12 * 7?<|im_end|>\n<|im_start|>assistant\n")
    ours = _episode_ids(tok, renderer, "Be brief.", "What is 12 * 7?",
                        [(CALL, [{"role": "tool", "content": "84"}]), (FINAL, None)])
    system = prompt[len("<|im_start|>system\n"):prompt.index("<|im_end|>")]
    conversation = [{"role": "system", "content": system},
                    {"role": "user", "content": "What is 12 * 7?"},
                    {"role": "assistant", "content": CALL},
                    {"role": "user", "content": "<tool_response>\n84\n</tool_response>"},
                    {"role": "assistant", "content": FINAL}]
    reference = _ids(tok, tok.apply_chat_template(conversation, tokenize=False))
    assert reference[:len(ours)] == ours and tok.decode(reference[len(ours):]) == "\n"


def test_user_feedback_turns_on_smollm2():
    tok = smollm2_tokenizer()
    renderer = TurnRenderer(tok, chat_template=True, tools=[])
    feedback = [{"role": "user", "content": "That is not a solution: evaluates to 3, not 24."}]
    ours = _episode_ids(tok, renderer, None, "Make 24.",
                        [("<answer> 1 + 2 </answer>", feedback), ("<answer> 4 * 6 </answer>", None)])
    conversation = [{"role": "user", "content": "Make 24."},
                    {"role": "assistant", "content": "<answer> 1 + 2 </answer>"}, *feedback,
                    {"role": "assistant", "content": "<answer> 4 * 6 </answer>"}]
    reference = _ids(tok, tok.apply_chat_template(conversation, tokenize=False))
    assert reference[:len(ours)] == ours


def test_without_a_template_the_plain_format():
    tok = qwen_tokenizer(None)
    renderer = TurnRenderer(tok, chat_template=None, tools=[])
    assert not renderer.templated and renderer.stop_ids == (tok.eos_token_id,)
    prompt = renderer.prompt_ids("Be brief.", "What is 2 + 2?")
    assert tok.decode(prompt) == "Be brief.\n\nWhat is 2 + 2?"
    obs = renderer.observation_ids([{"role": "user", "content": "Try again."}])
    assert tok.decode(obs) == "\nuser: Try again.\nassistant: "


def test_template_without_an_end_of_turn_token_is_refused():
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant: {% endif %}")
    tok = qwen_tokenizer(template)
    with pytest.raises(TemplateError, match="not a special token"):
        TurnRenderer(tok, chat_template=True, tools=[])


def test_template_forced_but_missing():
    with pytest.raises(TemplateError, match="no chat template"):
        TurnRenderer(qwen_tokenizer(None), chat_template=True, tools=[])
