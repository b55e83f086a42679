"""The fault sweep's `online` scenario: `jaxrl-llm online` signalled while a checkpoint is
being written, right after one is committed, or at a random point, then the same command.

Checked: the newest committed checkpoint the signal left restores bit-equal to the
uninterrupted run's at that round (params, optimizer, step, RNG; its meta holds the queue of
not-yet-trained batches and the prompt position), the resumed run ends bit-equal to the
uninterrupted one, and metrics.jsonl has each round once with the uninterrupted values.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tests.faults import checks
from tests.faults.harness import Kill, Trigger
from tests.faults.stages import Reference, Stage

ROUNDS = 6  # 4 training rounds + 2 that fill the staleness queue
ONLINE_YAML = (
    "run_dir: run\nseed: 3\n"
    "model: {vocab_size: 128, hidden_size: 32, intermediate_size: 64, num_layers: 1, "
    "num_heads: 2, num_kv_heads: 1, max_position_embeddings: 256}\n"
    "optim: {name: adamw, learning_rate: 3.0e-2}\nloss: {name: topr}\n"
    "data: {task: arithmetic, num_prompts: 16}\n"
    "generate: {n: 4, max_new_tokens: 8, batch_size: 2}\n"
    "train: {batch_size: 8, max_seq_len: 128, keep_checkpoints: 100}\n"
    "online: {rounds: 4, prompts_per_round: 2, staleness: 2, checkpoint_every: 1, "
    "mu_source: trainer}\n"
)
_TIMING = ("time", "seconds_sampling", "seconds_scoring", "seconds_training")


def _rows(cwd: Path) -> list[dict]:
    path = cwd / "run" / "metrics.jsonl"
    return [{k: v for k, v in json.loads(x).items() if k not in _TIMING}
            for x in path.read_text().splitlines() if x.strip()]


def _setup(cwd: Path, inputs: Path) -> None:
    (cwd / "online.yaml").write_text(ONLINE_YAML)


def _reference(cwd: Path, ref: Reference) -> None:
    ckpts = cwd / "run" / "checkpoints"
    ref.data["states"] = {s: checks.checkpoint_state(ckpts, s)[1]
                          for s in checks.committed_steps(ckpts)}
    ref.data["rows"] = _rows(cwd)


def _chosen(seed: int) -> Trigger:
    k = random.Random(seed).randint(1, ROUNDS - 1)

    def committed(cwd: Path) -> bool:
        return (cwd / "run" / "checkpoints" / str(k) / "_CHECKPOINT_METADATA").is_file()

    if (seed // 2) % 2:  # the write is brief: its commit is the fallback point
        return Trigger(lambda cwd, t: any((cwd / "run" / "checkpoints").glob(f"{k}.*tmp*"))
                       or committed(cwd), f"while round {k}'s checkpoint is being written")
    return Trigger(lambda cwd, t: committed(cwd), f"after round {k}'s checkpoint")


def _after_kill(cwd: Path, kill: Kill, ref: Reference) -> list[str]:
    ckpts = cwd / "run" / "checkpoints"
    steps = checks.committed_steps(ckpts)
    if not steps:
        return []
    step, state = checks.checkpoint_state(ckpts)
    return checks.state_failures(state, ref.data["states"][step], f"checkpoint {step} after the kill")


def _final(cwd: Path, ref: Reference) -> list[str]:
    ckpts = cwd / "run" / "checkpoints"
    if ROUNDS not in checks.committed_steps(ckpts):
        return [f"no final checkpoint {ROUNDS} after the resume"]
    out = checks.state_failures(checks.checkpoint_state(ckpts, ROUNDS)[1],
                                ref.data["states"][ROUNDS], "final state")
    if _rows(cwd) != ref.data["rows"]:
        out.append("metrics.jsonl differs from the uninterrupted run's (or logs a round twice)")
    return out


def online_stage() -> Stage:
    return Stage(
        "online mid-round", ["online", "--config", "online.yaml", "--no-progress"], _setup,
        _chosen, _after_kill, _final, _reference,
        complete=lambda cwd: ROUNDS in checks.committed_steps(cwd / "run" / "checkpoints"),
        detail="staleness 2 (two sampled batches queued in each checkpoint): the newest "
               "committed checkpoint restores bit-equal to the uninterrupted run's at its round; "
               "final params, optimizer, step, RNG bit-equal; metric rows equal, each round once",
        mixed=True)
