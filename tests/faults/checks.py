"""What must hold after a fault and its resume, each check returning failure messages.

The expected values come from an uninterrupted run of the same command (the reference) and,
for the data order, from the record files themselves: a record's identity is the digest of
its tokens (`record_digest`), computed here from the records, not from the loader's plan.
"""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl_llm.data.records import RecordError
from jaxrl_llm.data.shards import RecordSource
from jaxrl_llm.train.record_trace import TRACE_FILE, record_digest

# Orbax's managers are not meant to be driven from several threads at once.
_ORBAX = threading.Lock()


def digests(records_dir: Path) -> list[str]:
    """The digest of every record of a directory (what the trainer's trace logs)."""
    return [record_digest(np.concatenate([r.prompt_ids, r.completion_ids]))
            for r in RecordSource(records_dir)]


def read_trace(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / TRACE_FILE
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # the torn last line of a killed run
            continue
    return rows


def epoch_failures(steps: list[tuple[str, ...]], records: list[str]) -> list[str]:
    """Every record exactly once per epoch: the consumed stream, cut into epochs of
    len(records) records, is a permutation of the records in each full epoch (and holds no
    record twice in the last, partial one)."""
    stream = [d for step in steps for d in step]
    n, out = len(records), []
    for e, start in enumerate(range(0, len(stream), n)):
        epoch = stream[start:start + n]
        if len(epoch) == n and sorted(epoch) != sorted(records):
            missing = len(set(records) - set(epoch))
            out.append(f"epoch {e}: not every record once ({missing} missing, "
                       f"{len(epoch) - len(set(epoch))} repeated)")
        elif len(epoch) < n and (len(set(epoch)) < len(epoch) or not set(epoch) <= set(records)):
            out.append(f"epoch {e} (partial): a record repeated or unknown")
    return out


def trace_failures(run_dir: Path, reference: list[dict[str, Any]], records: list[str]) -> list[str]:
    """The interrupted-and-resumed run's data order against the reference run's: a replayed
    step saw the same records as its first attempt, the last attempt of every step equals the
    reference step, and every record was consumed once per epoch."""
    by_step: dict[int, list[tuple[str, ...]]] = defaultdict(list)
    for row in read_trace(run_dir):
        by_step[int(row["step"])].append(tuple(row["records"]))
    out = [f"step {s} was replayed with other records than its first attempt"
           for s, seen in sorted(by_step.items()) if len(set(seen)) > 1]
    want = [tuple(r["records"]) for r in reference]
    if sorted(by_step) != list(range(1, len(want) + 1)):
        return [*out, f"trained steps {sorted(by_step)}, expected 1..{len(want)}"]
    final = [by_step[s][-1] for s in sorted(by_step)]
    diff = next((i + 1 for i, (a, b) in enumerate(zip(final, want)) if a != b), None)
    if diff is not None:
        out.append(f"step {diff} consumed other records than the uninterrupted run")
    return out + epoch_failures(final, records)


def checkpoint_state(checkpoints: Path, step: int | None = None) -> tuple[int, dict[str, np.ndarray]]:
    """(step, {leaf path: array}) of a committed checkpoint (default: the latest)."""
    import jax

    from jaxrl_llm.train.checkpoint import Checkpointer

    with _ORBAX:
        ckpt = Checkpointer(checkpoints, async_save=False)
        try:
            restored = ckpt.restore(None, step=step)
        finally:
            ckpt.close()
    leaves = jax.tree_util.tree_flatten_with_path(restored.state)[0]
    return restored.step, {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}


def committed_steps(checkpoints: Path) -> list[int]:
    """Committed checkpoint steps: Orbax's rule (a step directory with no temporary suffix)."""
    if not checkpoints.is_dir():
        return []
    return sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())


def state_failures(got: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str) -> list[str]:
    """Bit-exact equality of two restored train states (bytes, so NaNs compare too)."""
    if sorted(got) != sorted(want):
        return [f"{what}: state items differ ({sorted(set(got) ^ set(want))[:3]})"]
    return [f"{what}: {k} differs from the uninterrupted run" for k in sorted(want)
            if got[k].dtype != want[k].dtype or got[k].shape != want[k].shape
            or got[k].tobytes() != want[k].tobytes()]


def record_bytes(directory: Path) -> list[bytes] | None:
    """Every record of a directory as bytes, or None when it is not (yet) a complete record
    directory (the reader refuses it: no manifest, or a missing or partial shard)."""
    try:
        return [r.to_bytes() for r in RecordSource(directory)]
    except (RecordError, FileNotFoundError):
        return None


def records_failures(directory: Path, want: list[bytes], what: str, *, partial_ok: bool) -> list[str]:
    """A record directory readable as complete must hold exactly the reference's records in
    order (each once); `partial_ok`: it may also be unreadable (a killed writer)."""
    got = record_bytes(directory)
    if got is None:
        return [] if partial_ok else [f"{what}: {directory.name} is not a complete record directory"]
    if got == want:
        return []
    if len(set(got)) < len(got):
        return [f"{what}: {directory.name} holds a record twice"]
    lost = len(set(want) - set(got))
    return [f"{what}: {directory.name} read as complete but differs from the uninterrupted run "
            f"({len(got)} records, {lost} of {len(want)} lost)"]


def tree_bytes(directory: Path) -> dict[str, bytes]:
    """{relative path: bytes} of every file under `directory`."""
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def export_failures(out: Path, want: dict[str, bytes], what: str, *, partial_ok: bool) -> list[str]:
    """An HF export directory either absent (`partial_ok`) or the reference's, file for file."""
    if not out.exists():
        return [] if partial_ok else [f"{what}: no export at {out.name}"]
    got = tree_bytes(out)
    if got == want:
        return []
    return [f"{what}: export {out.name} differs from the uninterrupted run's "
            f"(files {sorted(set(got) ^ set(want))[:4]} or their contents)"]
