"""The record schema: one record per sampled completion (docs/architecture.md § Contracts; docs/kernels.md notation).

A record holds token ids (not text) so that training never re-tokenises, the sampler's
per-token log-probs (processed: after temperature/top-k/top-p, and raw when the backend gives
them), the task's reward and flags, and — after the score pass — μ's per-token log-probs
computed with the trainer's numerics at the sampling temperature and the reference policy's
at temperature 1 (`ref_logprobs`, the same forward pass). Serialisation is msgpack with numpy
arrays stored as little-endian bytes of a fixed dtype per field: safe to read from untrusted
files (no Python object deserialisation).

A multi-turn episode is one record whose completion interleaves the model's turns with the
environment's (tool results, feedback, the chat template's turn tokens): `action_mask` marks
each completion token 1 = model token (an action), 0 = environment token, which every
log-prob reads as context and no loss reads as an action; the per-token log-prob fields hold
0.0 there. `metadata["episode"]` keeps the turns (docs/architecture.md § Contracts).

A mixture of experts' sampler may record `routing`, the experts each completion token went to
(data/routing.py), which the trainer replays with `model.routing_replay: sampler` (docs/moe.md).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

import msgpack
import numpy as np

from jaxrl_llm.data.routing import (
    as_routing,
    routing_from_payload,
    routing_payload,
    routing_problem,
)

# Version 2 added `ref_logprobs`, version 3 `action_mask`, version 4 `routing`; older records
# (no such fields) still load, with None there.
SCHEMA_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
# the schema version that added a field
_SINCE = {"ref_logprobs": 2, "action_mask": 3, "routing": 4}
_INT_FIELDS = ("prompt_ids", "completion_ids")
_FLOAT_FIELDS = ("behavior_logprobs", "raw_logprobs", "mu_logprobs", "ref_logprobs")
_MASK_FIELD = "action_mask"
_INT_DTYPE = np.dtype("<i4")
_FLOAT_DTYPE = np.dtype("<f4")
_MASK_DTYPE = np.dtype("u1")


class RecordError(ValueError):
    """A record that breaks the schema; the message names where it came from and the field."""


@dataclasses.dataclass
class Record:
    """One completion of one prompt.

    Per-token arrays (`behavior_logprobs`, `raw_logprobs`, `mu_logprobs`, `ref_logprobs`,
    `action_mask`) are aligned with `completion_ids`: entry t is log-prob of `completion_ids[t]`
    given the prompt and `completion_ids[:t]`. `None` means "not available" (e.g. μ before the
    score pass); a None `action_mask` means every completion token is the model's.
    """

    prompt_ids: np.ndarray  # [P] int32
    completion_ids: np.ndarray  # [C] int32
    reward: float
    correct: bool = False
    invalid: bool = False
    group_id: int = 0
    task: str = ""
    behavior_logprobs: np.ndarray | None = None  # [C] float32, sampler, after T/top-k/top-p
    raw_logprobs: np.ndarray | None = None  # [C] float32, sampler, before processing
    mu_logprobs: np.ndarray | None = None  # [C] float32, trainer re-score at the sampling T
    ref_logprobs: np.ndarray | None = None  # [C] float32, initial policy = π_ref at T = 1
    # [C] uint8, 1 = model token (an action), 0 = environment/tool/template token
    action_mask: np.ndarray | None = None
    # [C-1, L, k] int8/int16: each completion token's experts per layer, as the sampler routed
    # it (a mixture of experts; data/routing.py); None: not recorded
    routing: np.ndarray | None = None
    answer: str | None = None  # extracted answer (None = none found)
    raw_reward: float | None = None  # reward before a group transform (RLOO, GRPO, PKPO)
    prompt_text: str = ""
    completion_text: str = ""
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)  # JSON-able task info

    def __post_init__(self) -> None:
        self.prompt_ids = np.asarray(self.prompt_ids, dtype=np.int32)
        self.completion_ids = np.asarray(self.completion_ids, dtype=np.int32)
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, np.asarray(value, dtype=np.float32))
        if self.action_mask is not None:
            self.action_mask = _as_mask(self.action_mask)
        if self.routing is not None:
            self.routing = as_routing(self.routing)
        self.reward = float(self.reward)
        self.correct = bool(self.correct)
        self.invalid = bool(self.invalid)
        self.group_id = int(self.group_id)

    @property
    def length(self) -> int:
        """Tokens in prompt + completion."""
        return int(self.prompt_ids.shape[0] + self.completion_ids.shape[0])

    def model_tokens(self, *, where: str = "record") -> np.ndarray:
        """bool [C]: True on the completion's model tokens (all of them without an
        `action_mask`). A mask of another length or with values other than 0/1 is a
        `RecordError` naming `where` (before any array is indexed with it)."""
        n = self.completion_ids.shape[0]
        if self.action_mask is None:
            return np.ones(n, bool)
        _check_mask_values(self.action_mask, n, where)
        return np.asarray(self.action_mask) == 1

    @property
    def num_model_tokens(self) -> int:
        """Completion tokens the model sampled (the actions a loss trains on)."""
        n = self.completion_ids.shape[0]
        return n if self.action_mask is None else int(np.count_nonzero(self.action_mask == 1))

    def replace(self, **changes: Any) -> Record:
        return dataclasses.replace(self, **changes)

    # -- (de)serialisation -------------------------------------------------------------

    def to_bytes(self) -> bytes:
        payload: dict[str, Any] = {"v": SCHEMA_VERSION}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _INT_FIELDS:
                value = np.ascontiguousarray(value, dtype=_INT_DTYPE).tobytes()
            elif f.name in _FLOAT_FIELDS and value is not None:
                value = np.ascontiguousarray(value, dtype=_FLOAT_DTYPE).tobytes()
            elif f.name == _MASK_FIELD and value is not None:
                value = _mask_bytes(value)
            elif f.name == "routing" and value is not None:
                try:
                    value = routing_payload(value)
                except ValueError as err:
                    raise RecordError(str(err)) from err
            payload[f.name] = value
        return msgpack.packb(payload, use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str = "record") -> Record:
        try:
            payload = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except (msgpack.UnpackException, ValueError, TypeError) as err:
            raise RecordError(f"{where}: not a msgpack record ({err})") from err
        if not isinstance(payload, dict):
            raise RecordError(f"{where}: expected a mapping, got {type(payload).__name__}")
        version = payload.pop("v", None)
        if version not in READABLE_VERSIONS:
            raise RecordError(f"{where}: schema version {version!r}, expected one of "
                              f"{list(READABLE_VERSIONS)} (written by a newer jaxrl_llm?)")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(payload) - names
        if unknown:
            raise RecordError(f"{where}: unknown fields {sorted(unknown)}")
        for name, since in _SINCE.items():
            if payload.get(name) is not None and version < since:
                raise RecordError(f"{where}: field {name!r} in a schema version {version} record "
                                  f"(the field arrived in version {since})")
        for name in _INT_FIELDS + _FLOAT_FIELDS + (_MASK_FIELD,):
            value = payload.get(name)
            if value is None:
                continue
            if not isinstance(value, bytes):
                raise RecordError(f"{where}: field {name!r} must be bytes")
            dtype = (_INT_DTYPE if name in _INT_FIELDS else
                     _MASK_DTYPE if name == _MASK_FIELD else _FLOAT_DTYPE)
            if len(value) % dtype.itemsize:
                raise RecordError(f"{where}: field {name!r} has {len(value)} bytes, not a multiple of {dtype.itemsize}")
            payload[name] = np.frombuffer(value, dtype=dtype).astype(dtype.newbyteorder("="))
        if payload.get("routing") is not None:
            routing = routing_from_payload(payload["routing"])
            if isinstance(routing, str):
                raise RecordError(f"{where}: {routing}")
            payload["routing"] = routing
        try:
            return cls(**payload)
        except TypeError as err:
            raise RecordError(f"{where}: {err}") from err

    def to_json(self) -> dict[str, Any]:
        """A JSON-able view (arrays as lists) for `data export-jsonl`."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.tolist() if isinstance(value, np.ndarray) else value
        return out


def _as_mask(value: Any) -> np.ndarray:
    """An action mask as uint8 when its values are 0/1 (bool, int or float); any other values
    are kept as given, so that validation names them instead of a cast hiding them
    (256 → 0)."""
    arr = np.asarray(value)
    if arr.dtype == _MASK_DTYPE:
        return arr
    if arr.dtype == bool or (arr.dtype.kind in "iuf" and np.isin(arr, (0, 1)).all()):
        return arr.astype(_MASK_DTYPE)
    return arr


def _mask_bytes(value: np.ndarray) -> bytes:
    """uint8 bytes of an action mask; values uint8 cannot hold are refused (0..255 are stored
    as they are, so a reader's validation names a 2 where a writer put one)."""
    arr = np.asarray(value)
    if arr.dtype != _MASK_DTYPE:
        exact = arr.dtype.kind in "iub" or (arr.dtype.kind == "f" and np.all(arr == np.round(arr)))
        if not exact or (arr.size and (arr.min() < 0 or arr.max() > 255)):
            raise RecordError(f"field {_MASK_FIELD!r} must hold 0/1 (1 = model token, "
                              f"0 = environment token), got {arr.ravel()[:8].tolist()}")
    return np.ascontiguousarray(arr, dtype=_MASK_DTYPE).tobytes()


def _check_mask_values(mask: np.ndarray, n: int, where: str) -> None:
    """`action_mask` is [n] and holds only 0/1; `RecordError` naming `where` otherwise."""
    if mask.shape != (n,):
        raise RecordError(f"{where}: field {_MASK_FIELD!r} has shape {mask.shape}, completion "
                          f"has {n} tokens")
    bad = ~np.isin(mask, (0, 1))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise RecordError(f"{where}: field {_MASK_FIELD!r} holds {mask[i].item()!r} at token {i}; "
                          "expected 0/1 (1 = model token, 0 = environment token)")


def _check_action_mask(record: Record, where: str) -> None:
    """The action mask's invariants (after the per-token fields' shapes were checked)."""
    n = record.completion_ids.shape[0]
    mask = record.model_tokens(where=where)
    if not mask.any():
        raise RecordError(f"{where}: field {_MASK_FIELD!r} marks no model token (all {n} "
                          "completion tokens are environment tokens): nothing to train on")
    if not mask[0]:
        raise RecordError(f"{where}: field {_MASK_FIELD!r} starts with an environment token (0); "
                          "a completion begins with a model turn (the prompt holds what comes "
                          "before it)")
    for name in _FLOAT_FIELDS:
        lp = getattr(record, name)
        if lp is None:
            continue
        stray = (lp != 0.0) & ~mask
        if stray.any():
            i = int(np.flatnonzero(stray)[0])
            raise RecordError(f"{where}: field {name!r} holds {float(lp[i])} at environment token "
                              f"{i} (action_mask 0); log-probs of environment tokens are stored "
                              "as 0.0, never read as actions")


def pack_batches(batches: Iterable[Sequence[Record]]) -> bytes:
    """Batches of records as one msgpack payload, a list of lists of `Record.to_bytes` (every
    field, metadata included): the exchange's round shards and the checkpointed staleness
    queue."""
    return msgpack.packb([[r.to_bytes() for r in b] for b in batches], use_bin_type=True)


def unpack_batches(payload: bytes, *, where: str) -> list[list[Record]]:
    """The batches `pack_batches` wrote, each record exactly as it was; `RecordError` naming
    `where` (and the batch and record) for anything else."""
    try:
        rows = msgpack.unpackb(payload, raw=False)
    except (msgpack.UnpackException, ValueError, TypeError) as err:
        raise RecordError(f"{where}: not msgpack batches of records ({err})") from err
    if not isinstance(rows, list) or not all(isinstance(b, list) for b in rows):
        raise RecordError(f"{where}: expected a list of batches (lists of records)")
    return [[Record.from_bytes(data, where=f"{where}[batch {b}, record {i}]")
             for i, data in enumerate(batch)] for b, batch in enumerate(rows)]


def validate_record(record: Record, *, where: str, vocab_size: int | None = None) -> None:
    """Check the invariants every consumer relies on; raise `RecordError` naming `where`.

    Lengths agree, log-probs are finite and ≤ 0, token ids lie in [0, vocab), the reward is
    finite, and a record is never both correct and invalid. An `action_mask` holds 0/1 for
    every completion token, starts with a model token, marks at least one, and the log-prob
    fields are 0.0 at its environment tokens. A `routing` is [C − 1, layers, k] non-negative ids,
    distinct per token and layer (data/routing.py).
    """
    if record.prompt_ids.ndim != 1 or record.completion_ids.ndim != 1:
        raise RecordError(f"{where}: prompt_ids/completion_ids must be 1-D")
    if record.prompt_ids.size == 0:
        raise RecordError(f"{where}: prompt_ids is empty (a completion needs a context token)")
    if record.completion_ids.size == 0:
        raise RecordError(f"{where}: completion_ids is empty (nothing to train on or score)")
    n = record.completion_ids.shape[0]
    for name in ("prompt_ids", "completion_ids"):
        ids = getattr(record, name)
        if ids.size and int(ids.min()) < 0:
            raise RecordError(f"{where}: field {name!r} has negative token id {int(ids.min())}")
        if vocab_size is not None and ids.size and int(ids.max()) >= vocab_size:
            raise RecordError(
                f"{where}: field {name!r} has token id {int(ids.max())} >= vocab size {vocab_size}"
            )
    for name in _FLOAT_FIELDS:
        lp = getattr(record, name)
        if lp is None:
            continue
        if lp.shape != (n,):
            raise RecordError(
                f"{where}: field {name!r} has shape {lp.shape}, completion has {n} tokens"
            )
        if not np.all(np.isfinite(lp)):
            bad = int(np.flatnonzero(~np.isfinite(lp))[0])
            raise RecordError(f"{where}: field {name!r} is not finite at token {bad}")
        # A small tolerance: samplers report log-softmax in float32, which can round to +1e-7.
        if lp.size and float(lp.max()) > 1e-5:
            raise RecordError(f"{where}: field {name!r} has a positive log-prob {float(lp.max())}")
    if record.action_mask is not None:
        _check_action_mask(record, where)
    if record.routing is not None and (problem := routing_problem(record.routing, n)):
        raise RecordError(f"{where}: {problem}")
    if not math.isfinite(record.reward):
        raise RecordError(f"{where}: field 'reward' is not finite ({record.reward})")
    if record.raw_reward is not None and not math.isfinite(record.raw_reward):
        raise RecordError(f"{where}: field 'raw_reward' is not finite ({record.raw_reward})")
    if record.correct and record.invalid:
        raise RecordError(f"{where}: record is flagged both correct and invalid")
