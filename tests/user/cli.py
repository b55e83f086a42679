"""Run `jaxrl-llm` as a user does: the installed script, in a working directory, with relative
paths; one CPU device (what a laptop has), no compilation cache; exit code and output back."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.faults.harness import command
from tests.xla_flags import ONE_DEVICE

SMOLLM2_CONFIG = "model: {source: smollm2}\n"


def user_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": ONE_DEVICE, "TF_CPP_MIN_LOG_LEVEL": "3",
                "PYTHONUNBUFFERED": "1", **extra})
    return env


def jaxrl(cwd: Path, *args: str, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """`jaxrl-llm args` in `cwd`; stdout and stderr as text (not checked)."""
    return subprocess.run(command(list(args)), cwd=cwd, env=user_env(**env), capture_output=True,
                          text=True, timeout=timeout)
