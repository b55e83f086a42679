"""The storage the trainer and the rollout workers share (`online.exchange`, docs/online.md §
Pipeline), local or `gs://`, through `core.atomic` (a file appears whole or not at all):

    manifest.json          the trainer's run: model and tokenizer identity, the sampling keys
    trainer.json           the trainer's progress: rounds checkpointed and consumed, done
    mu_source.json         μ's source decided on round 0 (online.mu_source: auto)
    weights/v00000003.bin  θ_3 (every array of params and model state, by path)
    rounds/r00000005.bin   round 5's samples, with the version that sampled them

A `.bin` is a blob: 8 bytes of header length, a JSON header holding the payload's size and
SHA-256, then the payload. It is written under a temporary name and renamed (an object store
shows an object only once uploaded), so a reader never sees half of one; a file that fails its
size or checksum was put there some other way and is refused, never loaded.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import msgpack
import numpy as np
from etils import epath

from jaxrl_llm.core.atomic import atomic_write_bytes, atomic_write_text
from jaxrl_llm.core.errors import ConfigError
from jaxrl_llm.core.paths import RUN_PATH_KEYS, as_path
from jaxrl_llm.data.records import Record, validate_record
from jaxrl_llm.online.config import OnlineConfig

POLL_S = 0.05  # how often a waiting side looks at the exchange again
_LEN = struct.Struct("<Q")


class ExchangeError(ConfigError):
    """The exchange holds what this side cannot use (another run, a torn file, nothing in
    time); the message names the path, the cause and the fix (the CLI exits 2)."""


def write_blob(path: epath.Path, header: dict[str, Any], payload: bytes) -> None:
    head = json.dumps({**header, "payload_bytes": len(payload),
                       "sha256": hashlib.sha256(payload).hexdigest()}).encode()
    atomic_write_bytes(path, _LEN.pack(len(head)) + head + payload)


def read_blob(path: epath.Path, what: str) -> tuple[dict[str, Any], bytes]:
    """(header, payload) of a complete blob; `ExchangeError` for a torn or foreign file."""
    data = path.read_bytes()
    fix = (f"the exchange's writers rename a {what} into place only once whole, so this one "
           "was written or copied some other way: delete it (the side that writes it writes "
           "it again on restart)")
    try:
        (size,) = _LEN.unpack_from(data)
        header = json.loads(data[_LEN.size:_LEN.size + size])
    except (struct.error, ValueError) as err:
        raise ExchangeError(f"{path}: not a complete {what} ({err}); {fix}") from None
    payload = data[_LEN.size + size:]
    if len(payload) != header.get("payload_bytes") or \
            hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise ExchangeError(f"{path}: half-written {what} ({len(payload)} of "
                            f"{header.get('payload_bytes')} bytes, or a checksum mismatch), "
                            f"never loaded; {fix}")
    return header, payload


def arrays_payload(named: Sequence[tuple[str, np.ndarray]]) -> tuple[list[Any], bytes]:
    """The blob of named arrays: [(name, dtype, shape)] and their raw bytes, concatenated."""
    arrays = [(n, np.ascontiguousarray(a)) for n, a in named]
    return ([[n, a.dtype.name, list(a.shape)] for n, a in arrays],
            b"".join(a.tobytes() for _, a in arrays))


def arrays_from(leaves: list[Any], payload: bytes) -> list[np.ndarray]:
    out, offset = [], 0
    for _, dtype, shape in leaves:
        dt = np.dtype(getattr(ml_dtypes, dtype, dtype))  # bfloat16 is ml_dtypes'

        size = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        out.append(np.frombuffer(payload, dt, count=size // dt.itemsize, offset=offset)
                   .reshape(shape))
        offset += size
    return out


class Exchange:
    """The layout of the module docstring under `root`."""

    def __init__(self, root: str, timeout_s: float) -> None:
        self.root, self.timeout_s = as_path(root), timeout_s
        self.weights, self.rounds = self.root / "weights", self.root / "rounds"

    # -- names -----------------------------------------------------------------------------
    def weights_path(self, version: int) -> epath.Path:
        return self.weights / f"v{version:08d}.bin"

    def round_path(self, round_index: int) -> epath.Path:
        return self.rounds / f"r{round_index:08d}.bin"

    def _numbers(self, folder: epath.Path, prefix: str) -> list[int]:
        """The indices of the complete files in `folder` (temporary names start with '.')."""
        if not folder.exists():
            return []
        return sorted(int(p.name[1:-4]) for p in folder.iterdir()
                      if p.name.startswith(prefix) and p.name.endswith(".bin"))

    def versions(self) -> list[int]:
        return self._numbers(self.weights, "v")

    def sampled_rounds(self) -> list[int]:
        return self._numbers(self.rounds, "r")

    # -- JSON files ------------------------------------------------------------------------
    def read_json(self, name: str) -> dict[str, Any] | None:
        path = self.root / name
        return json.loads(path.read_text()) if path.exists() else None

    def write_json(self, name: str, value: dict[str, Any]) -> None:
        atomic_write_text(self.root / name, json.dumps(value, indent=1, sort_keys=True))

    def progress(self) -> dict[str, Any]:
        """The trainer's progress (`trainer.json`); nothing yet: round 0, not done."""
        return self.read_json("trainer.json") or {"round": 0, "consumed": 0, "done": False}

    # -- waiting ---------------------------------------------------------------------------
    def wait(self, ready: Callable[[], Any], what: str, other: str,
             give_up: Callable[[], bool] = lambda: False) -> Any:
        """`ready()`'s first truthy value, polled; None once `give_up()`; `ExchangeError`
        after `timeout_s` naming the path (the sides may not share it)."""
        start = time.monotonic()
        while True:
            value = ready()
            if value:
                return value
            if give_up():
                return None
            if time.monotonic() - start > self.timeout_s:
                raise ExchangeError(
                    f"no {what} in {self.root} within online.worker_timeout_s="
                    f"{self.timeout_s:g} s: is {other} running with online.exchange="
                    f"{self.root}? The two sides may not share this path (a local path on two "
                    "hosts is two directories: use a shared file system or gs://), or the "
                    "other side failed (see its log)")
            time.sleep(POLL_S)

    # -- weights ---------------------------------------------------------------------------
    def publish(self, version: int, named: Sequence[tuple[str, np.ndarray]],
                identity: dict[str, Any]) -> None:
        leaves, payload = arrays_payload(named)
        write_blob(self.weights_path(version), {"version": version, "leaves": leaves,
                                                "identity": identity}, payload)

    def header(self, version: int) -> dict[str, Any] | None:
        """θ_version's blob header alone (its payload's SHA-256 names its bytes); None once
        collected, {} when unreadable (`load` then says why)."""
        try:
            with self.weights_path(version).open("rb") as f:
                (size,) = _LEN.unpack(f.read(_LEN.size))
                return json.loads(f.read(size))
        except FileNotFoundError:
            return None
        except (struct.error, ValueError):
            return {}

    def load(self, version: int) -> tuple[dict[str, Any], list[np.ndarray]]:
        header, payload = read_blob(self.weights_path(version), f"weight version θ_{version}")
        return header, arrays_from(header["leaves"], payload)

    # -- rounds ----------------------------------------------------------------------------
    def put_round(self, round_index: int, header: dict[str, Any],
                  batches: Sequence[Sequence[Record]]) -> None:
        payload = msgpack.packb([[r.to_bytes() for r in b] for b in batches], use_bin_type=True)
        write_blob(self.round_path(round_index), {"round": round_index, **header}, payload)

    def get_round(self, round_index: int, vocab_size: int | None
                  ) -> tuple[dict[str, Any], list[list[Record]]]:
        path = self.round_path(round_index)
        header, payload = read_blob(path, f"record shard of round {round_index}")
        batches = []
        for b, rows in enumerate(msgpack.unpackb(payload, raw=False)):
            batch = []
            for i, data in enumerate(rows):
                where = f"{path}[batch {b}, record {i}]"
                record = Record.from_bytes(data, where=where)
                validate_record(record, where=where, vocab_size=vocab_size)
                batch.append(record)
            batches.append(batch)
        return header, batches

    # -- garbage ---------------------------------------------------------------------------
    def collect(self, *, versions_below: int, rounds_below: int,
                versions_above: int | None = None) -> None:
        """Delete the versions and the round shards no side can need any more (and the
        versions above `versions_above`: a killed free-running trainer's, lost with it)."""
        for v in self.versions():
            if v < versions_below or (versions_above is not None and v > versions_above):
                _remove(self.weights_path(v))
        for r in self.sampled_rounds():
            if r < rounds_below:
                _remove(self.round_path(r))


def _remove(path: epath.Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:  # another process collected it first
        pass


def differences(ours: dict[str, Any], theirs: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two JSON trees."""
    out = []
    for key in sorted(set(ours) | set(theirs)):
        a, b = ours.get(key), theirs.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}")
    return out


def tokenizer_identity(tokenizer: Any) -> dict[str, Any]:
    """What makes two tokenizers encode alike: name, vocabulary (hashed), special ids."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    digest = hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()[:16]
    return {"name": getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__,
            "vocab": len(vocab), "vocab_sha256": digest,
            "eos_token_id": getattr(tokenizer, "eos_token_id", None),
            "pad_token_id": getattr(tokenizer, "pad_token_id", None)}


_RUN_KEYS = ("prompts_per_round", "updates_per_round", "staleness", "rounds", "pipeline",
             "workers", "mu_source", "max_mu_mismatch", "pkpo_k", "pass_k", "max_staleness")


def manifest_of(config: OnlineConfig, tokenizer: Any) -> dict[str, Any]:
    """What both sides must agree on: the model, the tokenizer, and every key that decides
    what a round samples (paths left out: two hosts may mount them differently)."""
    tree = config.model_dump(mode="json")
    for key in RUN_PATH_KEYS:
        *sections, name = key.split(".")
        node = tree
        for section in sections:
            node = node[section]
        node.pop(name, None)
    return {"model": tree["model"], "tokenizer": tokenizer_identity(tokenizer),
            "run": {"seed": tree["seed"], "generate": tree["generate"], "data": tree["data"],
                    "loss": tree["loss"]["name"],
                    "online": {k: tree["online"][k] for k in _RUN_KEYS}}}


def check_manifest(ex: Exchange, ours: dict[str, Any], theirs: dict[str, Any],
                   side: str) -> None:
    """Refuse a side whose model, tokenizer or sampling keys differ, naming both values."""
    keys = differences(ours, theirs)
    if not keys:
        return

    def value(tree: dict[str, Any], key: str) -> Any:
        for part in key.split("."):
            tree = tree.get(part) if isinstance(tree, dict) else None
        return tree

    shown = "; ".join(f"{k}: {side} {value(ours, k)!r}, the exchange {value(theirs, k)!r}"
                      for k in keys[:6])
    what = "model or tokenizer" if any(k.split(".")[0] in ("model", "tokenizer") for k in keys) \
        else "sampling settings"
    raise ExchangeError(
        f"this {side}'s {what} differ from what the trainer publishes in "
        f"{ex.root / 'manifest.json'} ({shown}): run every side with the same config, or give "
        "a new run an empty online.exchange")
