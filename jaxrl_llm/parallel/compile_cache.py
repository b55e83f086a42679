"""A persistent cache of compiled programs for the device commands (`cli.DEVICE_COMMANDS`).

Every stage of a chain, every restart after a preemption and every rollout worker compiles
the same train step and sampler programs again; on a pod that is minutes per start (an 8B
decode program for v5e: 8.5 s scanned, 93 s unrolled, benchmarks/decode_v5e.py; the train step
longer). JAX's persistent compilation cache keys each executable by its program, compile
options, devices and JAX version, so a hit is the executable a fresh compile would build.

On by default on TPU and GPU, in `~/.cache/jaxrl_llm/xla`; off on CPU, where the XLA:CPU loader
rejects the cached executables of some hosts (jax-ml/jax#38445: every entry missed, with error
lines in the log). `JAXRL_COMPILATION_CACHE`: a directory (any platform, CPU included) or
`off`; JAX's own `JAX_COMPILATION_CACHE_DIR`, when set, wins and is left to JAX.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import jax

ENV = "JAXRL_COMPILATION_CACHE"
DEFAULT_DIR = "~/.cache/jaxrl_llm/xla"
OFF = frozenset({"off", "0", "false", "no", "none"})


def enable_compilation_cache(env: Mapping[str, str] | None = None,
                             platform: str | None = None) -> str | None:
    """Point JAX's persistent compilation cache at the directory the environment and platform
    choose (module docstring); returns it, or None when the cache stays off. `platform`:
    the backend's (default `jax.default_backend()`, which starts it: call after
    `distributed.initialize`)."""
    env = os.environ if env is None else env
    if env.get("JAX_COMPILATION_CACHE_DIR"):
        return env["JAX_COMPILATION_CACHE_DIR"]  # JAX reads it itself
    choice = env.get(ENV, "").strip()
    if choice.lower() in OFF:
        return None
    if not choice:
        platform = platform or jax.default_backend()
        if platform not in ("tpu", "gpu", "cuda", "rocm"):
            return None
    directory = os.path.expanduser(choice or DEFAULT_DIR)
    jax.config.update("jax_compilation_cache_dir", directory)
    return directory
