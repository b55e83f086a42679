"""`experiments/redraw.py` imports each experiment module for its `plot` inside the caller's
process (the figure tests run it in a pytest worker). A module that changed the environment
at import — free_running.py once replaced XLA_FLAGS' device count with 2 — leaked into every
process that caller started later: a resume test's subprocess then ran on 2 devices against
its parent's 8 (params off by 1e-7, or a mesh refused)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


def test_importing_an_experiment_for_its_plot_leaves_the_environment_alone():
    names = sorted(p.stem for p in EXPERIMENTS.glob("*.py")
                   if p.stem != "__init__" and "def plot(" in p.read_text(encoding="utf-8"))
    assert "free_running" in names
    # a fresh interpreter: what this one imported already cannot hide a module's side effect
    probe = ("import importlib, json, os, sys\n"
             "before = dict(os.environ)\n"
             "changed = {}\n"
             "for name in sys.argv[1:]:\n"
             "    importlib.import_module('experiments.' + name)\n"
             "    diff = sorted(k for k in set(before) | set(os.environ)\n"
             "                  if before.get(k) != os.environ.get(k))\n"
             "    if diff: changed[name] = diff\n"
             "print(json.dumps(changed))\n")
    out = subprocess.run([sys.executable, "-c", probe, *names], cwd=EXPERIMENTS.parent,
                         env={**os.environ, "PYTHONPATH": str(EXPERIMENTS.parent)},
                         capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "{}", out.stdout[-2000:]
