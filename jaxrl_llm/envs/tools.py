"""Tools: plain Python functions the model calls by name, with a JSON schema read from their
signature and docstring (`transformers.utils.get_json_schema`, the schema the chat templates'
`tools=` argument renders).

A tool's arguments come from the model's text, so `Tool.call` checks them against the schema
(required and unknown names, JSON types, enums) before the function runs; a bad call, or a
function raising, is a `ToolCallError` whose message the model reads as the tool's answer
(docs/environments.md § Tool calls). A result that is not a string is sent as JSON.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

from transformers.utils import get_json_schema

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "array": (list,), "object": (dict,), "null": (type(None),),
}


class ToolCallError(Exception):
    """A tool call that cannot run or failed: the message is what the model reads."""


class ToolDefinitionError(TypeError):
    """A function that cannot be a tool (no type hints or no argument docs): names it."""


def _type_ok(value: Any, name: str) -> bool:
    if name in ("integer", "number") and isinstance(value, bool):  # JSON true is not 1
        return False
    return isinstance(value, _JSON_TYPES.get(name, (object,)))


def check_value(value: Any, schema: Mapping[str, Any], where: str) -> None:
    """Raise `ToolCallError` naming `where` when `value` does not fit `schema` (the subset
    `get_json_schema` writes: type, nullable, enum, items, properties,
    additionalProperties)."""
    if value is None and schema.get("nullable"):
        return
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else list(types)
        if not any(_type_ok(value, n) for n in names):
            raise ToolCallError(f"{where} must be {' or '.join(names)}, got "
                                f"{json.dumps(value)[:80]}")
    if "enum" in schema and value not in schema["enum"]:
        raise ToolCallError(f"{where} must be one of {schema['enum']}, got {json.dumps(value)[:80]}")
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for i, item in enumerate(value):
            check_value(item, schema["items"], f"{where}[{i}]")
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if key in props:
                check_value(item, props[key], f"{where}.{key}")
            elif isinstance(extra, Mapping):
                check_value(item, extra, f"{where}.{key}")


@dataclasses.dataclass(frozen=True)
class Tool:
    """A named function and its JSON schema ({"type": "function", "function": {...}})."""

    name: str
    function: Callable[..., Any]
    schema: dict[str, Any]

    @property
    def parameters(self) -> dict[str, Any]:
        return self.schema["function"].get("parameters", {"type": "object", "properties": {}})

    def check(self, arguments: Any) -> None:
        """`ToolCallError` when `arguments` do not fit this tool's parameters."""
        if not isinstance(arguments, dict):
            raise ToolCallError(f"tool {self.name!r}: arguments must be a JSON object, got "
                                f"{type(arguments).__name__}")
        props = self.parameters.get("properties", {})
        unknown = sorted(set(arguments) - set(props))
        if unknown:
            raise ToolCallError(f"tool {self.name!r}: unknown argument(s) {unknown}; it takes "
                                f"{sorted(props)}")
        missing = [k for k in self.parameters.get("required", []) if k not in arguments]
        if missing:
            raise ToolCallError(f"tool {self.name!r}: missing argument(s) {missing}")
        for key, value in arguments.items():
            check_value(value, props[key], f"tool {self.name!r}: argument {key!r}")

    def call(self, arguments: Any) -> str:
        """Check the arguments, run the function, and give its result as text."""
        self.check(arguments)
        try:
            result = self.function(**arguments)
        except ToolCallError:
            raise
        except Exception as err:  # the tool's own failure is the model's to read
            raise ToolCallError(f"tool {self.name!r} failed: {type(err).__name__}: {err}") from err
        if isinstance(result, str):
            return result
        try:
            return json.dumps(result)
        except (TypeError, ValueError) as err:
            raise ToolCallError(f"tool {self.name!r} returned {type(result).__name__}, which is "
                                "neither a string nor JSON") from err


def tool(function: Callable[..., Any] | None = None, *, name: str | None = None) -> Any:
    """A `Tool` from a function with type hints and a Google-style docstring (`Args:`), as a
    call (`tool(f)`) or a decorator (`@tool`, `@tool(name="calc")`)."""

    def make(fn: Callable[..., Any]) -> Tool:
        try:
            schema = get_json_schema(fn)
        except Exception as err:  # transformers' DocstringParsing / TypeHintParsing errors
            raise ToolDefinitionError(
                f"function {getattr(fn, '__qualname__', fn)!r} cannot be a tool: {err} (a tool "
                "needs a type hint on every argument and a docstring with an Args: section)"
            ) from err
        schema["function"].pop("return", None)  # templates render the parameters only
        if name is not None:
            schema["function"]["name"] = name
        return Tool(schema["function"]["name"], fn, schema)

    return make if function is None else make(function)


def tool_table(tools: list[Tool]) -> dict[str, Tool]:
    """name -> tool, refusing two tools of one name."""
    table: dict[str, Tool] = {}
    for t in tools:
        if not isinstance(t, Tool):
            raise TypeError(f"expected a Tool (jaxrl_llm.envs.tools.tool(fn)), got {type(t).__name__}")
        if t.name in table:
            raise ValueError(f"two tools are named {t.name!r}")
        table[t.name] = t
    return table
