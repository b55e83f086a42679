"""The storage the trainer and the rollout workers share (`online.exchange`, docs/online.md §
Pipeline), local or `gs://`, through `core.atomic` (a file appears whole or not at all):

    manifest.json          the trainer's run: model, tokenizer, every key that changes what it
                           computes, and their hash, the run id (run_identity.py)
    trainer.json           the trainer's progress: rounds checkpointed and consumed, done
    mu_source.json         μ's source decided on round 0 (online.mu_source: auto)
    sampler.json           the workers' prompt batch, fixed by the first (sampler_shape.py)
    weights/v00000003-p001of004.bin
                           trainer process 1's part of θ_3 (of 4): the shards of params and
                           model state it holds, in the sampling dtype (weight_parts.py)
    rounds/r00000005.bin   round 5's samples, with the version that sampled them

Every file names the run that wrote it (its run id, run_identity.py); a side of another run
is refused.

A `.bin` is a blob: 8 bytes of header length, a JSON header holding the payload's size and
SHA-256, then the payload. It is written under a temporary name and renamed (an object store
shows an object only once uploaded), so a reader never sees half of one; a file that fails its
size or checksum was put there some other way and is refused, never loaded.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from etils import epath

from jaxrl_llm.core.atomic import atomic_write_bytes, atomic_write_text
from jaxrl_llm.core.errors import ConfigError
from jaxrl_llm.core.paths import as_path
from jaxrl_llm.data.records import Record, pack_batches, unpack_batches, validate_record
from jaxrl_llm.online.weight_parts import assemble

POLL_S = 0.05  # how often a waiting side looks at the exchange again
_LEN = struct.Struct("<Q")
_PART = re.compile(r"v(\d{8})-p(\d{3})of(\d{3})\.bin")
_ROUND = re.compile(r"r(\d{8})\.bin")


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


class Exchange:
    """The layout of the module docstring under `root`."""

    def __init__(self, root: str, timeout_s: float) -> None:
        self.root, self.timeout_s = as_path(root), timeout_s
        self.weights, self.rounds = self.root / "weights", self.root / "rounds"

    # -- names -----------------------------------------------------------------------------
    def part_path(self, version: int, part: int, parts: int) -> epath.Path:
        """Trainer process `part`'s part of θ_version (of `parts`; online/weight_parts.py)."""
        return self.weights / f"v{version:08d}-p{part:03d}of{parts:03d}.bin"

    def round_path(self, round_index: int) -> epath.Path:
        return self.rounds / f"r{round_index:08d}.bin"

    def _names(self, folder: epath.Path, pattern: re.Pattern[str]) -> list[re.Match[str]]:
        """The complete files in `folder` (temporary names start with '.') matching it."""
        if not folder.exists():
            return []
        return [m for p in folder.iterdir() if (m := pattern.fullmatch(p.name))]

    def _parts(self) -> dict[int, dict[int, set[int]]]:
        """{version: {parts: {part, ...}}} of the weight parts on file."""
        found: dict[int, dict[int, set[int]]] = {}
        for m in self._names(self.weights, _PART):
            version, part, parts = (int(g) for g in m.groups())
            found.setdefault(version, {}).setdefault(parts, set()).add(part)
        return found

    def parts_of(self, version: int) -> list[epath.Path]:
        """The paths of θ_version's parts when every one is on file (the largest complete
        set: a multi-host trainer restarted on fewer hosts leaves a stale larger one); []."""
        sets = self._parts().get(version, {})
        complete = [n for n, have in sets.items() if have == set(range(n))]
        if not complete:
            return []
        n = max(complete)
        return [self.part_path(version, p, n) for p in range(n)]

    def versions(self) -> list[int]:
        """The weight versions every part of which is on file."""
        return sorted(v for v in self._parts() if self.parts_of(v))

    def sampled_rounds(self) -> list[int]:
        return sorted(int(m.group(1)) for m in self._names(self.rounds, _ROUND))

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
    def publish_part(self, version: int, part: int, parts: int, leaves: list[Any],
                     payload: bytes, identity: dict[str, Any]) -> None:
        """Write this trainer process's part of θ_version (`weight_parts.local_part`)."""
        write_blob(self.part_path(version, part, parts),
                   {"version": version, "part": part, "parts": parts, "leaves": leaves,
                    "identity": identity}, payload)

    def part_header(self, path: epath.Path) -> dict[str, Any] | None:
        """A part's blob header alone (its payload's SHA-256 names its bytes); None once
        collected, {} when unreadable (`load` then says why)."""
        try:
            with path.open("rb") as f:
                (size,) = _LEN.unpack(f.read(_LEN.size))
                return json.loads(f.read(size))
        except FileNotFoundError:
            return None
        except (struct.error, ValueError):
            return {}

    def header(self, version: int) -> dict[str, Any] | None:
        """θ_version's parts' headers as one: `sha256` names every part's bytes, `identity`
        is theirs when they agree (a restarted trainer overwriting a killed one's parts can
        leave them mixed for a moment: then None, as for a version not on file)."""
        heads = [self.part_header(p) for p in self.parts_of(version)]
        if not heads or any(h is None for h in heads):
            return None
        ids = {json.dumps(h.get("identity"), sort_keys=True) for h in heads if h}
        if len(ids) > 1:
            return None
        return {"sha256": ":".join(str(h.get("sha256")) for h in heads),
                "identity": heads[0].get("identity", {}) if heads[0] else {}}

    def load(self, version: int) -> tuple[dict[str, Any], list[np.ndarray]]:
        """θ_version's header (`header`'s fields) and whole arrays, assembled from every
        part; `FileNotFoundError` when a part is gone (collected), `ExchangeError` when torn
        or inconsistent."""
        paths = self.parts_of(version)
        if not paths:
            raise FileNotFoundError(f"weight version θ_{version} in {self.weights}")
        blobs = [read_blob(p, f"weight version θ_{version} (part {i} of {len(paths)})")
                 for i, p in enumerate(paths)]
        ids = {json.dumps(h.get("identity"), sort_keys=True) for h, _ in blobs}
        if len(ids) > 1:
            raise FileNotFoundError(f"θ_{version}'s parts in {self.weights} come from two "
                                    "trainers (one is overwriting the other's)")
        try:
            arrays = assemble([(h["leaves"], b) for h, b in blobs],
                              f"{self.weights}/v{version:08d}-*")
        except (KeyError, ValueError) as err:
            raise ExchangeError(f"{err}: delete θ_{version}'s parts (the trainer writes them "
                                "again on restart)") from None
        head = blobs[0][0]
        return ({"leaves": [leaf[:3] for leaf in head["leaves"]],
                 "identity": head.get("identity", {}),
                 "sha256": ":".join(h["sha256"] for h, _ in blobs)}, arrays)

    # -- rounds ----------------------------------------------------------------------------
    def put_round(self, round_index: int, header: dict[str, Any],
                  batches: Sequence[Sequence[Record]]) -> None:
        write_blob(self.round_path(round_index), {"round": round_index, **header},
                   pack_batches(batches))

    def get_round(self, round_index: int, vocab_size: int | None
                  ) -> tuple[dict[str, Any], list[list[Record]]]:
        path = self.round_path(round_index)
        header, payload = read_blob(path, f"record shard of round {round_index}")
        batches = unpack_batches(payload, where=str(path))
        for b, batch in enumerate(batches):
            for i, record in enumerate(batch):
                validate_record(record, where=f"{path}[batch {b}, record {i}]",
                                vocab_size=vocab_size)
        return header, batches

    # -- garbage ---------------------------------------------------------------------------
    def collect(self, *, versions_below: int, rounds_below: int,
                versions_above: int | None = None) -> None:
        """Delete the versions and the round shards no side can need any more (and the
        versions above `versions_above`: a killed free-running trainer's, lost with it)."""
        for m in self._names(self.weights, _PART):
            v = int(m.group(1))
            if v < versions_below or (versions_above is not None and v > versions_above):
                _remove(self.weights / m.group(0))
        for r in self.sampled_rounds():
            if r < rounds_below:
                _remove(self.round_path(r))


def _remove(path: epath.Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:  # another process collected it first
        pass
