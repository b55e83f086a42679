"""A tiny online config (random 1-layer model, arithmetic prompts) and readers of a run."""

from __future__ import annotations

import json
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


def tiny(run_dir: Path, **sections: dict[str, Any]) -> dict[str, Any]:
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
