"""How often a mixture of experts' trainer would route a record's tokens elsewhere than its
sampler did (docs/moe.md § Router disagreement): the records' recorded experts
(`Record.routing`) against a model's own routing of the same tokens, as the trainer's
cache-free forward computes it when it does not replay them.

A (token, layer) pair disagrees when the two top-k expert *sets* differ (the order within a
token's k experts does not matter: the gates follow the experts). Counted over the tokens that
have routing (every completion token but the last, data/routing.py).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def model_routing(model: Any, rows: Sequence[tuple[np.ndarray, np.ndarray]],
                  length: int) -> list[np.ndarray]:
    """[C − 1, L, k] experts `model` routes each (prompt ids, completion ids) row's completion
    tokens to (inputs: prompt + completion minus its last token, right-padded to `length`;
    one jitted cache-free forward of all rows)."""
    tokens = np.zeros((len(rows), length), np.int32)
    for i, (prompt, completion) in enumerate(rows):
        seq = np.concatenate([prompt, completion[:-1]])
        if seq.size > length:
            raise ValueError(f"row {i} has {seq.size} inputs, more than length={length}")
        tokens[i, :seq.size] = seq
    graphdef, state = nnx.split(model)
    routing = np.asarray(_route(graphdef, state, jnp.asarray(tokens)))  # [L, B, T, k]
    return [routing[:, i, p.size:p.size + c.size - 1].transpose(1, 0, 2)
            for i, (p, c) in enumerate(rows)]


@functools.partial(jax.jit, static_argnums=0)
def _route(graphdef: Any, state: Any, tokens: jax.Array) -> jax.Array:
    return nnx.merge(graphdef, state)(tokens, return_moe=True)[1].routing


class RouterDisagreement:
    """Counts of disagreeing (token, layer) pairs per layer, and of tokens that disagree in at
    least one layer, over every `add`."""

    def __init__(self, layers: int) -> None:
        self.layer = np.zeros(layers, np.int64)
        self.any_layer = 0
        self.tokens = 0

    def add(self, recorded: np.ndarray, recomputed: np.ndarray) -> None:
        """recorded, recomputed: [tokens, L, k] expert ids of the same tokens."""
        if recorded.shape != recomputed.shape:
            raise ValueError(f"routing shapes differ: {recorded.shape} and {recomputed.shape}")
        differ = np.any(np.sort(recorded, -1) != np.sort(recomputed, -1), axis=-1)  # [T, L]
        self.layer += differ.sum(axis=0)
        self.any_layer += int(differ.any(axis=1).sum())
        self.tokens += differ.shape[0]

    def to_json(self) -> dict[str, Any]:
        """per_layer: the fraction of tokens each layer routes elsewhere; mean: over layers;
        any_layer: the fraction of tokens routed elsewhere in some layer; tokens: counted."""
        per_layer = (self.layer / max(self.tokens, 1)).tolist()
        return {"per_layer": per_layer, "mean": float(np.mean(per_layer)),
                "any_layer": self.any_layer / max(self.tokens, 1), "tokens": self.tokens}


__all__ = ["RouterDisagreement", "model_routing"]
