"""Configuration files and overrides, for any schema: read a YAML tree, apply `a.b=c` overrides,
validate against a pydantic model and name each bad key with the file or override it came
from (`config.load_config` / `config.config_from_dict` bind the experiment schema)."""

from __future__ import annotations

import copy
import difflib
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from jaxrl_llm.core.errors import ConfigError


def _dotted(loc: Sequence[Any]) -> str:
    return ".".join(str(part) for part in loc)


def _set_dotted(tree: dict[str, Any], key: str, value: Any, source: str) -> None:
    parts = key.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(
                f"{source}: cannot set {key!r}: {'.'.join(parts[: i + 1])!r} is not a section"
            )
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=c` -> ("a.b", c) with c parsed as a YAML scalar/list (so 3, 1e-5, true, [1,2])."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part.isidentifier() for part in key.split(".")):
        raise ConfigError(f"override {text!r}: {key!r} is not a dotted key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"override {text!r}: value is not valid YAML: {err}") from err
    return key, value


def _key_source(key: str, file_keys: set[str], override_keys: dict[str, str], path: str) -> str:
    """Say where a failing key was set: an override wins over the file."""
    for set_key, override in override_keys.items():
        if key == set_key or key.startswith(set_key + ".") or set_key.startswith(key + "."):
            return f"override {override!r}"
    return f"file {path}" if path else "defaults"


def _flatten_keys(tree: Mapping[str, Any], prefix: str = "") -> set[str]:
    keys: set[str] = set()
    for k, v in tree.items():
        full = f"{prefix}{k}"
        keys.add(full)
        if isinstance(v, Mapping):
            keys |= _flatten_keys(v, full + ".")
    return keys


def validate_tree(tree: Mapping[str, Any], overrides: Sequence[str], *, source: str,
                  schema: type[BaseModel]) -> Any:
    """Validate a config tree (plus overrides) against `schema`, naming bad keys and sources."""
    data = copy.deepcopy(dict(tree))
    file_keys = _flatten_keys(data)
    override_keys: dict[str, str] = {}
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(data, key, value, f"override {text!r}")
        override_keys[key] = text
    try:
        return schema.model_validate(data)
    except ValidationError as err:
        lines = []
        for e in err.errors():
            key = _dotted(e["loc"])
            where = _key_source(key, file_keys, override_keys, source)
            if not key:  # a check across sections: its message names the keys
                lines.append(e["msg"].removeprefix("Value error, "))
            elif e["type"] == "extra_forbidden":
                lines.append(f"unknown key {key!r} (from {where}){_did_you_mean(schema, e['loc'])}")
            else:
                lines.append(f"{key!r} (from {where}): {e['msg']}; got {e.get('input')!r}")
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines)) from None


def section_fields(schema: type[BaseModel], loc: Sequence[Any]) -> dict[str, Any] | None:
    """The fields of the section at `loc` (e.g. ("train",)), or None when `loc` is not one."""
    model: Any = schema
    for part in loc:
        fields = getattr(model, "model_fields", None)
        if fields is None or part not in fields:
            return None
        annotation = fields[part].annotation
        # `LoraConfig | None` and friends: the section is the model class among the arguments
        candidates = [annotation, *typing.get_args(annotation)]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)),
                     None)
        if model is None:
            return None
    return dict(model.model_fields)


def _all_keys(schema: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every key of `schema` as a path, sections included (e.g. ("optim", "learning_rate"))."""
    fields = section_fields(schema, prefix)
    keys: list[tuple[str, ...]] = []
    for name in fields or {}:
        keys.append((*prefix, name))
        if section_fields(schema, (*prefix, name)) is not None:
            keys += _all_keys(schema, (*prefix, name))
    return keys


def _did_you_mean(schema: type[BaseModel], loc: Sequence[Any]) -> str:
    """"; did you mean 'train.steps'?" for a key one typo away from a key of its section, or
    whose name (or a near miss of it) is a key of another section ('train.learning_rate' ->
    'optim.learning_rate': TRL keeps everything in one section)."""
    section, leaf = tuple(str(p) for p in loc[:-1]), str(loc[-1])
    fields = section_fields(schema, section)
    if fields is None:
        return ""
    close = [(*section, c) for c in difflib.get_close_matches(leaf, list(fields), n=3, cutoff=0.6)]
    elsewhere = [k for k in _all_keys(schema) if k[:-1] != section]
    close += [k for k in elsewhere if k[-1] == leaf]  # the same name in another section
    near = difflib.get_close_matches(leaf, sorted({k[-1] for k in elsewhere}), n=3, cutoff=0.8)
    close += [k for k in elsewhere if k[-1] in near and k[-1] != leaf]
    if not close:
        return f"; {_dotted(section) or 'the top level'} has: {', '.join(fields)}"
    return "; did you mean " + " or ".join(repr(_dotted(k)) for k in close[:4]) + "?"


def read_tree(path: str | Path) -> dict[str, Any]:
    """A config file's top-level mapping (an empty file: {})."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ConfigError(f"cannot read config file {source}: {err}") from err
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {source} is not valid YAML: {err}") from err
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {source}: top level must be a mapping, got {type(loaded).__name__}")
    return loaded


def dump_config(config: BaseModel) -> str:
    """The resolved config as YAML (what checkpoints store next to the weights)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
