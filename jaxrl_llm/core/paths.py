"""Run and output paths, local or remote (`gs://…`), all handled as `etils.epath.Path`.

`pathlib.Path("gs://bucket/x")` collapses the `//` into a local directory `gs:/bucket/x`;
`epath.Path` keeps the scheme and sends reads and writes to the remote file system. Relative
local paths are made absolute once, when a config is validated (`RunPath` fields of
`config/`): Orbax refuses relative checkpoint paths, and a run must not move if the working
directory changes later. `as_path` applies the same rule to paths given directly to the API.
"""

from __future__ import annotations

import os
import re
from typing import Annotated, Any

from etils import epath
from pydantic import AfterValidator

# A URI scheme: gs://, s3://, az://, hf:// (epath's remote file systems).
_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# What pathlib makes of a URI (`gs://b/x` -> `gs:/b/x`): refused, it would write locally.
_COLLAPSED_URI = re.compile(r"^(gs|s3|az|hf):/(?!/)")

PathLike = str | os.PathLike


def is_remote(path: PathLike) -> bool:
    """True for a URI such as `gs://bucket/x` (not a local file-system path)."""
    return bool(_URI.match(os.fspath(path)))


def absolute(path: PathLike) -> str:
    """`path` as an absolute string: a URI unchanged, a local path made absolute against the
    current directory (with `~` expanded); `os.path.abspath` also normalises `..` and `//`."""
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"path must be text, got bytes {text!r}")
    if not text.strip():
        raise ValueError("empty path: give a directory (local, or a URI such as gs://bucket/x)")
    if is_remote(text):
        return text
    if _COLLAPSED_URI.match(text):
        raise ValueError(
            f"{text!r} looks like a URI whose '//' was collapsed by pathlib.Path; pass the "
            f"string itself ({text.replace(':/', '://', 1)!r}) or an etils.epath.Path"
        )
    return os.path.abspath(os.path.expanduser(text))


def as_path(path: PathLike) -> epath.Path:
    """`path` as an `epath.Path`: remote URIs kept, local paths absolute (see `absolute`)."""
    if isinstance(path, epath.Path) and (is_remote(path) or path.is_absolute()):
        return path
    return epath.Path(absolute(path))


# A config field holding a path: a run or output directory, or an input file such as
# data.task_path (resolved when the config is validated, against the current directory).
RunPath = Annotated[str, AfterValidator(absolute)]

# Every run/output path of an `ExperimentConfig`, as dotted keys.
RUN_PATH_KEYS = ("run_dir", "data.records", "data.curated", "generate.output",
                 "generate.score_output", "data.task_path", "eval.task_path")


def resolve_paths(config: Any) -> Any:
    """A copy of `config` with every `RUN_PATH_KEYS` path resolved (`absolute`); for configs
    built without validation (`model_construct`) or mutated after loading."""
    config = config.model_copy(deep=True)
    for key in RUN_PATH_KEYS:
        *sections, name = key.split(".")
        node = config
        for section in sections:
            node = getattr(node, section)
        value = getattr(node, name)
        if value is not None:
            object.__setattr__(node, name, absolute(value))  # bypass validate_assignment
    return config


def append_text(path: PathLike, text: str) -> None:
    """Append `text` to a file, local (`open("a")`) or remote (object stores cannot append:
    read, then rewrite the whole object)."""
    p = as_path(path)
    if not is_remote(p):
        with p.open("a") as f:
            f.write(text)
        return
    p.write_text((p.read_text() if p.exists() else "") + text)


def find_files(root: PathLike, name: str) -> list[epath.Path]:
    """Every file called `name` under `root`, sorted: a `rglob` that also works on gs://
    (epath refuses `**` there, and fsspec's `walk` drops the scheme)."""
    found, stack = [], [as_path(root)]
    while stack:
        for child in stack.pop().iterdir():
            if child.is_dir():
                stack.append(child)
            elif child.name == name:
                found.append(child)
    return sorted(found, key=os.fspath)


def copy_tree(src: PathLike, dst: PathLike) -> epath.Path:
    """Copy every file under `src` to the same place under `dst` (either may be remote);
    returns `dst`. Existing files are overwritten."""
    source, target = as_path(src), as_path(dst)
    target.mkdir(parents=True, exist_ok=True)
    for child in source.iterdir():
        if child.is_dir():
            copy_tree(child, target / child.name)
        else:
            child.copy(target / child.name, overwrite=True)
    return target
