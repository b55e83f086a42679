"""Hugging Face Hub ids (`Qwen/Qwen2.5-0.5B-Instruct`) wherever a model directory is accepted.

`resolve_model_dir(path, revision)` returns `path` unchanged when it is a local or remote
(`gs://`) path, and otherwise, for a string shaped like a hub id (`org/name`), the local
snapshot directory `huggingface_hub.snapshot_download` gives: from its cache (HF_HUB_CACHE,
else HF_HOME/hub) without network when HF_HUB_OFFLINE=1 or the files are there, downloading
the config, safetensors and tokenizer files otherwise. `revision` (a branch, tag or commit;
the config key `model.revision`) pins the snapshot. A hub id that cannot be resolved is a
`ConfigError` naming the id, the revision and the cache directory.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from jaxrl_llm.core.errors import ConfigError

# What the decoder and the tokenizer read from a snapshot (never *.bin / *.pth / *.gguf).
HUB_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.jinja"]
# org/name, as the Hub spells repository ids (letters, digits, - _ .; no leading dot).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")


def is_hub_id(path: str | os.PathLike | None) -> bool:
    """True for `org/name` strings that are not an existing local path (nor `./…`, `gs://…`),
    and whose `org` is not a local directory: `models/my-modle` next to a `models/` directory
    is a mistyped local path, never sent to the Hub."""
    if path is None:
        return False
    text = os.fspath(path)
    return (bool(_HUB_ID.match(text)) and not text.endswith(".gguf") and not Path(text).exists()
            and not Path(text.split("/", 1)[0]).is_dir())


def hub_cache_dir() -> str:
    """The cache `huggingface_hub` reads now (HF_HUB_CACHE, else HF_HOME/hub, else its default)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (read now, not when huggingface_hub was imported)."""
    value = os.environ.get("HF_HUB_OFFLINE", "")
    if value:
        return value.strip().upper() in ("1", "ON", "YES", "TRUE")
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def resolve_model_dir(path: str, *, revision: str | None = None, key: str = "model.path",
                      files: list[str] | None = None) -> str:
    """`path` itself, or the local snapshot directory of hub id `path` at `revision`.

    key: the config key that named `path` (for the error message). files: the file patterns
    to fetch (default `HUB_FILES`; `["config.json"]` when only the architecture is needed).
    """
    if not is_hub_id(path):
        if revision is not None and not Path(path).exists():
            raise ConfigError(f"model.revision={revision!r} is set but {key}={path!r} is "
                              "neither a hub id (org/name) nor an existing path")
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = hub_cache_dir()
    offline = hub_offline()
    at = f" at revision {revision!r}" if revision else ""
    try:
        return snapshot_download(path, revision=revision, cache_dir=cache,
                                 allow_patterns=files or HUB_FILES,
                                 local_files_only=offline)
    except LocalEntryNotFoundError as err:
        why = ("HF_HUB_OFFLINE is set and it is not in the cache" if offline
               else "it is not in the cache and the Hub could not be reached")
        # A relative local path such as models/Llama-3-8B also looks like org/name: say both.
        raise ConfigError(f"{key}={path!r}: no local directory {Path(path).resolve()}, and as a "
                          f"hub id{at} it cannot be resolved: {why} ({cache}); download it "
                          f"first (huggingface-cli download {path}) or set {key} to a local "
                          "directory") from err
    except (HFValidationError, OSError, ValueError) as err:
        raise ConfigError(f"{key}={path!r}: hub id{at} cannot be resolved (cache {cache}): "
                          f"{err}") from err


__all__ = ["HUB_FILES", "hub_cache_dir", "hub_offline", "is_hub_id", "resolve_model_dir"]
