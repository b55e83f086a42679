"""Tool-call parsers: a model turn's text -> the tool calls in it, and what could not be read.

Named in the config (`env.tool_parser`): `hermes`, the format of Qwen2/2.5/3 and the Hermes
models (and of the system-prompt fallback in `envs/render.py`):

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2 + 2"}}
    </tool_call>

or an import path "package.module:function" to a function with the same signature as
`parse_hermes`. A parser never raises on model text: malformed JSON, a missing name or
arguments that are not an object become `ParsedTurn.errors`, which the environment sends back
as error observations. Scanning is linear in the text (no backtracking regex), and JSON
nested too deep to read is an error, not a crash.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from jaxrl_llm.tasks.registry import resolve_import_path

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
    """The calls of one model turn, in order, and one message per call that did not parse."""

    calls: list[ToolCall]
    errors: list[str]

    @property
    def empty(self) -> bool:
        """No call and no attempt at one: the turn is a final answer."""
        return not self.calls and not self.errors


def _read_call(body: str, index: int) -> ToolCall | str:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as err:  # RecursionError: nesting too deep
        return f"tool call {index}: malformed JSON ({str(err)[:120]})"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return (f"tool call {index}: expected an object "
                '{"name": <function-name>, "arguments": <args-json-object>}')
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # some models send the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return f"tool call {index} ({obj['name']}): arguments are not a JSON object"
    if not isinstance(arguments, dict):
        return f"tool call {index} ({obj['name']}): arguments must be a JSON object"
    return ToolCall(obj["name"], arguments)


def parse_hermes(text: str) -> ParsedTurn:
    """Every `<tool_call>{json}</tool_call>` block of `text`; an unclosed one is an error."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    pos, index = 0, 0
    while (start := text.find(OPEN, pos)) >= 0:
        index += 1
        end = text.find(CLOSE, start + len(OPEN))
        if end < 0:
            errors.append(f"tool call {index}: {OPEN} is never closed by {CLOSE}")
            break
        found = _read_call(text[start + len(OPEN):end].strip(), index)
        (errors if isinstance(found, str) else calls).append(found)  # type: ignore[arg-type]
        pos = end + len(CLOSE)
    return ParsedTurn(calls, errors)


PARSERS: dict[str, Callable[[str], ParsedTurn]] = {"hermes": parse_hermes}


def parser_names() -> list[str]:
    return sorted(PARSERS)


def get_parser(name: str) -> Callable[[str], ParsedTurn]:
    """The parser `name` names (`env.tool_parser`): a built-in or "package.module:function"."""
    if name in PARSERS:
        return PARSERS[name]
    if ":" in name:
        return resolve_import_path(name, "tool parser")
    raise KeyError(f"unknown tool parser {name!r}; known: {', '.join(parser_names())}, or an "
                   "import path 'package.module:function'")
