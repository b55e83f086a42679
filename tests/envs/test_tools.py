"""Tools: schemas from signatures and docstrings, arguments checked before the function runs,
and parsers that turn any model text into calls or error messages, never an exception."""

from __future__ import annotations

import pytest

from jaxrl_llm.envs.parsers import ParsedTurn, ToolCall, get_parser, parse_hermes
from jaxrl_llm.envs.tools import ToolCallError, ToolDefinitionError, tool


def convert(amount: float, unit: str, digits: int = 2, tags: list[str] | None = None) -> str:
    """Convert an amount between units.

    Args:
        amount: How much.
        unit: Target unit.
        digits: Decimals to keep.
        tags: Labels to attach.
    """
    return f"{round(amount * (100 if unit == 'cm' else 1), digits)} {unit}"


def test_schema_from_signature_and_docstring():
    t = tool(convert)
    # The OpenAI/HF function schema, written out by hand from the signature above.
    assert t.schema == {"type": "function", "function": {
        "name": "convert", "description": "Convert an amount between units.",
        "parameters": {"type": "object", "properties": {
            "amount": {"type": "number", "description": "How much."},
            "unit": {"type": "string", "description": "Target unit."},
            "digits": {"type": "integer", "description": "Decimals to keep."},
            "tags": {"type": "array", "items": {"type": "string"}, "nullable": True,
                     "description": "Labels to attach."}},
            "required": ["amount", "unit"]}}}
    assert tool(name="conv")(convert).name == "conv"


def test_a_function_without_hints_or_docs_cannot_be_a_tool():
    def bare(x):
        return x

    with pytest.raises(ToolDefinitionError, match="bare.*type hint"):
        tool(bare)


@pytest.mark.parametrize(("arguments", "error"), [
    ({"unit": "cm"}, "missing argument(s) ['amount']"),
    ({"amount": 1, "unit": "cm", "colour": "red"}, "unknown argument(s) ['colour']"),
    ({"amount": "one", "unit": "cm"}, "argument 'amount' must be number"),
    ({"amount": True, "unit": "cm"}, "argument 'amount' must be number"),
    ({"amount": 1, "unit": "cm", "digits": 1.5}, "argument 'digits' must be integer"),
    ({"amount": 1, "unit": "cm", "tags": ["a", 3]}, "argument 'tags'[1] must be string"),
    ([1, "cm"], "arguments must be a JSON object"),
])
def test_bad_arguments_are_errors_for_the_model(arguments, error):
    with pytest.raises(ToolCallError) as info:
        tool(convert).call(arguments)
    assert error in str(info.value)


def test_a_good_call_and_a_failing_function():
    assert tool(convert).call({"amount": 1.5, "unit": "cm", "tags": None}) == "150.0 cm"

    def divide(a: int, b: int) -> float:
        """Divide.

        Args:
            a: Numerator.
            b: Denominator.
        """
        return a / b

    assert tool(divide).call({"a": 3, "b": 4}) == "0.75"  # a non-string result as JSON
    with pytest.raises(ToolCallError, match="tool 'divide' failed: ZeroDivisionError"):
        tool(divide).call({"a": 1, "b": 0})


def test_hermes_calls_and_errors():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": '
            '"2 + 2"}}\n</tool_call>\n<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}'
            '</tool_call><tool_call>{"name": "g", arguments: {}}</tool_call>'
            '<tool_call>["not", "an", "object"]</tool_call><tool_call>{"name": "h", '
            '"arguments": [1]}</tool_call><tool_call>{"name": "unclosed"')
    parsed = parse_hermes(text)
    assert parsed.calls == [ToolCall("calculator", {"expression": "2 + 2"}), ToolCall("f", {"x": 1})]
    assert [e.split(":")[0] for e in parsed.errors] == [
        "tool call 3", "tool call 4", "tool call 5 (h)", "tool call 6"]
    assert "malformed JSON" in parsed.errors[0] and "never closed" in parsed.errors[3]
    assert parse_hermes("The answer is 4.") == ParsedTurn([], []) and parse_hermes("").empty


def test_hermes_on_hostile_text():
    deep = "<tool_call>" + "[" * 100_000 + "</tool_call>"
    assert "malformed JSON" in parse_hermes(deep).errors[0]  # too deep: an error, not a crash
    many = "<tool_call>" * 50_000  # every opening unclosed: one error, one linear scan
    assert parse_hermes(many).errors == ["tool call 1: <tool_call> is never closed by "
                                         "</tool_call>"]
    assert len(parse_hermes('<tool_call>{"name": "f"}</tool_call>' * 1000).calls) == 1000


def test_parser_by_name_or_import_path():
    assert get_parser("hermes") is parse_hermes
    assert get_parser("jaxrl_llm.envs.parsers:parse_hermes") is parse_hermes
    with pytest.raises(KeyError, match="unknown tool parser 'json'; known: hermes"):
        get_parser("json")
    with pytest.raises(KeyError, match="cannot import module 'nowhere'"):
        get_parser("nowhere:parse")
