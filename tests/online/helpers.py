"""A tiny online config (random 1-layer model, arithmetic prompts), a task that model solves
now and then (`solvable`), and readers of a run."""

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

from jaxrl_llm.tasks import Problem, RewardResult, Task
from jaxrl_llm.tasks.base import binary_reward

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


class ParityTask(Task):
    """A task the random tiny model solves now and then, so the positive-reward path runs:
    "is N even or odd? answer with a digit of the same parity". The answer is the
    completion's first digit (none: invalid); it is right when its parity is N's. The char
    tokenizer has 10 digits among the model's 128 ids, so a random policy writes a digit in
    its 8 tokens about half the time and the right parity about a quarter of the time:
    groups mix right and wrong samples, and pass@k, rewards > 0 and the group transforms see
    non-constant rewards (the arithmetic task's answers are out of a random model's reach)."""

    name = "parity"
    reward_fn = "correct: the completion's first digit has the parity of N"

    def load(self, *, split: str = "train", num: int | None = None, seed: int = 0
             ) -> list[Problem]:
        rng = np.random.default_rng([seed, {"train": 0, "test": 1}.get(split, 2)])
        values = rng.integers(10, 100, size=num or 64)
        return [Problem(id=f"parity-{split}-{seed}-{i}", question=f"Is {v} even or odd?",
                        answer=str(v % 2), solution=f"{v % 2}")
                for i, v in enumerate(values)]

    def prompt(self, problem: Problem) -> str:
        return f"{problem.question} Answer with a digit of the same parity:\n"

    def score(self, problem: Problem, completion: str) -> RewardResult:
        digit = next((c for c in completion if c.isdigit()), None)
        if digit is None:
            return RewardResult(binary_reward(False, self.reward_scheme), False, True, None)
        correct = int(digit) % 2 == int(problem.answer)
        return RewardResult(binary_reward(correct, self.reward_scheme), correct, False, digit)


SOLVABLE = "tests.online.helpers:ParityTask"  # data.task: the import path of `ParityTask`


def solvable(run_dir: Path | str, **sections: dict[str, Any]) -> dict[str, Any]:
    """`tiny`, on `ParityTask`: some samples succeed."""
    return tiny(run_dir, **{**sections, "data": {"task": SOLVABLE, **sections.get("data", {})}})


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


def saved_queue(run_dir: Path, step: int) -> bytes:
    """Checkpoint `step`'s staleness queue item, as stored (online/queue.py: the record codec);
    `StalenessQueue.from_bytes` reads it."""
    from jaxrl_llm.online.queue import QUEUE_ITEM
    from jaxrl_llm.train.checkpoint import Checkpointer

    with Checkpointer(run_dir / "checkpoints", async_save=False) as ckpt:
        payload = ckpt.read_blob(QUEUE_ITEM, step)
    assert payload is not None, f"{run_dir} step {step}: no {QUEUE_ITEM} item"
    return payload


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
