"""A tiny online config (random 1-layer model, arithmetic prompts) and readers of a run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

TINY = {
    "run_dir": "run", "seed": 3,
    "model": {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_layers": 1,
              "num_heads": 2, "num_kv_heads": 1, "max_position_embeddings": 256},
    "optim": {"name": "adamw", "learning_rate": 3e-2},
    "loss": {"name": "topr"},
    "data": {"task": "arithmetic", "num_prompts": 16},
    "generate": {"n": 4, "max_new_tokens": 8, "temperature": 1.0, "batch_size": 2},
    "train": {"batch_size": 8, "max_seq_len": 128},
    "online": {"rounds": 3, "prompts_per_round": 2, "updates_per_round": 1, "staleness": 0},
}


def tiny(run_dir: Path | str, **sections: dict[str, Any]) -> dict[str, Any]:
    tree = json.loads(json.dumps(TINY))
    tree["run_dir"] = str(run_dir)
    for name, values in sections.items():
        tree.setdefault(name, {}).update(values)
    return tree


def write_yaml(path: Path, tree: dict[str, Any]) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(tree), encoding="utf-8")
    return path


def metric_rows(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def final_arrays(run_dir: Path, step: int | None = None) -> tuple[int, dict[str, np.ndarray]]:
    """(step, every array of checkpoint `step` (default: the latest) by path), on the host."""
    import jax

    from jaxrl_llm.train.checkpoint import Checkpointer

    with Checkpointer(run_dir / "checkpoints", async_save=False) as ckpt:
        restored = ckpt.restore(None, step=step)
    flat = jax.tree_util.tree_leaves_with_path(restored.state)
    return restored.step, {jax.tree_util.keystr(p): np.asarray(a) for p, a in flat}


ROOT = Path(__file__).resolve().parents[2]


def launch_two_processes(argv: Sequence[str], *, local_devices: int = 4,
                         timeout: float = 600) -> list[str]:
    """Run `python ARGV` as process 0 and 1 of a localhost JAX job (the JAXRL_* variables
    `parallel.distributed.initialize` reads; `local_devices` CPU devices each, the parent's
    other XLA flags kept so both sides compile alike); each process's output. Asserts that
    both exit 0."""
    from tests.parallel.helpers import free_port

    port = free_port()
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                   os.environ.get("XLA_FLAGS", ""))
    procs = []
    for i in range(2):
        env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={local_devices}",
                   JAXRL_COORDINATOR=f"127.0.0.1:{port}", JAXRL_NUM_PROCESSES="2",
                   JAXRL_PROCESS_ID=str(i))
        procs.append(subprocess.Popen([sys.executable, *argv], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-4000:]
    return outputs
