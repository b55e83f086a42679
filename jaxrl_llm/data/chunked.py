"""Record directories written chunk by chunk, resumable after a kill.

A generation run splits its prompts into chunks; each chunk becomes one complete shard
(`write_shard`: written under a temporary name, renamed last) and one entry in
`progress.json` (written atomically after the shard). The manifest, which is what makes a
record directory readable (`read_manifest`), is written only when every chunk is there, and
`progress.json` is removed then. So a killed run leaves a directory no later stage can read as
complete, and the same command run again skips the chunks already written and produces the
same records as an uninterrupted run (each chunk's sampling depends only on the run's seed and
the chunk's prompts).

`progress.json` holds the run's fingerprint (model, sampling settings, seed, prompts): a
partial directory written with different settings is an error naming the keys that differ,
never silently mixed; `overwrite=True` starts clean.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from etils import epath

from jaxrl_llm.core.atomic import atomic_write_text
from jaxrl_llm.data.records import Record, RecordError
from jaxrl_llm.data.shards import (
    MANIFEST_NAME,
    Manifest,
    read_manifest,
    write_manifest,
    write_shard,
)

PROGRESS_NAME = "progress.json"


class ResumeMismatch(RecordError):
    """A record directory this run cannot resume: written by a run with other settings, or
    already complete."""


def chunk_shard_name(chunk: int) -> str:
    return f"records-{chunk:05d}.array_record"


class ChunkedRecordWriter:
    """Write `num_chunks` chunks of records into `directory`, resuming a partial run.

    fingerprint: JSON-able settings that determine the records (a resumed run must match).
    manifest_fields: the `Manifest` fields of the finished directory (sampling, extra, ...).
    """

    def __init__(self, directory: str | epath.PathLike, *, num_chunks: int,
                 fingerprint: dict[str, Any], overwrite: bool = False,
                 vocab_size: int | None = None, **manifest_fields: Any) -> None:
        self.directory = epath.Path(directory)
        self.num_chunks = num_chunks
        self.fingerprint = json.loads(json.dumps(fingerprint))  # as it will read back
        self.vocab_size = vocab_size
        self.manifest_fields = manifest_fields
        self.chunks: dict[int, dict[str, Any]] = {}
        progress = self.directory / PROGRESS_NAME
        if overwrite and self.directory.exists():
            for old in [*self.directory.glob("records-*"), progress,
                        self.directory / MANIFEST_NAME]:
                if old.exists():
                    old.unlink()
        if (self.directory / MANIFEST_NAME).exists():
            raise ResumeMismatch(f"{self.directory} already holds complete records (manifest.json); "
                                  "pass --overwrite to replace them")
        if progress.exists():
            state = json.loads(progress.read_text())
            differ = sorted(k for k in set(state["fingerprint"]) | set(self.fingerprint)
                            if state["fingerprint"].get(k) != self.fingerprint.get(k))
            if differ:
                old = state["fingerprint"]
                changes = ", ".join(f"{k}: {old.get(k)!r} -> {self.fingerprint.get(k)!r}"
                                    for k in differ)
                raise ResumeMismatch(
                    f"{self.directory} holds a partial run with other settings ({changes}); "
                    "re-run with the same settings to resume, or pass --overwrite to start clean")
            self.chunks = {int(c): info for c, info in state["chunks"].items()
                           if (self.directory / info["path"]).exists()}
        elif any(self.directory.glob("records-*")):
            raise ResumeMismatch(f"{self.directory} holds record shards but neither a manifest nor "
                                 f"{PROGRESS_NAME}; pass --overwrite to replace them")
        self.directory.mkdir(parents=True, exist_ok=True)

    @property
    def resumed(self) -> int:
        """Chunks already written by an earlier run."""
        return len(self.chunks)

    def done(self, chunk: int) -> bool:
        return chunk in self.chunks

    def write_chunk(self, chunk: int, records: Sequence[Record]) -> None:
        if not 0 <= chunk < self.num_chunks:
            raise IndexError(f"chunk {chunk} outside [0, {self.num_chunks})")
        entry = write_shard(self.directory, chunk_shard_name(chunk), records,
                            vocab_size=self.vocab_size)
        entry.update(num_correct=sum(int(r.correct) for r in records),
                     num_invalid=sum(int(r.invalid) for r in records),
                     groups=sorted({int(r.group_id) for r in records}))
        self.chunks[chunk] = entry
        atomic_write_text(self.directory / PROGRESS_NAME, json.dumps(
            {"fingerprint": self.fingerprint, "chunks": self.chunks}))

    def finish(self, **extra_fields: Any) -> Manifest:
        """The manifest over all chunks, written last; `progress.json` removed."""
        missing = [c for c in range(self.num_chunks) if c not in self.chunks]
        if missing:
            raise RuntimeError(f"{self.directory}: chunks {missing[:5]} were never written")
        entries = [self.chunks[c] for c in range(self.num_chunks)]
        manifest = Manifest(vocab_size=self.vocab_size, **self.manifest_fields)
        manifest.shards = [{"path": e["path"], "count": e["count"]} for e in entries]
        manifest.num_records = sum(e["count"] for e in entries)
        manifest.num_correct = sum(e["num_correct"] for e in entries)
        manifest.num_invalid = sum(e["num_invalid"] for e in entries)
        manifest.num_groups = len({g for e in entries for g in e["groups"]})
        manifest.extra.update(extra_fields)
        manifest.created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        write_manifest(self.directory, manifest)
        (self.directory / PROGRESS_NAME).unlink()
        return manifest


def complete(directory: str | epath.PathLike) -> Manifest | None:
    """The manifest of a finished record directory, None when it is absent or partial."""
    if not (epath.Path(directory) / MANIFEST_NAME).exists():
        return None
    return read_manifest(directory)
