"""A layer scan whose backward pass adds each layer's weight gradient into a float32
gradient accumulator in place, for micro-batch gradient accumulation.

With `jax.lax.scan` over stacked layer weights, the backward pass stacks one micro-batch's
weight gradient for all layers ([L, ...], a parameter-sized tree) before the train step can
add it to its accumulator. `accumulating_layer_scan` instead takes the float32 master weights
and the accumulator: the forward pass casts one layer at a time and keeps only each layer's
input (as `remat: full`), and the backward pass recomputes one layer at a time and adds its
weight gradient into that layer's slice of the accumulator, so no stacked micro-batch
gradient exists (FPA's Qwen3-4B on v5e-8: 0.80 GiB less per chip, docs/plan.md).

Its VJP is deliberately not the plain gradient: the cotangent it returns for `params` is
`accumulator + ∂loss/∂params` (the accumulator's own cotangent is zero), so
`jax.grad(loss)(params)` *is* the updated accumulator for the layer weights. Use it only as
the train step does (train/step.py), with the accumulator not otherwise differentiated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

Array = jax.Array


@struct.dataclass
class LayerGradAccumulator:
    """The float32 gradient accumulator of the stacked layer weights (same tree as the
    layers' pure params) and the dtype each layer weight is cast to for compute."""

    grads: Any
    dtypes: Any = struct.field(pytree_node=False)


def _slice(tree: Any, i: Array) -> Any:
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


def accumulating_layer_scan(layer: Callable[[Any, Array, Any], Array], params: Any,
                            accumulator: LayerGradAccumulator, x: Array, xs: Any) -> Array:
    """`x` through `layer(p_i, x, xs_i)` for i = 0..L-1, `p_i` the i-th slice of the float32
    stacked `params` cast to `accumulator.dtypes` and `xs_i` the i-th slice of `xs`.

    Same value as a `jax.lax.scan`; differentiated, the cotangent for `params` is
    `accumulator.grads + ∂/∂params` (module docstring). `layer` may close over values that are
    not differentiated (rotary tables, masks, segment ids)."""
    dtypes = accumulator.dtypes
    num_layers = jax.tree.leaves(params)[0].shape[0]

    def cast(p: Any) -> Any:
        return jax.tree.map(lambda a, d: a.astype(d), p, dtypes)

    def run(params, x, xs):
        def body(h, i):
            return layer(cast(_slice(params, i)), h, _slice(xs, i)), h

        return jax.lax.scan(body, x, jnp.arange(num_layers))

    @jax.custom_vjp
    def scan(params, grads, x, xs):
        return run(params, x, xs)[0]

    def scan_fwd(params, grads, x, xs):
        y, inputs = run(params, x, xs)
        return y, (params, grads, inputs, xs)

    def scan_bwd(res, ct_y):
        params, grads, inputs, xs = res

        def body(carry, i):
            ct_h, grads = carry
            p_i = _slice(params, i)
            _, vjp = jax.vjp(lambda p, h: layer(cast(p), h, _slice(xs, i)), p_i, inputs[i])
            g_i, ct_h = vjp(ct_h)
            grads = jax.tree.map(
                lambda acc, g: jax.lax.dynamic_update_index_in_dim(
                    acc, jax.lax.dynamic_index_in_dim(acc, i, 0, keepdims=False)
                    + g.astype(acc.dtype), i, 0),
                grads, g_i)
            return (ct_h, grads), None

        (ct_x, grads), _ = jax.lax.scan(body, (ct_y, grads), jnp.arange(num_layers)[::-1])
        return grads, None, ct_x, None

    scan.defvjp(scan_fwd, scan_bwd)
    return scan(params, accumulator.grads, x, xs)
