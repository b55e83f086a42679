"""docs/configuration.md, generated from the configuration schema: every key with its type,
default and description, section by section (`jaxrl-llm config --reference`; a test checks
the committed file is what this renders).

A key's description is its `Field(description=...)`, else the comment lines right above it
in the class source, else its trailing comment: the schema's own words, in one place.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from jaxrl_llm.config.io import dump_config
from jaxrl_llm.core.errors import ConfigError, ModelFileError

_FIELD = re.compile(r"^    (\w+)\s*:")
_CONSTRAINTS = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤", "min_length": "length ≥"}
HEADER = """# Configuration reference

Generated from the configuration schema (`jaxrl_llm/config/`, and `flows/iterate.py` /
`flows/quickstart.py` / `online/config.py` for their sections) by `jaxrl-llm config --reference > docs/configuration.md`;
a test keeps this file current. Set keys in a YAML file (`--config C`) or as `section.key=value`
overrides after any command; an unknown key or a wrong type stops the command naming the key
and where it came from (with the nearest known keys). `jaxrl-llm config --config C` prints the
resolved configuration.
"""


def source_comments(cls: type) -> dict[str, str]:
    """field -> the comment block right above it in `cls`'s source, else its trailing comment."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    found: dict[str, str] = {}
    block: list[str] = []
    for line in lines:
        text = line.strip()
        if text.startswith("#") and line.startswith("    ") and not line.startswith("     "):
            block.append(text.lstrip("#").strip())
            continue
        match = _FIELD.match(line)
        if match:
            trailing = line.split("  # ", 1)[1].strip() if "  # " in line else ""
            found[match.group(1)] = " ".join(block) or trailing
        if not line.startswith("     "):  # a continuation line keeps the block
            block = []
    return found


def _type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:  # paths.RunPath: a str made absolute when loaded
        return "path"
    if origin is typing.Literal:
        return " \\| ".join(f"`{a!r}`" if isinstance(a, str) else f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in args)
    if origin is list:
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        return "mapping"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation)).replace("RunPath", "path")


def _constraints(field: Any) -> str:
    parts = []
    for meta in field.metadata:
        for attr, sign in _CONSTRAINTS.items():
            value = getattr(meta, attr, None)
            if value is not None:
                parts.append(f"{sign} {value}")
    return f" ({', '.join(parts)})" if parts else ""


def _default(field: Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section)"
    return f"`{value!r}`" if not isinstance(value, str) else f"`{value}`"


def _section_model(annotation: Any) -> type[BaseModel] | None:
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def rows(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str, str, type | None]]:
    """(key, type, default, description, section class or None) for `model`'s fields."""
    comments: dict[str, str] = {}
    for cls in reversed(model.__mro__):  # a subclass's comment wins
        if isinstance(cls, type) and issubclass(cls, BaseModel):
            comments.update(source_comments(cls))
    out = []
    for name, field in model.model_fields.items():
        section = _section_model(field.annotation)
        text = field.description or comments.get(name, "")
        if section is not None and not text:
            text = (section.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
        out.append((prefix + name, _type_name(field.annotation) + _constraints(field),
                    _default(field), " ".join(text.split()), section))
    return out


def undocumented(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every key (recursively) without a description."""
    missing = []
    for key, _, _, text, section in rows(model, prefix):
        if not text:
            missing.append(key)
        if section is not None:
            missing += undocumented(section, key + ".")
    return missing


def _table(model: type[BaseModel], prefix: str, title: str, skip: set[str]) -> list[str]:
    lines = [f"## {title}", "", "| key | type | default | description |", "| --- | --- | --- | --- |"]
    nested = []
    for key, type_name, default, text, section in rows(model, prefix):
        if key in skip:
            continue
        if section is not None:
            nested.append((key, section))
            default = "(section)"
        cell = text.replace("|", "\\|")
        lines.append(f"| `{key}` | {type_name} | {default} | {cell} |")
    lines.append("")
    for key, section in nested:
        lines += _table(section, key + ".", f"`{key}`", skip)
    return lines


def render(schemas: Mapping[str, type[BaseModel]]) -> str:
    """The whole reference: the experiment schema, then what `iterate`, `quickstart` and
    `online` add. `schemas` maps those four names to their classes (the command layer's
    table, `commands.config.SCHEMAS`: the schemas of the flows live with their owners, above
    this package)."""
    experiment, iterate = schemas["experiment"], schemas["iterate"]
    lines = [HEADER]
    lines += _table(experiment, "", "Every command (the experiment schema)", set())
    base = set(experiment.model_fields)
    lines += _table(iterate, "", "`jaxrl-llm iterate` adds", base)
    lines += _table(schemas["quickstart"], "", "`jaxrl-llm quickstart` adds",
                    base | set(iterate.model_fields))
    lines += _table(schemas["online"], "", "`jaxrl-llm online` adds", base)
    return "\n".join(lines).rstrip() + "\n"


def with_architecture(config: Any) -> str:
    """The config's YAML, with a pretrained model's architecture as its weights have it
    (the `model:` architecture keys only build source=random models)."""
    model = getattr(config, "model", None)
    if model is None or model.source == "random":
        return dump_config(config)
    # here, not at the top: only a pretrained model needs it (and JAX)
    from jaxrl_llm.weights.loading import architecture_of

    try:
        found = architecture_of(model)
    except (ConfigError, ModelFileError, OSError) as err:
        return f"# model: architecture not read ({err})\n" + dump_config(config)
    if found is None:
        return (f"# model: {model.path or model.source} is not reachable from here: the "
                "architecture below is the config's own\n" + dump_config(config))
    fields, where = found
    config = config.model_copy(update={"model": model.model_copy(update=fields)})
    return (f"# model: source={model.source}; its architecture ({fields['num_layers']} layers, "
            f"hidden {fields['hidden_size']}, vocabulary {fields['vocab_size']}) as read from "
            f"{where}\n" + dump_config(config))
