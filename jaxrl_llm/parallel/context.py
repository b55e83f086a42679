"""Context parallelism: the load-balanced token order of a row split over the "context" axis.

With `mesh.context` = c > 1 every [B, T] array of a batch is split along T over c chips. Under
a causal mask the last tokens attend to the most keys, so a contiguous split would give the
last chip ~(2c−1)× the first one's attention work. The row is therefore cut into 2c chunks and
chip i gets chunks i and 2c−1−i (MaxText's load-balanced reorder; Brandon et al., Striped
Attention, arXiv:2311.09431, for the imbalance): every chip then holds one early and one late
chunk and the same causal work.

The reorder is done once on the host, on the whole batch (`reorder_batch`, called where host
batches become global arrays: `parallel.distributed.global_batch*`, and so `Policy.batch`;
the scorer reorders its own token rows), and applies the same permutation to every
per-token array: inputs, targets, positions, segment ids, masks and per-token log-probs. The
batch records the order it is in (`Batch.context_order`, static): `reorder_batch` converts
from whatever order a batch is in, so a batch is never permuted twice, and the train step
refuses a batch whose order is not its mesh's (`check_order`) rather than train on causal
masks for the wrong order; `Policy.step` converts one for the user. The next-token shift is already explicit in the batch
(`targets[t]` is the token after `inputs[t]` in the original order), so it survives the
permutation; per-record sums over tokens are order-free. What does depend on the order is
causality: the model is told the order (`Decoder(context_order=c)`), and its attention masks
compare original slots (`load_balance_order`), not array slots.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxrl_llm.data.batch import TOKEN_FIELDS


class BatchOrderError(ValueError):
    """A `Batch` whose token order (`Batch.context_order`) is not the one a step's mesh
    trains on; the message says how to convert it."""


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
    """`batch` (a `Batch` of host arrays) in the order of `context` shards: every [B, T]
    array in `load_balance_order(T, context)` (context = 1: the natural order), whatever
    order it was in (`batch.context_order`), which is set to `context`.

    Per-record arrays ([B·k]) and `pair_index` are unchanged; a batch already in that order
    is returned itself. Raises ValueError naming the batch's length when 2c does not divide it.
    """
    current = batch.context_order
    if current == context:
        return batch
    t = np.shape(batch.inputs)[1]
    # from the current order back to the natural one, then into the new one: one gather
    order = np.arange(t, dtype=np.int32)
    if current > 1:
        order = order[inverse_order(load_balance_order(t, current))]
    if context > 1:
        order = order[load_balance_order(t, context)]
    out = {name: np.asarray(getattr(batch, name))[:, order] for name in TOKEN_FIELDS}
    return batch.replace(**out, context_order=context)


def order_name(context: int) -> str:
    """How a token order reads in a message."""
    if context == 1:
        return "the natural token order"
    return f"the load-balanced token order of {context} context shards"


def check_order(batch: Any, context: int) -> None:
    """Raise `BatchOrderError` unless `batch` is in the token order a mesh with
    `mesh.context` = `context` trains on (`Batch.context_order`; a traced batch is checked
    too: the order is static). Naming what converts it."""
    order = batch.context_order
    if order == context:
        return
    mesh = (f"a mesh with mesh.context={context}" if context > 1
            else "a mesh without context parallelism (mesh.context=1)")
    raise BatchOrderError(
        f"this Batch is in {order_name(order)} (Batch.context_order={order}) but the train "
        f"step on {mesh} needs {order_name(context)}: its causal masks would be wrong. "
        "Policy.step(batch) converts it for you; for the train step itself build the batch "
        "with parallel.distributed.global_batch(host_batch, mesh) (or Policy.batch), which "
        f"put it in the mesh's order, or convert host arrays with "
        f"parallel.context.reorder_batch(batch, {context})")


def restore_order(values: np.ndarray, context: int) -> np.ndarray:
    """[B, T] host values computed on reordered rows, back in the original token order."""
    if context == 1:
        return values
    return values[:, inverse_order(load_balance_order(values.shape[1], context))]


def padded_length(length: int, context: int) -> int:
    """The smallest multiple of 2c at or above `length` (the scorer pads its rows to it)."""
    n = chunk_count(context)
    return -(-length // n) * n
