"""Context parallelism: the load-balanced token order of a row split over the "context" axis.

With `mesh.context` = c > 1 every [B, T] array of a batch is split along T over c chips. Under
a causal mask the last tokens attend to the most keys, so a contiguous split would give the
last chip ~(2c−1)× the first one's attention work. The row is therefore cut into 2c chunks and
chip i gets chunks i and 2c−1−i (MaxText's load-balanced reorder; Brandon et al., Striped
Attention, arXiv:2311.09431, for the imbalance): every chip then holds one early and one late
chunk and the same causal work.

The reorder is done once on the host, on the whole batch (`reorder_batch`, called where host
batches become global arrays: `parallel.distributed.global_batch*` and the scorer), and
applies the same permutation to every per-token array: inputs, targets, positions, segment
ids, masks and per-token log-probs. The next-token shift is already explicit in the batch
(`targets[t]` is the token after `inputs[t]` in the original order), so it survives the
permutation; per-record sums over tokens are order-free. What does depend on the order is
causality: the model is told the order (`Decoder(context_order=c)`), and its attention masks
compare original slots (`load_balance_order`), not array slots.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# Batch fields that are not [B, T] token arrays (kept as they are).
_ROW_FIELDS = ("pair_index",)


def chunk_count(context: int) -> int:
    """2c: the chunks a row is cut into for c context shards."""
    return 2 * context


def load_balance_order(length: int, context: int) -> np.ndarray:
    """int32 [length]: the original slot of each slot of the reordered row.

    Chunks of `length / 2c` tokens in the order 0, 2c−1, 1, 2c−2, …, c−1, c, so the c
    contiguous shards of the reordered row hold chunks (i, 2c−1−i). Raises ValueError when 2c
    does not divide `length`.
    """
    n = chunk_count(context)
    if length % n:
        raise ValueError(f"a row of {length} tokens does not split into 2 × mesh.context = {n} "
                         "equal chunks")
    size = length // n
    chunks = [j for i in range(context) for j in (i, n - 1 - i)]
    return (np.asarray(chunks)[:, None] * size + np.arange(size)[None, :]).reshape(-1).astype(
        np.int32)


def inverse_order(order: np.ndarray) -> np.ndarray:
    """The permutation that undoes `order` (x_reordered[:, inverse] = x_original)."""
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.size, dtype=order.dtype)
    return inverse


def reorder_batch(batch: Any, context: int) -> Any:
    """`batch` (a `Batch` of host arrays) with every [B, T] array in `load_balance_order`.

    Per-record arrays ([B·k]) and `pair_index` are unchanged; c = 1 returns `batch` itself.
    Raises ValueError naming the batch's length when 2c does not divide it.
    """
    if context == 1:
        return batch
    b, t = np.shape(batch.inputs)
    order = load_balance_order(t, context)
    out = {}
    for name in batch.__dataclass_fields__:
        value = getattr(batch, name)
        if name not in _ROW_FIELDS and np.ndim(value) == 2 and np.shape(value) == (b, t):
            out[name] = np.asarray(value)[:, order]
    return batch.replace(**out)


def restore_order(values: np.ndarray, context: int) -> np.ndarray:
    """[B, T] host values computed on reordered rows, back in the original token order."""
    if context == 1:
        return values
    return values[:, inverse_order(load_balance_order(values.shape[1], context))]


def padded_length(length: int, context: int) -> int:
    """The smallest multiple of 2c at or above `length` (the scorer pads its rows to it)."""
    n = chunk_count(context)
    return -(-length // n) * n
