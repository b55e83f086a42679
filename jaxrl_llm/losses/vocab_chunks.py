"""The vocabulary-chunked kernels behind `losses.logprobs`: log-probs, entropy and exact forward
KL of logits `z = Σ_i c_i · cap(H_i W_i)` without ever holding the `[N, V]` logits.

docs/kernels.md § Token log-probs. The vocabulary is scanned in chunks with an online
logsumexp (`_scan_vocab`); each `jax.custom_vjp` saves only the inputs and `[N]` statistics and
recomputes a logit chunk in the backward pass. The public, shape-checked entry points are in
`losses/logprobs.py`; this module holds the numerics only.

FSDP (`RowSharding`): on a mesh the unembedding stays split along d over "fsdp" and each
vocabulary chunk's rows are all-gathered inside the loop (the backward reduce-scatters each
chunk's weight gradient in float32), exactly as a scanned layer's weights are gathered per
layer. Gathering the whole table once instead holds a `[V, d]` bf16 copy per device (0.78 GB
for Qwen3's 151,936 × 2,560) and its unreduced gradient of the same size; the arithmetic is
the same either way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# Inside the kernel the unembedding is held as rows, `table [V, d_i]` (the public functions
# take `W [d_i, V]` and pass `W.T`): a vocabulary chunk is then a contiguous row block, its
# weight gradient `dzᵀ·H` comes out in the same layout, and for tied embeddings `W.T` is the
# embedding table itself (the two transposes cancel), so XLA copies no [V, d] matrix.
Term = tuple[jax.Array, jax.Array]  # (hidden [N, d_i], unembedding rows [V, d_i])


@dataclasses.dataclass(frozen=True)
class RowSharding:
    """The tables' rows [V, d] are split along d over the mesh axis `axis` (FSDP; a tuple of
    axes when the state is also split over "context"); hashable, so a static kernel argument."""

    mesh: Mesh
    axis: str | tuple[str, ...] = "fsdp"

    @property
    def stored(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(None, self.axis))


def _rows(table: jax.Array, start, size: int, sharding: RowSharding | None) -> jax.Array:
    """Rows [start, start+size) of `table`, all-gathered over d when sharded.

    The gather is explicit (a `shard_map` over the FSDP axis that slices the local shard and
    all-gathers the slice): left to GSPMD, a sharding constraint on the slice is partitioned
    as slice(all-gather(table)), and XLA then hoists that whole-table gather out of the loop.
    """
    if sharding is None:
        return jax.lax.dynamic_slice_in_dim(table, start, size, axis=0)

    def local(shard: jax.Array, at: jax.Array) -> jax.Array:
        piece = jax.lax.dynamic_slice_in_dim(shard, at, size, axis=0)
        return jax.lax.all_gather(piece, sharding.axis, axis=1, tiled=True)

    gather = jax.shard_map(local, mesh=sharding.mesh, in_specs=(P(None, sharding.axis), P()),
                           out_specs=P(), check_vma=False,
                           axis_names=set((sharding.axis,) if isinstance(sharding.axis, str)
                                          else sharding.axis))
    return gather(table, jnp.asarray(start, jnp.int32))


# ----------------------------------------------------------------------------- the kernel


def _cap(x: jax.Array, softcap: float | None) -> jax.Array:
    return x if softcap is None else softcap * jnp.tanh(x / softcap)


def _chunk_logits(
    terms: Sequence[Term], coefs: jax.Array, start: jax.Array | int, size: int,
    softcap: float | None, sharding: RowSharding | None = None,
) -> tuple[jax.Array, list[jax.Array], list[jax.Array]]:
    """Logits of vocabulary columns [start, start+size): `z [N,size]`, and per term the raw
    `x_i = H_i W_i[:, cols]` (float32) and its capped value (both kept for the backward)."""
    raws, capped = [], []
    z = None
    for i, (h, table) in enumerate(terms):
        x = _times_rows_t(h, _rows(table, start, size, sharding))
        cx = _cap(x, softcap)
        raws.append(x)
        capped.append(cx)
        z = coefs[i] * cx if z is None else z + coefs[i] * cx
    return z, raws, capped


def _times_rows_t(a: jax.Array, rows: jax.Array) -> jax.Array:
    """a [N, d] · rows [size, d]ᵀ -> [N, size] in float32."""
    return jax.lax.dot_general(a, rows, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)


def _rows_grad(dcap: jax.Array, h: jax.Array) -> jax.Array:
    """Gradient of a row block of the table: dcap [N, size]ᵀ · h [N, d] -> [size, d] float32."""
    return jax.lax.dot_general(dcap, h, (((0,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32)


def _constrain(x: jax.Array, sharding: RowSharding | None) -> jax.Array:
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding.stored)


def _chunk_grad(dcap: jax.Array, h: jax.Array, dtype, sharding: RowSharding | None):
    """A chunk's weight gradient in the table's dtype; sharded, the sum over the batch shards
    is reduce-scattered in float32 before the cast."""
    return _constrain(_rows_grad(dcap, h), sharding).astype(dtype)


def _zeros_table(table: jax.Array, sharding: RowSharding | None) -> jax.Array:
    return _constrain(jnp.zeros_like(table), sharding)


def _target_logit_in_chunk(z: jax.Array, targets: jax.Array, start, size: int) -> jax.Array:
    """`z[n, targets[n] − start]` where the target falls in this chunk, else 0."""
    local = targets - start
    inside = (local >= 0) & (local < size)
    picked = jnp.take_along_axis(z, jnp.clip(local, 0, size - 1)[:, None], axis=1)[:, 0]
    return jnp.where(inside, picked, 0.0)


def _chunk_starts(vocab: int, chunk_size: int) -> tuple[int, int]:
    """(number of full chunks, width of the remainder chunk); the remainder is processed as
    its own statically-shaped chunk, so V need not be a multiple of chunk_size."""
    return vocab // chunk_size, vocab % chunk_size


def _scan_vocab(update, carry, vocab: int, chunk_size: int):
    """Fold `update(carry, start, size)` over the vocabulary: a `lax.scan` over the full
    chunks, then the remainder chunk (if any) with its own static width."""
    n_full, rem = _chunk_starts(vocab, chunk_size)
    if n_full:
        carry, _ = jax.lax.scan(
            lambda c, i: (update(c, i * chunk_size, chunk_size), None),
            carry, jnp.arange(n_full),
        )
    if rem:
        carry = update(carry, n_full * chunk_size, rem)
    return carry


def _forward_stats(terms, coefs, targets, chunk_size, softcap, sharding=None):
    """One pass over the vocabulary: target logit, logsumexp and Σ_v softmax·z (entropy)."""
    n = targets.shape[0]
    vocab = terms[0][1].shape[0]

    def update(carry, start, size):
        m, s, a, tgt = carry
        z, _, _ = _chunk_logits(terms, coefs, start, size, softcap, sharding)
        m_new = jnp.maximum(m, jnp.max(z, axis=1))
        rescale = jnp.exp(m - m_new)  # online logsumexp: shift the running sums to the new max
        e = jnp.exp(z - m_new[:, None])
        s = s * rescale + jnp.sum(e, axis=1)
        a = a * rescale + jnp.sum(e * z, axis=1)
        tgt = tgt + _target_logit_in_chunk(z, targets, start, size)
        return m_new, s, a, tgt

    zeros = jnp.zeros((n,), jnp.float32)
    carry = (jnp.full((n,), -jnp.inf, jnp.float32), zeros, zeros, zeros)
    m, s, a, tgt = _scan_vocab(update, carry, vocab, chunk_size)
    lse = m + jnp.log(s)
    # fp32 rounding of lse − z grows with |z| (≈1e-7·|z|): clamp so that log p ≤ 0 and
    # entropy ≥ 0 always hold (records refuse positive log-probs).
    entropy = jnp.maximum(lse - a / s, 0.0)  # −Σ p log p = lse − Σ p z
    in_vocab = (targets >= 0) & (targets < vocab)
    # Out-of-range targets give NaN (as a gather out of bounds would), never a wrong number.
    logp = jnp.where(in_vocab, jnp.minimum(tgt - lse, 0.0), jnp.nan)
    return logp, entropy, lse


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _chunked_logprobs(terms, coefs, targets, chunk_size, softcap, sharding=None):
    logp, entropy, _ = _forward_stats(terms, coefs, targets, chunk_size, softcap, sharding)
    return logp, entropy


def _chunked_logprobs_fwd(terms, coefs, targets, chunk_size, softcap, sharding=None):
    logp, entropy, lse = _forward_stats(terms, coefs, targets, chunk_size, softcap, sharding)
    # Residuals are the inputs and two [N] vectors: no logits are saved.
    return (logp, entropy), (terms, coefs, targets, lse, entropy)


def _chunked_logprobs_bwd(chunk_size, softcap, sharding, residuals, cotangents):
    """Recompute each logit chunk and push the cotangents through it.

    With p = softmax(z): ∂logπ/∂z_v = 1[v=y] − p_v and ∂H/∂z_v = −p_v (log p_v + H), so
    dz = g_logp·(onehot − p) − g_ent·p·(z − lse + entropy); then through cap and the
    coefficients to each H_i, W_i and c_i.
    """
    terms, coefs, targets, lse, entropy = residuals
    g_logp, g_ent = cotangents
    vocab = terms[0][1].shape[0]
    g_logp = g_logp.astype(jnp.float32)
    g_ent = g_ent.astype(jnp.float32)

    def update(carry, start, size):
        dhs, dws, dcoefs = carry
        z, raws, capped = _chunk_logits(terms, coefs, start, size, softcap, sharding)
        log_p = z - lse[:, None]
        p = jnp.exp(log_p)
        onehot = (start + jnp.arange(size))[None, :] == targets[:, None]
        dz = g_logp[:, None] * (onehot - p) - g_ent[:, None] * p * (log_p + entropy[:, None])
        new_dhs, new_dws, new_dcoefs = [], [], []
        for i, (h, table) in enumerate(terms):
            dcap = dz * coefs[i]
            if softcap is not None:
                dcap = dcap * (1.0 - jnp.square(jnp.tanh(raws[i] / softcap)))
            rows = _rows(table, start, size, sharding)
            dcap_in = dcap.astype(h.dtype)
            new_dhs.append(
                dhs[i] + jnp.matmul(dcap_in, rows, preferred_element_type=jnp.float32)
            )
            new_dws.append(jax.lax.dynamic_update_slice_in_dim(
                dws[i], _chunk_grad(dcap_in, h, table.dtype, sharding), start, 0))
            new_dcoefs.append(dcoefs[i] + jnp.sum(dz * capped[i]))
        return new_dhs, new_dws, jnp.stack(new_dcoefs)

    carry = (
        [jnp.zeros(h.shape, jnp.float32) for h, _ in terms],
        [_zeros_table(w, sharding) for _, w in terms],
        jnp.zeros(coefs.shape, jnp.float32),
    )
    dhs, dws, dcoefs = _scan_vocab(update, carry, vocab, chunk_size)
    d_terms = tuple((dh.astype(h.dtype), dw) for dh, dw, (h, _) in zip(dhs, dws, terms))
    return d_terms, dcoefs.astype(coefs.dtype), None


_chunked_logprobs.defvjp(_chunked_logprobs_fwd, _chunked_logprobs_bwd)
# Jitted so that eager callers (a scoring loop, a notebook) compile the kernel once per shape
# instead of dispatching its ops one by one; inside an outer jit this is inlined.
chunked_logprobs_jit = jax.jit(_chunked_logprobs, static_argnums=(3, 4, 5))


# ------------------------------------------------------- exact forward KL (the same machinery)


def _forward_kl_stats(policy, ref, coefs, chunk_size, softcap, sharding=None):
    """One pass over the vocabulary for both models: per row the policy's and the reference's
    logsumexp and `KL = Σ_v q_v (r_v − z_v) − lse_r + lse_z` (q = softmax(r), the reference).

    `Σ_v q_v (r_v − z_v)` is accumulated online like the entropy sum: a running
    `Σ exp(r − m_r)(r − z)` rescaled whenever the reference's running max `m_r` grows.
    """
    n = policy[0].shape[0]
    vocab = policy[1].shape[0]

    def update(carry, start, size):
        m_z, s_z, m_r, s_r, a = carry
        z, _, _ = _chunk_logits((policy,), coefs[:1], start, size, softcap, sharding)
        r, _, _ = _chunk_logits((ref,), coefs[1:], start, size, softcap, sharding)
        m_z_new = jnp.maximum(m_z, jnp.max(z, axis=1))
        s_z = s_z * jnp.exp(m_z - m_z_new) + jnp.sum(jnp.exp(z - m_z_new[:, None]), axis=1)
        m_r_new = jnp.maximum(m_r, jnp.max(r, axis=1))
        rescale = jnp.exp(m_r - m_r_new)
        e_r = jnp.exp(r - m_r_new[:, None])
        s_r = s_r * rescale + jnp.sum(e_r, axis=1)
        a = a * rescale + jnp.sum(e_r * (r - z), axis=1)
        return m_z_new, s_z, m_r_new, s_r, a

    zeros = jnp.zeros((n,), jnp.float32)
    neg_inf = jnp.full((n,), -jnp.inf, jnp.float32)
    m_z, s_z, m_r, s_r, a = _scan_vocab(
        update, (neg_inf, zeros, neg_inf, zeros, zeros), vocab, chunk_size
    )
    lse_z = m_z + jnp.log(s_z)
    lse_r = m_r + jnp.log(s_r)
    return jnp.maximum(a / s_r - lse_r + lse_z, 0.0), lse_z, lse_r  # KL ≥ 0 despite rounding


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _chunked_forward_kl(policy, ref, coefs, chunk_size, softcap, sharding=None):
    return _forward_kl_stats(policy, ref, coefs, chunk_size, softcap, sharding)[0]


def _chunked_forward_kl_fwd(policy, ref, coefs, chunk_size, softcap, sharding=None):
    kl, lse_z, lse_r = _forward_kl_stats(policy, ref, coefs, chunk_size, softcap, sharding)
    return kl, (policy, ref, coefs, lse_z, lse_r)  # no logits saved


def _chunked_forward_kl_bwd(chunk_size, softcap, sharding, residuals, g_kl):
    """∂KL/∂z_v = p_v − q_v (policy minus reference softmax), recomputed chunk by chunk and
    pushed through cap and 1/τ to the policy's H and W. The reference and the coefficients
    are constants of this function (the public caller wraps them in `stop_gradient`)."""
    policy, ref, coefs, lse_z, lse_r = residuals
    h, table = policy
    vocab = table.shape[0]
    g_kl = g_kl.astype(jnp.float32)

    def update(carry, start, size):
        dh, dw = carry
        z, raws, _ = _chunk_logits((policy,), coefs[:1], start, size, softcap, sharding)
        r, _, _ = _chunk_logits((ref,), coefs[1:], start, size, softcap, sharding)
        dz = g_kl[:, None] * (jnp.exp(z - lse_z[:, None]) - jnp.exp(r - lse_r[:, None]))
        dcap = dz * coefs[0]
        if softcap is not None:
            dcap = dcap * (1.0 - jnp.square(jnp.tanh(raws[0] / softcap)))
        dcap_in = dcap.astype(h.dtype)
        rows = _rows(table, start, size, sharding)
        dh = dh + jnp.matmul(dcap_in, rows, preferred_element_type=jnp.float32)
        dw = jax.lax.dynamic_update_slice_in_dim(
            dw, _chunk_grad(dcap_in, h, table.dtype, sharding), start, 0)
        return dh, dw

    dh, dw = _scan_vocab(
        update, (jnp.zeros(h.shape, jnp.float32), _zeros_table(table, sharding)), vocab,
        chunk_size,
    )
    d_ref = jax.tree.map(jnp.zeros_like, ref)
    return (dh.astype(h.dtype), dw), d_ref, jnp.zeros_like(coefs)


_chunked_forward_kl.defvjp(_chunked_forward_kl_fwd, _chunked_forward_kl_bwd)
chunked_forward_kl_jit = jax.jit(_chunked_forward_kl, static_argnums=(3, 4, 5))
