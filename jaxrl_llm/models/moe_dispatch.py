"""Token dispatch to experts: dropless grouped matmuls, on one device or over an "expert" axis.

`experts_local(p, x, ids, gates)`: every expert is on this device (or GSPMD places them). The
N·k (token, top-k slot) pairs are sorted by expert (stable), each expert's rows are one group
of `jax.lax.ragged_dot` (group sizes from a bincount), and the outputs are unsorted, weighted
by their gates and summed over the k slots. No capacity factor: no token is ever dropped.

`experts_sharded(...)`: the experts are split over the mesh's "expert" axis (E/ep per
device; `parallel/rules.py` maps the "experts" logical axis there) and the batch's rows too
(`parallel.mesh.batch_axes`). Under a `shard_map`, each device

1. all-gathers the tokens, expert ids and gates of its expert group (the ep devices that
   share its data/fsdp/context coordinates) over "expert": [ep·n, d];
2. sorts the (token, slot) pairs whose expert is one of its own E/ep first (the others get a
   sentinel group past the end, masked to zero) and runs them through its experts with the
   same grouped matmuls (F split over "tensor" when it divides, then summed over "tensor");
3. reduce-scatters the weighted outputs over "expert" (`psum_scatter`): each device gets back
   the sum over all experts for its own rows.

All-gather + reduce-scatter moves (ep−1)/ep of the group's tokens per layer whatever the
routing, with static shapes and no dropped token. An all-to-all moves only the rows that
change devices, but with static shapes a dropless one must size every buffer for the worst
case (all of a device's k·n pairs to one peer): ep·k·n rows each way (`moe_dispatch:
all_to_all`, kept to measure against: benchmarks/moe_dispatch.py; compiled for a v5e:2x4
with top-8 it moved 11-16x the bytes and needed 1.4x the temporaries, docs/plan.md).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxrl_llm.core.errors import ConfigError
from jaxrl_llm.models.attention import current_mesh
from jaxrl_llm.models.config import DecoderConfig
from jaxrl_llm.parallel.mesh import (
    CONTEXT_AXIS,
    EXPERT_AXIS,
    batch_axes,
    batch_shards,
    context_shards,
    expert_shards,
)

Array = jax.Array


class ExpertAxisError(ConfigError):
    """Experts that cannot be split over the mesh's "expert" axis (names both sizes)."""


def check_expert_axis(num_experts: int, expert_axis: int, *, where: str = "the model") -> None:
    """A clear error when `expert_axis` (mesh.expert) does not divide `num_experts`."""
    if expert_axis > 1 and (num_experts == 0 or num_experts % expert_axis):
        what = ("has no experts (a dense model)" if num_experts == 0
                else f"has num_experts={num_experts}")
        raise ExpertAxisError(
            f"mesh.expert={expert_axis} does not divide the experts: {where} {what}; set "
            "mesh.expert to a divisor of num_experts (or 1)")


def dispatch_mesh() -> Any:
    """The mesh the model is traced under when it has more than one device (the dispatch then
    runs per device under a `shard_map`, sorting only the device's own tokens), else None."""
    mesh = current_mesh()
    return mesh if mesh is not None and mesh.size > 1 else None


def sort_by_expert(ids: Array, num_groups: int) -> tuple[Array, Array]:
    """(order [N·k], group_sizes [num_groups]): the flattened (token, slot) pairs sorted by
    group id (stable), and each group's row count (ids ≥ num_groups are counted in none: they
    sort after every group)."""
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.sum(jax.nn.one_hot(flat, num_groups, dtype=jnp.int32), axis=0)
    return order, sizes


def grouped_mlp(gate: Array, up: Array, down: Array, rows: Array, sizes: Array,
                dtype: Any) -> Array:
    """Rows [M, d] sorted by expert (group sizes [E]) through their experts' SwiGLU MLPs
    (gate/up [E, d, F], down [E, F, d]) as grouped matmuls -> [M, d]; rows past the groups
    come out as zeros only where the caller masks them."""
    rows = rows.astype(dtype)
    h = (jax.nn.silu(jax.lax.ragged_dot(rows, gate.astype(dtype), sizes))
         * jax.lax.ragged_dot(rows, up.astype(dtype), sizes))
    return jax.lax.ragged_dot(h, down.astype(dtype), sizes)


def _combine(out: Array, order: Array, gates: Array) -> Array:
    """Sorted outputs [N·k, d] back to token order, weighted by gates [N, k] and summed over
    the k slots -> [N, d] float32."""
    n, k = gates.shape
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    return jnp.einsum("nkd,nk->nd", out[inverse].reshape(n, k, -1).astype(jnp.float32), gates)


def experts_local(p: dict[str, Any], x: Array, ids: Array, gates: Array,
                  config: DecoderConfig) -> Array:
    """Σ_j g_j · expert_{ids_j}(x) for tokens x [N, d], ids/gates [N, k] -> [N, d] float32,
    every expert's weights in `p` (module docstring)."""
    k = ids.shape[1]
    order, sizes = sort_by_expert(ids, config.num_experts)
    out = grouped_mlp(p["gate"], p["up"], p["down"], x[order // k], sizes,
                      config.compute_jnp_dtype)
    return _combine(out, order, gates)


def _own_experts(p: dict[str, Any], x: Array, ids: Array, gates: Array, first: Array,
                 dtype: Any) -> Array:
    """The part of Σ_j g_j · expert_{ids_j}(x) whose experts are this device's E_l experts
    (ids first .. first + E_l − 1; p holds their weights) -> [N, d] float32."""
    e_local = p["gate"].shape[0]
    k = ids.shape[1]
    local = ids - first
    mine = (local >= 0) & (local < e_local)
    order, sizes = sort_by_expert(jnp.where(mine, local, e_local), e_local)
    out = grouped_mlp(p["gate"], p["up"], p["down"], x[order // k], sizes, dtype)
    out = jnp.where(mine.reshape(-1)[order][:, None], out, 0)
    return _combine(out, order, jnp.where(mine, gates, 0.0))


def _dims(mesh: Any, x: Array, p: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(row axes, token axis, F axis) of the map: rows over the batch axes when they divide
    the rows (else replicated), tokens over "context" likewise, F over "tensor" likewise."""
    rows = batch_axes(mesh) if x.shape[0] % batch_shards(mesh) == 0 else None
    c = context_shards(mesh)
    tokens = CONTEXT_AXIS if c > 1 and x.shape[1] % c == 0 else None
    tensor = mesh.shape.get("tensor", 1)
    width = "tensor" if tensor > 1 and p["gate"].shape[-1] % tensor == 0 else None
    return rows, tokens, width


def experts_sharded(p: dict[str, Any], x: Array, ids: Array, gates: Array,
                    config: DecoderConfig, mesh: Any) -> Array:
    """`experts_local` per device of `mesh`, with the experts split over its "expert" axis
    when it has one: x [B, T, d], ids/gates [B, T, k] -> [B, T, d] float32 (module
    docstring). Without an "expert" axis each device runs every expert on its own rows."""
    ep = expert_shards(mesh)
    check_expert_axis(config.num_experts, ep)
    rows, tokens, width = _dims(mesh, x, p)
    gathered = rows is not None and EXPERT_AXIS in rows
    dtype = config.compute_jnp_dtype
    all_to_all = config.moe_dispatch == "all_to_all" and gathered

    def local(gate, up, down, x, ids, gates):
        weights = {"gate": gate, "up": up, "down": down}
        first = jax.lax.axis_index(EXPERT_AXIS) * gate.shape[0] if ep > 1 else jnp.int32(0)
        b, t, d = x.shape
        if all_to_all:
            y = _all_to_all(weights, x.reshape(b * t, d), ids.reshape(b * t, -1),
                            gates.reshape(b * t, -1), ep, dtype)
        else:
            if gathered:  # the expert group's tokens, [ep·b, t, ...]
                x, ids, gates = (jax.lax.all_gather(a, EXPERT_AXIS, axis=0, tiled=True)
                                 for a in (x, ids, gates))
            n = x.shape[0] * t
            y = _own_experts(weights, x.reshape(n, d), ids.reshape(n, -1),
                             gates.reshape(n, -1), first, dtype).reshape(x.shape[0], t, d)
        if width is not None:  # each "tensor" shard summed over its part of F
            y = jax.lax.psum(y, "tensor")
        if all_to_all:
            return y.reshape(b, t, d)
        if gathered:  # each device keeps the sum over all experts of its own rows
            return jax.lax.psum_scatter(y, EXPERT_AXIS, scatter_dimension=0, tiled=True)
        return jax.lax.psum(y, EXPERT_AXIS) if ep > 1 else y

    token_spec = P(rows, tokens, None)
    experts = EXPERT_AXIS if ep > 1 else None
    w_in, w_out = P(experts, None, width), P(experts, width, None)
    return jax.shard_map(local, mesh=mesh,
                         in_specs=(w_in, w_in, w_out, token_spec, token_spec, token_spec),
                         out_specs=token_spec, check_vma=False)(
        p["gate"], p["up"], p["down"], x, ids, gates.astype(jnp.float32))


def _all_to_all(p: dict[str, Any], x: Array, ids: Array, gates: Array, ep: int,
                dtype: Any) -> Array:
    """Dropless all-to-all dispatch on static shapes (module docstring): each device sends
    every peer a buffer of all its n·k pairs (those for other peers zeroed, so any routing
    fits), computes what it received for its own experts, and sends the results back."""
    n, k = ids.shape
    e_local = p["gate"].shape[0]
    pairs = x[jnp.repeat(jnp.arange(n), k)]  # [n·k, d], pair j = (token j // k, slot j % k)
    flat_ids = ids.reshape(-1)
    dest = flat_ids // e_local
    # send[s] = the pairs for peer s (others zero), with their expert id on that peer
    send = jnp.where((dest[None, :] == jnp.arange(ep)[:, None])[..., None], pairs[None], 0)
    send_ids = jnp.where(dest[None, :] == jnp.arange(ep)[:, None], flat_ids % e_local,
                         e_local)[..., None]
    recv = jax.lax.all_to_all(send, EXPERT_AXIS, 0, 0, tiled=False)  # [ep, n·k, d]
    recv_ids = jax.lax.all_to_all(send_ids, EXPERT_AXIS, 0, 0, tiled=False)
    m = ep * n * k
    local_ids = recv_ids.reshape(m, 1)
    mine = local_ids < e_local
    out = _own_experts(p, recv.reshape(m, -1), local_ids, mine.astype(jnp.float32),
                       jnp.int32(0), dtype).reshape(ep, n * k, -1)
    back = jax.lax.all_to_all(out, EXPERT_AXIS, 0, 0, tiled=False)  # [ep, n·k, d]
    per_pair = jnp.sum(back, axis=0).reshape(n, k, -1)  # exactly one peer computed each pair
    return jnp.einsum("nkd,nk->nd", per_pair, gates)


__all__ = ["ExpertAxisError", "check_expert_axis", "dispatch_mesh", "experts_local",
           "experts_sharded", "grouped_mlp", "sort_by_expert"]
