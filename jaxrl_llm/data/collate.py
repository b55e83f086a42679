"""Records -> batch rows -> fixed-shape `Batch`es (padded rows, or packed rows).

Row alignment (data/batch.py): a record's tokens `x = prompt + completion` (length L) give a
row of length L−1 with `inputs = x[:-1]`, `targets = x[1:]`; completion token j is the target
at position P−1+j, where the per-token log-prob arrays are placed and `loss_mask` is 1 when
token j is the model's (`Record.action_mask`; every completion token without one). An
environment token of a multi-turn episode is an input (context for what follows) and a target
with `loss_mask` 0 and log-probs 0: no loss reads it as an action.
With routing replay (`record_row(routing=True)`) a row also carries the experts its completion
tokens were sampled with, [L−1, layers, k] (-1 on the prompt: data/routing.py), and the batch
a `routing` array.
`data/loader.py` (the grain pipeline) and the score pass both build their batches here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl_llm.data.batch import Batch, empty_pairs
from jaxrl_llm.data.records import Record, RecordError
from jaxrl_llm.data.routing import routing_problem, routing_row

# Row arrays copied from `record_row` into a batch row (positions/segment ids are derived).
_TOKEN_KEYS = ("inputs", "targets", "loss_mask", "behavior_logprobs", "mu_logprobs", "ref_logprobs")
__all__ = ["collate", "collate_packed", "record_row"]


def record_row(record: Record, *, require_mu: bool = False, require_ref: bool = False,
               where: str = "record", routing: bool = False) -> dict[str, Any]:
    """One record as unpadded row arrays of length L−1 (the row alignment above).

    A missing per-token array is placed as zeros; `require_mu` / `require_ref` make a missing
    `mu_logprobs` / `ref_logprobs` an error instead (a loss reading them must never see 0).
    `routing` (`model.routing_replay: sampler`): the row carries the record's experts; a
    record without them is an error.
    Environment tokens (`action_mask` 0) get `loss_mask` 0 and 0.0 in every log-prob array,
    whatever a record not yet validated holds there.
    """
    p, c = record.prompt_ids.size, record.completion_ids.size
    model = record.model_tokens(where=where)
    tokens = np.concatenate([record.prompt_ids, record.completion_ids])
    n = tokens.size - 1
    loss_mask = np.zeros(n, np.float32)
    loss_mask[p - 1 :] = model

    def place(values: np.ndarray | None) -> np.ndarray:
        row = np.zeros(n, np.float32)
        if values is not None:
            row[p - 1 :] = np.where(model, values, 0.0)
        return row

    if require_mu and record.mu_logprobs is None and c:
        raise RecordError(f"{where}: no mu_logprobs; run `jaxrl-llm score` first (loss.mu_source=trainer)")
    if require_ref and record.ref_logprobs is None and c:
        raise RecordError(f"{where}: no ref_logprobs; run `jaxrl-llm score` (it writes them) or set "
                          "train.ref_logprobs=model")
    row = {
        "inputs": tokens[:-1], "targets": tokens[1:], "loss_mask": loss_mask,
        "behavior_logprobs": place(record.behavior_logprobs), "mu_logprobs": place(record.mu_logprobs),
        "ref_logprobs": place(record.ref_logprobs),
        "reward": np.float32(record.reward), "correct": record.correct, "group_id": record.group_id,
        "record_mask": np.float32(1.0),
    }
    if routing:
        if record.routing is None:
            raise RecordError(f"{where}: no routing (the experts its tokens were sampled with), "
                              "but model.routing_replay=sampler replays them: sample with "
                              "model.routing_replay=sampler (the JAX sampler records them; "
                              "vLLM records have none) or set model.routing_replay=off")
        if (problem := routing_problem(record.routing, c)):
            raise RecordError(f"{where}: {problem}")
        row["routing"] = routing_row(record.routing, p, n)
    return row


def _padding_row() -> dict[str, Any]:
    return {"inputs": np.zeros(0, np.int32), "reward": np.float32(0.0), "correct": False,
            "group_id": -1, "record_mask": np.float32(0.0)}


def collate(rows: Sequence[dict[str, Any]], batch_size: int, lengths: Sequence[int], *,
            pairs: bool = False) -> Batch:
    """Stack rows into a `Batch` of `batch_size` rows, right-padded to the smallest fitting length.

    With `pairs`, rows (2i, 2i+1) are a (chosen, rejected) pair — the unit the loader shuffles,
    written by `curate` with `data.curation: dpo` — and `pair_index[i]` is (2i, 2i+1), or
    (−1, −1) for a padding unit. The pairs are taken as written, never re-formed from group ids:
    `curate` may pair one response with several others, and a batch that straddles an epoch
    boundary may hold the same pair twice; re-pairing by group would then invent pairs.
    """
    longest = max((r["inputs"].size for r in rows), default=0)
    t = next((n for n in lengths if n >= longest), None)
    if t is None:
        raise RecordError(f"a row of length {longest} exceeds the longest bucket {lengths[-1]}")
    out, per_record = _blank_arrays(batch_size, t, batch_size, rows)
    for i, row in enumerate(rows):
        _place(out, per_record, row, i, slice(0, row["inputs"].size), segment=1, slot=i)
    pair_index = empty_pairs()
    if pairs:
        pair_index = unit_pairs(per_record["record_mask"])
    return Batch(**out, **per_record, pair_index=pair_index)


def unit_pairs(record_mask: np.ndarray) -> np.ndarray:
    """`int32 [B/2, 2]`: (2i, 2i+1) where both rows are records, else (−1, −1)."""
    first = np.arange(0, record_mask.size, 2, dtype=np.int32)
    real = (record_mask[0::2] > 0) & (record_mask[1::2] > 0)
    return np.where(real[:, None], np.stack([first, first + 1], axis=1), -1).astype(np.int32)


def collate_packed(rows: Sequence[Sequence[dict[str, Any]]], batch_size: int, max_len: int,
                   records_per_row: int) -> Batch:
    """A packed `Batch` (data/batch.py): `rows[i]` are the records of row i, in segment order.

    Row i holds its records back to back from position 0, record j with `segment_ids` j+1 and
    positions 0..n−1; its per-record fields go to slot `i·k + j` of the [B·k] arrays. Missing
    rows and slots are padding (`record_mask` 0, all masks 0, group id −1).
    """
    b, k = batch_size, records_per_row
    if len(rows) > b:
        raise RecordError(f"collate_packed: {len(rows)} rows for a batch of {b}")
    out, per_record = _blank_arrays(b, max_len, b * k, [r for row in rows for r in row])
    for i, records in enumerate(rows):
        if len(records) > k:
            raise RecordError(f"collate_packed: row {i} has {len(records)} records > records_per_row={k}")
        start = 0
        for j, row in enumerate(records):
            end = start + row["inputs"].size
            if end > max_len:
                raise RecordError(f"collate_packed: row {i} needs {end} tokens > max_len={max_len}")
            _place(out, per_record, row, i, slice(start, end), segment=j + 1, slot=i * k + j)
            start = end
    return Batch(**out, **per_record, pair_index=empty_pairs())


def _blank_arrays(rows: int, length: int, records: int, given: Sequence[dict[str, Any]] = ()
                  ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """All-padding token arrays [rows, length] and per-record arrays [records]; a routing
    array [rows, length, L, k] of -1 when the `given` rows carry routing (all of them must)."""
    out = {k: np.zeros((rows, length), np.int32) for k in ("inputs", "targets", "positions", "segment_ids")}
    out.update({k: np.zeros((rows, length), np.float32)
                for k in ("loss_mask", "behavior_logprobs", "mu_logprobs", "ref_logprobs")})
    real = [r for r in given if r["record_mask"] > 0]
    carried = [r["routing"] for r in real if "routing" in r]
    if carried:
        if len(carried) != len(real):
            raise RecordError("a batch mixes rows with routing and rows without "
                              "(record_row(routing=...) must be the same for every row)")
        out["routing"] = np.full((rows, length, *carried[0].shape[1:]), -1, np.int16)
    per_record = {"rewards": np.zeros(records, np.float32), "correct": np.zeros(records, bool),
                  "group_ids": np.full(records, -1, np.int32), "record_mask": np.zeros(records, np.float32)}
    return out, per_record


def _place(out: dict[str, np.ndarray], per_record: dict[str, np.ndarray], row: dict[str, Any], i: int,
           span: slice, *, segment: int, slot: int) -> None:
    """Write one `record_row` into batch row i at `span` (segment id `segment`) and record `slot`."""
    n = span.stop - span.start
    if n:
        for key in _TOKEN_KEYS + (("routing",) if "routing" in out else ()):
            out[key][i, span] = row[key]
        out["positions"][i, span] = np.arange(n)
        out["segment_ids"][i, span] = segment
    per_record["rewards"][slot], per_record["correct"][slot] = row["reward"], row["correct"]
    per_record["group_ids"][slot], per_record["record_mask"][slot] = row["group_id"], row["record_mask"]
