"""Messages <-> token ids for episodes, never re-tokenising the model's tokens.

The model's tokens stay exactly as sampled. What the environment adds between two model turns
— the chat template's close of the assistant turn, the tool or user turn, and the next
assistant generation prompt — comes from the template itself, as a delta of two renderings
around a fixed dummy assistant turn: the text after the dummy turn's end-of-turn token, in the
rendering that appends the environment's messages and the generation prompt. Template tokens
are split from the model's text by special tokens (`<|im_end|>`, `<|im_start|>`), so the ids of
prompt + model turns + observations equal the template's own tokenisation of the whole
conversation wherever the model's text tokenises back to its own tokens.

Tools are listed by the template (`tools=` in `apply_chat_template`) when it renders them;
otherwise (e.g. SmolLM2's ChatML template) in the system turn in the Hermes format, with tool
results sent as user turns of `<tool_response>` blocks. Without a chat template
(`data.chat_template: false`) the text is plain: the prompt as `format_prompts` writes it, and
each observation "\\n<role>: <content>\\n" per message, then the cue "assistant: ".
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from jaxrl_llm.envs.tools import Tool

DUMMY = "<<jaxrl-llm: dummy assistant turn>>"  # a fixed turn the deltas are taken around
PLAIN_CUE = "assistant: "

HERMES_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


class TemplateError(ValueError):
    """A chat template the token deltas cannot work with; the message says why."""


def hermes_system(system: str | None, tools: Sequence[Tool]) -> str:
    """The system turn with the tools listed in the Hermes format (as Qwen2.5's template)."""
    block = HERMES_TOOLS.format(tools="\n".join(json.dumps(t.schema) for t in tools))
    return f"{system}\n\n{block}" if system else block


def hermes_messages(messages: Sequence[dict[str, str]]) -> list[dict[str, str]]:
    """Tool results as user turns of `<tool_response>` blocks (consecutive ones joined)."""
    out: list[dict[str, str]] = []
    previous = None
    for m in messages:
        if m["role"] != "tool":
            out.append({"role": m["role"], "content": m["content"]})
        elif previous == "tool":
            out[-1]["content"] += f"\n<tool_response>\n{m['content']}\n</tool_response>"
        else:
            out.append({"role": "user",
                        "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        previous = m["role"]
    return out


class TurnRenderer:
    """Token ids of an episode's prompt and of each environment response."""

    def __init__(self, tokenizer: Any, *, chat_template: bool | None, tools: Sequence[Tool] = ()):
        self.tokenizer = tokenizer
        self.tools = list(tools)
        has_template = bool(getattr(tokenizer, "chat_template", None))
        self.templated = has_template if chat_template is None else bool(chat_template)
        if self.templated and not has_template:
            raise TemplateError("data.chat_template=true but the tokenizer has no chat template")
        eos = getattr(tokenizer, "eos_token_id", None)
        if self.templated:
            self.native_tools = bool(self.tools) and self._renders_tools()
            self.end_of_turn_text, self.end_of_turn_id = self._end_of_turn()
        else:
            if eos is None:
                raise TemplateError("without a chat template a model turn ends at EOS, but the "
                                    "tokenizer has no eos_token_id")
            self.native_tools = False
            self.end_of_turn_text, self.end_of_turn_id = "", int(eos)
        # token ids that end a model turn: the template's end of turn, and EOS
        self.stop_ids: tuple[int, ...] = tuple(dict.fromkeys(
            [self.end_of_turn_id] + ([int(eos)] if eos is not None else [])))

    # -- the template ------------------------------------------------------------------------

    def _render(self, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
        kwargs: dict[str, Any] = {}
        if self.native_tools:
            kwargs["tools"] = [t.schema for t in self.tools]
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs)

    def _renders_tools(self) -> bool:
        """Whether the template lists tools given as `tools=` (else the Hermes fallback)."""
        turn = [{"role": "user", "content": "x"}]
        plain = self.tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
        with_tools = self.tokenizer.apply_chat_template(
            turn, tools=[t.schema for t in self.tools], tokenize=False, add_generation_prompt=True)
        return with_tools != plain

    def _conversation(self) -> list[dict[str, str]]:
        system = None if self.native_tools or not self.tools else hermes_system(None, self.tools)
        head = [{"role": "system", "content": system}] if system else []
        return head + [{"role": "user", "content": "x"}, {"role": "assistant", "content": DUMMY}]

    def _end_of_turn(self) -> tuple[str, int]:
        """The special token right after an assistant turn's text in the template."""
        text = self._render(self._conversation(), generation_prompt=False)
        if text.count(DUMMY) != 1:
            raise TemplateError("the chat template does not render an assistant turn's text "
                                "verbatim; multi-turn episodes need it to")
        tail = text[text.index(DUMMY) + len(DUMMY):]
        ids = self.tokenizer.encode(tail, add_special_tokens=False) if tail else []
        special = set(getattr(self.tokenizer, "all_special_ids", [])) | set(
            getattr(self.tokenizer, "added_tokens_decoder", {}))
        if not ids or ids[0] not in special:
            raise TemplateError(f"the chat template ends an assistant turn with {tail[:40]!r}, "
                                "not a special token: no end-of-turn token to stop a model turn")
        eot = self.tokenizer.decode([ids[0]], skip_special_tokens=False)
        if not tail.startswith(eot):
            raise TemplateError(f"end-of-turn token {eot!r} does not start {tail[:40]!r}")
        return eot, int(ids[0])

    # -- the interface -----------------------------------------------------------------------

    def prompt_ids(self, system: str | None, user: str) -> list[int]:
        """The episode's prompt, ending with the assistant generation prompt."""
        if self.tools and not self.native_tools:
            system = hermes_system(system, self.tools)
        if not self.templated:
            text = f"{system}\n\n{user}" if system else user  # as generate.format_prompts
            return list(self.tokenizer.encode(text, add_special_tokens=True))
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user}]
        text = self._render(messages, generation_prompt=True)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def observation_text(self, messages: Sequence[dict[str, str]]) -> str:
        """The text after the model's end-of-turn token, through the next generation prompt."""
        if not self.templated:
            return "".join(f"\n{m['role']}: {m['content']}\n" for m in messages) + PLAIN_CUE
        added = list(messages) if self.native_tools else hermes_messages(messages)
        added = [{"role": m["role"], "content": m["content"], **(
            {"name": m["name"]} if "name" in m else {})} for m in added]
        base = self._render(self._conversation(), generation_prompt=False)
        full = self._render(self._conversation() + added, generation_prompt=True)
        cut = base.index(DUMMY) + len(DUMMY) + len(self.end_of_turn_text)
        if full[:cut] != base[:cut]:
            raise TemplateError("the chat template renders earlier turns differently once an "
                                "environment turn follows; token deltas need a stable prefix")
        return full[cut:]

    def observation_ids(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Token ids of `observation_text`: template and environment tokens only."""
        return list(self.tokenizer.encode(self.observation_text(messages),
                                          add_special_tokens=False))
