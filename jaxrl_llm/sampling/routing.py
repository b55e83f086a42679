"""Recording a mixture of experts' routing while sampling (`generate(..., return_routing=True)`,
docs/moe.md § Routing replay).

A decode step feeds each row the token it sampled at the step before: the experts every layer
routes that token to (`Decoder(return_moe=True)`'s `MoeAux.routing`, [L, B, 1, k]) are the
routing of that completion token, written to column t − 1 of an output buffer
[rows, max_new_tokens, L, k] (the token sampled at step t is fed at step t + 1). A completion's
last token is never fed, so a sample of C tokens has the routing of its first C − 1 tokens
(the trainer's forward never feeds the last token either). The prompt's own tokens are routed
in the prefill, which the trainer recomputes with the same weights (not recorded).

The ids are stored compactly (`data.routing.routing_dtype`: int8 up to 127 experts, else
int16); -1 marks a column no token was fed at. With `return_routing` off the programs are the
ones without it: no buffer, no transfer.
"""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp

from jaxrl_llm.data.routing import routing_dtype

Array = jax.Array


def check_routing_model(model: Any) -> None:
    """`return_routing` needs a mixture of experts: a ValueError naming the family otherwise."""
    config = getattr(model, "config", None)
    if not getattr(config, "is_moe", False):
        family = getattr(config, "family", type(model).__name__)
        raise ValueError(f"return_routing: model family {family!r} has no experts to record "
                         "(a mixture of experts only: qwen3_moe, mixtral, qwen2_moe)")


def routing_buffer(config: Any, rows: int, max_new: int) -> Array:
    """[rows, max_new, L, k] of -1 in the compact dtype: no token fed yet."""
    shape = (rows, max_new, config.num_layers, config.num_experts_per_tok)
    return jnp.full(shape, -1, routing_dtype(config.num_experts))


def step_routing(routing: Array, dtype: Any) -> Array:
    """One decode step's experts [L, B, 1, k] (`MoeAux.routing`) as rows [B, L, k] of `dtype`."""
    chex.assert_rank(routing, 4)
    chex.assert_axis_dimension(routing, 2, 1)
    return jnp.transpose(routing[:, :, 0], (1, 0, 2)).astype(dtype)


__all__ = ["check_routing_model", "routing_buffer", "step_routing"]
