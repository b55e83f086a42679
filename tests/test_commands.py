"""The stage commands are thin modules of `jaxrl_llm.commands`, each with the protocol `cli.py`
dispatches to, listed in one table (`commands.COMMANDS`); the GPU host's `jaxrl-llm vllm generate`
parses, and no library module starts a command where the import graph cannot see it."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

from jaxrl_llm.commands import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
STAGES = {"config", "plan", "data", "generate", "score", "curate", "train", "export", "evaluate",
          "report", "iterate", "online", "quickstart", "vllm"}


def test_every_stage_is_a_module_of_commands_with_the_cli_protocol() -> None:
    assert set(COMMANDS) == STAGES
    # cli.py dispatches `jaxrl-llm NAME` to `jaxrl_llm.commands.NAME`: each must exist there.
    modules = {p.stem for p in (ROOT / "jaxrl_llm" / "commands").glob("*.py")}
    assert STAGES <= modules, STAGES - modules
    for name in COMMANDS:
        module_name = f"jaxrl_llm.commands.{name}"
        module = importlib.import_module(module_name)
        assert callable(module.add_arguments) and callable(module.run), module_name


def test_commands_stay_thin() -> None:
    """A command parses, loads config, prints and calls the library: a few dozen lines each."""
    sizes = {p.name: len(p.read_text(encoding="utf-8").splitlines())
             for p in (ROOT / "jaxrl_llm" / "commands").glob("*.py")}
    assert max(sizes.values()) <= 120, sizes


def test_vllm_generate_parses_its_flags() -> None:
    """launch/vllm_host.sh runs `jaxrl-llm vllm generate --model M --config C` (a sub-action of
    the `vllm` command, not a library module run as a script)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cli = [sys.executable, "-m", "jaxrl_llm.cli", "vllm", "generate"]
    done = subprocess.run([*cli, "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: jaxrl-llm vllm generate")
    for flag in ("--model", "--out", "--chunk-prompts", "--overwrite", "--config"):
        assert flag in done.stdout
    missing = subprocess.run(cli, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "--model" in missing.stderr
    assert "jaxrl-llm vllm generate --model" in (ROOT / "launch" / "vllm_host.sh").read_text()


def test_no_library_module_runs_a_command_by_name() -> None:
    """A library module that started `jaxrl_llm.commands.X` through runpy/importlib strings
    would import the top layer behind the import test's back."""
    for path in (ROOT / "jaxrl_llm").rglob("*.py"):
        if path.parent.name == "commands" or path.name == "cli.py":
            continue
        text = path.read_text(encoding="utf-8")
        assert "runpy" not in text and "run_module" not in text, path
