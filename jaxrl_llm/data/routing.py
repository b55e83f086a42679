"""`Record.routing`: the experts a mixture of experts routed each completion token to when it
was sampled (docs/moe.md § Routing replay), stored compactly and placed into batch rows.

routing [C − 1, L, k]: row j holds, for every layer, the k experts completion token j went to
as an input (the sampler feeds token j at the step after it sampled it; the last token is
never an input, to the sampler nor to the trainer). Ids are int8 when the model has at most
127 experts, else int16 (`routing_dtype`); in the msgpack schema a map {shape, dtype, data}
with `data` the little-endian bytes.

In a batch row (inputs = prompt + completion minus its last token, data/collate.py) input
position P + j is completion token j: `routing_row` puts the record's rows there and -1 at the
prompt's positions, which the trainer routes itself (`moe.route`: negative ids = own top-k).
"""

from __future__ import annotations

from typing import Any

import numpy as np

_DTYPES = {"i1": np.dtype("<i1"), "i2": np.dtype("<i2")}


def routing_dtype(num_experts: int) -> np.dtype:
    """int8 when expert ids fit (≤ 127 experts), else int16 (≤ 32,767)."""
    if num_experts <= 127:
        return np.dtype(np.int8)
    if num_experts <= 32767:
        return np.dtype(np.int16)
    raise ValueError(f"{num_experts} experts do not fit the int16 routing ids")


def as_routing(value: Any) -> np.ndarray:
    """An array of expert ids, kept in its integer dtype when that is int8/int16, else cast to
    the narrowest of them that holds its values (other values are left for validation)."""
    arr = np.asarray(value)
    if arr.dtype in (np.int8, np.int16):
        return arr
    if arr.dtype.kind in "iu" and arr.size and 0 <= arr.min() and arr.max() <= 32767:
        return arr.astype(routing_dtype(int(arr.max()) + 1))
    if arr.dtype.kind in "iu" and not arr.size:
        return arr.astype(np.int8)
    return arr


def routing_payload(routing: np.ndarray) -> dict[str, Any]:
    """The msgpack map of `Record.routing` (int8/int16 only: a wider array is a ValueError)."""
    arr = np.asarray(routing)
    code = {np.dtype(np.int8): "i1", np.dtype(np.int16): "i2"}.get(arr.dtype)
    if code is None:
        raise ValueError(f"field 'routing' must be int8 or int16 expert ids, got {arr.dtype}")
    return {"shape": list(arr.shape), "dtype": code,
            "data": np.ascontiguousarray(arr, dtype=_DTYPES[code]).tobytes()}


def routing_from_payload(value: Any) -> np.ndarray | str:
    """`Record.routing` from its msgpack map, or a message saying what is wrong with it."""
    if not isinstance(value, dict) or set(value) != {"shape", "dtype", "data"}:
        return "field 'routing' must be a map {shape, dtype, data}"
    shape, code, data = value["shape"], value["dtype"], value["data"]
    if code not in _DTYPES:
        return f"field 'routing' has dtype {code!r}, expected one of {sorted(_DTYPES)}"
    if (not isinstance(shape, list) or len(shape) != 3
            or not all(isinstance(n, int) and n >= 0 for n in shape)):
        return f"field 'routing' has shape {shape!r}, expected [tokens, layers, k]"
    if not isinstance(data, bytes) or len(data) != int(np.prod(shape)) * _DTYPES[code].itemsize:
        return (f"field 'routing' holds {len(data) if isinstance(data, bytes) else data!r} "
                f"bytes for shape {shape} of {code}")
    dtype = _DTYPES[code]
    return np.frombuffer(data, dtype=dtype).astype(dtype.newbyteorder("=")).reshape(shape)


def routing_problem(routing: np.ndarray, completion_len: int) -> str | None:
    """What breaks `Record.routing`'s invariants (None: nothing): [C − 1, L, k] int8/int16,
    ids ≥ 0, a token's k ids distinct in every layer."""
    if routing.dtype not in (np.int8, np.int16):
        return f"field 'routing' must hold int8/int16 expert ids, got {routing.dtype}"
    if routing.ndim != 3 or routing.shape[0] != completion_len - 1:
        return (f"field 'routing' has shape {routing.shape}; expected [{completion_len - 1}, "
                "layers, k] (every completion token but the last, which is never an input)")
    if routing.size and int(routing.min()) < 0:
        j = int(np.argwhere(routing < 0)[0][0])
        return f"field 'routing' has a negative expert id at completion token {j}"
    ordered = np.sort(routing, axis=-1)
    repeated = np.any(ordered[..., 1:] == ordered[..., :-1], axis=-1)
    if repeated.any():
        j, layer = (int(i) for i in np.argwhere(repeated)[0])
        return (f"field 'routing' routes completion token {j} to one expert twice in layer "
                f"{layer} (top-k ids are distinct)")
    return None


def routing_row(routing: np.ndarray, prompt_len: int, row_len: int) -> np.ndarray:
    """[row_len, L, k] int16 for a batch row of `row_len` = P + C − 1 inputs: the record's
    routing at input positions P.. (completion tokens 0..C − 2), -1 at the prompt's."""
    layers, k = routing.shape[1:]
    row = np.full((row_len, layers, k), -1, np.int16)
    row[prompt_len:prompt_len + routing.shape[0]] = routing
    return row


def routing_info(config: Any) -> dict[str, Any]:
    """The manifest's `extra.routing` for records a sampler recorded routing into: what the
    trainer checks before it replays them (`train.preflight.check_routing`)."""
    return {"layers": int(config.num_layers), "experts_per_token": int(config.num_experts_per_tok),
            "num_experts": int(config.num_experts),
            "dtype": routing_dtype(config.num_experts).name, "tokens": "completion[:-1]"}


__all__ = ["as_routing", "routing_dtype", "routing_from_payload", "routing_info",
           "routing_payload", "routing_problem", "routing_row"]
