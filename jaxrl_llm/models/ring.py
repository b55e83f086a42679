"""Ring attention (Ring Attention arXiv:2310.01889): the context-parallel strategy that never
holds a whole row's keys and values on one chip (`model.attention: ring`).

Each chip keeps its queries (its two load-balanced chunks of every row, `parallel/context.py`)
and its own chunk of keys and values; in c steps the key/value chunks travel round the
"context" axis (`jax.lax.ppermute`, chip i → i + 1), and each step folds one chunk into a
float32 online softmax (running max m, normaliser l, weighted sum a: the flash-attention
recurrence), so after c steps every query has seen every key once. The mask is the jnp path's
(`layers.attention_mask`): same segment, not padding, key's original slot ≤ the query's, and
the sliding window in original slots. Masked scores take `layers.MASK_VALUE` rather than −∞,
as in the jnp path, so a fully masked (padding) query gets the same uniform average.

Against MaxText's all-gather strategy (`attention.py`): the same FLOPs (no block is skipped)
and the same bytes on the wire per layer ((c − 1)/c of a row's keys and values, here in c − 1
neighbour hops instead of one collective); the forward pass holds 2 key/value chunks at a
time, not all c. The backward pass runs the ring in reverse through `ppermute`'s transpose and
keeps each step's chunk and scores for the layer it differentiates (no per-step remat yet).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxrl_llm.models.layers import MASK_VALUE, softcap
from jaxrl_llm.parallel.mesh import BATCH_AXES, CONTEXT_AXIS, batch_shards, context_shards

Array = jax.Array


def _fold(carry, q, k, v, q_seg, kv_seg, q_slot, kv_slot, *, scale, logit_softcap, window):
    """One key/value chunk into the online softmax. q [b,t,hkv,g,d], k/v [b,s,hkv,d]."""
    logits = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    logits = softcap(logits * scale, logit_softcap)
    visible = ((q_seg[:, :, None] == kv_seg[:, None, :]) & (kv_seg[:, None, :] != 0)
               & (kv_slot[None, None, :] <= q_slot[None, :, None]))
    if window is not None:
        visible &= (q_slot[None, :, None] - kv_slot[None, None, :]) < window
    logits = jnp.where(visible[:, None, None], logits, MASK_VALUE)  # [b, hkv, g, t, s]
    block_max = logits.max(axis=-1)
    if carry is None:
        m = block_max
        p = jnp.exp(logits - m[..., None])
        return m, p.sum(-1), jnp.einsum("bkgts,bskd->bkgtd", p, v.astype(jnp.float32))
    m_old, l_old, a_old = carry
    m = jnp.maximum(m_old, block_max)
    keep = jnp.exp(m_old - m)  # rescales what was summed under the old max
    p = jnp.exp(logits - m[..., None])
    return (m, l_old * keep + p.sum(-1),
            a_old * keep[..., None] + jnp.einsum("bkgts,bskd->bkgtd", p, v.astype(jnp.float32)))


def ring_attention(q: Array, k: Array, v: Array, seg: Array, *, mesh: Mesh, order: np.ndarray,
                   scale: float, logit_softcap: float | None, window: int | None) -> Array:
    """q [B,T,Hq,D], k/v [B,T,Hkv,D], segment ids [B,T], all in the load-balanced order
    `order` (slot i holds original slot order[i]) and split along T over "context"."""
    c = context_shards(mesh)
    rows = BATCH_AXES if q.shape[0] % batch_shards(mesh) == 0 else None
    tensor = mesh.shape.get("tensor", 1)
    heads = "tensor" if tensor > 1 and k.shape[2] % tensor == 0 else None
    ring = [(i, (i + 1) % c) for i in range(c)]

    def local(q, k, v, seg, slots):
        b, t, hq, d = q.shape
        hkv = k.shape[2]
        qg = q.reshape(b, t, hkv, hq // hkv, d)
        carry, kv_seg, kv_slots = None, seg, slots
        for step in range(c):
            carry = _fold(carry, qg, k, v, seg, kv_seg, slots, kv_slots, scale=scale,
                          logit_softcap=logit_softcap, window=window)
            if step < c - 1:  # pass this chunk on, take the previous chip's
                k, v, kv_seg, kv_slots = (jax.lax.ppermute(x, CONTEXT_AXIS, ring)
                                          for x in (k, v, kv_seg, kv_slots))
        _, norm, acc = carry
        out = (acc / norm[..., None]).astype(v.dtype)  # [b, hkv, g, t, d]
        return out.transpose(0, 3, 1, 2, 4).reshape(b, t, hq, d)

    spec = P(rows, CONTEXT_AXIS, heads, None)
    return jax.shard_map(local, mesh=mesh,
                         in_specs=(spec, spec, spec, P(rows, CONTEXT_AXIS), P(CONTEXT_AXIS)),
                         out_specs=spec, check_vma=False)(
        q, k, v, seg, jnp.asarray(order, jnp.int32))
