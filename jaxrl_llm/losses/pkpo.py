"""Pass@k / max@k estimators and PKPO reward transforms (docs/kernels.md § PKPO estimators; PKPO arXiv:2505.15201).

Every function takes a group-major reward matrix `rewards [G, n]` (one row per prompt, one
column per sample) and an optional `mask [G, n]` for ragged groups: masked entries do not
count in the group size `n_g = Σ_j mask[g, j]` and receive 0. Results are in sample order.

Cost per group is one sort plus prefix/suffix sums, O(n log n) (PKPO Thm. 5–7). The binomial
ratios never form a binomial coefficient: with sorted 0-based index `i` among the `n_g` valid
samples,

    w_i = C(i, k−1) / C(n_g, k) = (k/n_g) · Π_{m=i+1}^{n_g−1} (1 − (k−1)/m)

(anchored at the top, `w_{n_g−1} = k/n_g` exactly; every factor is in [0, 1], so the
reverse cumulative product cannot overflow and the large weights carry the fewest roundings),
and the off-diagonal weight of PKPO eq. 21 is `C(j−1, k−2)/C(n_g, k) = w_j (k−1)/j`.

`k` may be a Python/NumPy integer or a (traced) JAX scalar, e.g. an annealing schedule
(PKPO §5.2.2 anneals k from 8 to 1): `k` is a dynamic argument of the jitted kernels, so a
schedule never recompiles. A concrete `k` outside its range is a `ValueError`, and so is a
concrete `mask` that leaves a non-empty group too small for `k`. Under an outer `jit` such
inputs cannot be inspected: an out-of-range `k` makes every output 0, and a group too small
for `k` (or with no valid sample) gets all-zero outputs — no training signal, never NaN.

Baseline of `sloo` (docs/kernels.md § PKPO estimators **(choice)**): the subset-average scaling
`s_i − (k/n) ρ(g_{−i}, k)` of PKPO eq. 29, not the `k/(n−1)` of the paper's listing; both are
unbiased because the baseline of sample i does not depend on sample i.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import scipy.special

__all__ = [
    "binary_transform",
    "pass_at_k",
    "rho",
    "s",
    "sloo",
    "sloo_minus_one",
]

Array = jax.Array


# ---------------------------------------------------------------- input checks (host side)


def _is_concrete(x: object) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _float_dtype(rewards) -> np.dtype:
    """float64 stays float64 when x64 is enabled; everything else is computed in float32."""
    dtype = rewards.dtype if hasattr(rewards, "dtype") else np.asarray(rewards).dtype
    if np.dtype(dtype) == np.float64:
        return np.dtype(jax.dtypes.canonicalize_dtype(np.float64))
    return np.dtype(np.float32)


def _check_inputs(
    fn: str, rewards, k, mask, *, min_n: int, k_min_extra: int = 0
) -> tuple[Array, Array, Array | None]:
    """Shape/range checks naming the argument, with as little device work as possible.

    Returns (rewards, k as a scalar of the compute dtype, mask or None); the kernels cast.
    A group of size n_g supports k when `1 ≤ k ≤ n_g − k_min_extra` and `n_g ≥ min_n`.
    """
    if not hasattr(rewards, "shape"):
        rewards = np.asarray(rewards)
    if len(rewards.shape) != 2:
        raise ValueError(f"{fn}: rewards must have shape [G, n], got {tuple(rewards.shape)}")
    dtype = _float_dtype(rewards)
    n = rewards.shape[1]
    if mask is not None:
        if not hasattr(mask, "shape"):
            mask = np.asarray(mask)
        if tuple(mask.shape) != tuple(rewards.shape):
            raise ValueError(
                f"{fn}: mask must have the shape of rewards {tuple(rewards.shape)}, "
                f"got {tuple(mask.shape)}"
            )
    if jnp.ndim(k) != 0:
        raise ValueError(f"{fn}: k must be a scalar, got shape {jnp.shape(k)}")
    if not _is_concrete(k):
        return rewards, jnp.asarray(k, dtype), mask
    k_val = float(np.asarray(k))
    if k_val != int(k_val):
        raise ValueError(f"{fn}: k must be an integer, got {k_val}")
    k_int = int(k_val)
    if k_int < 1 or k_int > n - k_min_extra or n < min_n:
        raise ValueError(
            f"{fn}: k={k_int} is out of range for groups of n={n} samples "
            f"(need 1 ≤ k ≤ {n - k_min_extra}"
            + (f" and n ≥ {min_n}" if min_n > 1 else "")
            + ")"
        )
    if mask is not None and _is_concrete(mask):
        sizes = np.asarray(mask).astype(bool).sum(axis=1)
        bad = (sizes > 0) & (sizes < max(min_n, k_int + k_min_extra))
        if bad.any():
            g = int(np.argmax(bad))
            raise ValueError(
                f"{fn}: mask leaves group {g} with {int(sizes[g])} valid sample(s), too few "
                f"for k={k_int} ({int(bad.sum())} such group(s)); drop or pad those groups"
            )
    return rewards, np.asarray(k_int, dtype), mask


def _prepare(rewards: Array, k: Array, mask: Array | None) -> tuple[Array, Array]:
    """Inside the kernels: rewards in k's dtype (the compute dtype), a bool mask."""
    rewards = jnp.asarray(rewards).astype(k.dtype)
    mask = jnp.ones(rewards.shape, bool) if mask is None else jnp.asarray(mask).astype(bool)
    return rewards, mask


# ---------------------------------------------------------------- sorted-order kernels


def _exclusive_scans(suffix_terms: list[Array], prefix_terms: list[Array]):
    """Σ_{q>p} x[..., q] of each suffix term and Σ_{q<p} x[..., q] of each prefix term.

    All terms share one cumulative sum (a scan is the expensive op to compile on CPU).
    """
    stacked = jnp.stack([jnp.flip(x, -1) for x in suffix_terms] + list(prefix_terms))
    exclusive = jnp.cumsum(stacked, axis=-1) - stacked
    n_suffix = len(suffix_terms)
    suffix = [jnp.flip(exclusive[i], -1) for i in range(n_suffix)]
    return suffix, [exclusive[n_suffix + i] for i in range(len(prefix_terms))]


def _max_weights(idx: Array, n_eff: Array, k: Array) -> Array:
    """`C(i, k−1) / C(n_eff, k)` at sorted index `i = idx` (0 outside 0 ≤ i < n_eff).

    `idx [G, n]` must increase by one along the last axis (it is position − offset), so the
    product over m > i is a reverse cumulative product along that axis.
    """
    dtype = k.dtype
    m = idx.astype(dtype)
    inside = (idx >= 1) & (idx <= n_eff - 1)
    # every factor is in [0, 1]; m = k−1 gives the exact zero of C(i, k−1) for i < k−1
    factor = jnp.where(inside, jnp.clip(1.0 - (k - 1.0) / jnp.maximum(m, 1.0), 0.0, 1.0), 1.0)
    inclusive = jnp.flip(jnp.cumprod(jnp.flip(factor, -1), axis=-1), -1)
    exclusive = jnp.concatenate([inclusive[..., 1:], jnp.ones_like(inclusive[..., :1])], -1)
    top = k / jnp.maximum(n_eff, 1).astype(dtype)
    return jnp.where((idx >= 0) & (idx < n_eff), top * exclusive, 0.0)


def _sortable_int(x: Array) -> Array:
    """Monotone map float → signed int of the same width (an involution on the bits).

    XLA's CPU sort is several times faster on one integer operand than on floats or on a
    (key, index) pair; positive floats keep their bits, negative ones flip all but the sign.
    """
    bits = jnp.finfo(x.dtype).bits
    int_dtype = {32: jnp.int32, 64: jnp.int64}[bits]
    i = jax.lax.bitcast_convert_type(x, int_dtype)
    return i ^ ((i >> (bits - 1)) & jnp.iinfo(int_dtype).max)


def _from_sortable_int(key: Array, dtype) -> Array:
    bits = jnp.finfo(dtype).bits
    return jax.lax.bitcast_convert_type(key ^ ((key >> (bits - 1)) & jnp.iinfo(key.dtype).max), dtype)


def _sorted(rewards: Array, mask: Array) -> tuple[Array, Array, Array, Array]:
    """Sort each group ascending with masked entries first.

    Returns (g_sorted with masked → 0, rank = sorted position of each original entry,
    idx = index among valid samples (negative for masked), n_g [G, 1]). Tied rewards share a
    rank (the first position of their block). That is exact: swapping two equal samples maps
    the k-subsets containing one onto those containing the other with the same maxima, so
    every transform gives tied samples equal values.
    """
    n = rewards.shape[1]
    rewards = jax.lax.stop_gradient(rewards)  # rewards are data: the transforms are not differentiated
    key = _sortable_int(rewards)
    key = jnp.where(mask, key, jnp.iinfo(key.dtype).min)
    sorted_key = jnp.sort(key, axis=-1)
    rank = jax.vmap(jnp.searchsorted)(sorted_key, key)  # O(n log n) binary searches
    n_g = mask.sum(axis=-1, keepdims=True).astype(jnp.int32)
    idx = jnp.arange(n, dtype=jnp.int32)[None, :] - (n - n_g)
    g = jnp.where(idx >= 0, _from_sortable_int(sorted_key, rewards.dtype), 0.0)
    return g, rank, idx, n_g


def _unsort(values_sorted: Array, rank: Array, mask: Array) -> Array:
    return jnp.where(mask, jnp.take_along_axis(values_sorted, rank, axis=-1), 0.0)


def _off_diagonal(w: Array, idx: Array, k: Array) -> Array:
    """C(j−1, k−2)/C(n, k) = w_j (k−1)/j   (PKPO eq. 21; 0 for j = 0, never used there)."""
    return jnp.where(idx >= 1, w * (k - 1.0) / jnp.maximum(idx, 1).astype(k.dtype), 0.0)


def _s_sorted(g: Array, idx: Array, n_g: Array, k: Array) -> Array:
    """s_(i) = w_i g_(i) + Σ_{j>i} C(j−1, k−2)/C(n,k) g_(j)   (PKPO eq. 19–21)."""
    w = _max_weights(idx, n_g, k)
    (suffix,), _ = _exclusive_scans([_off_diagonal(w, idx, k) * g], [])
    return w * g + suffix


def _s_and_rho_loo_sorted(
    g: Array, idx: Array, n_g: Array, k: Array, k_loo: Array
) -> tuple[Array, Array]:
    """s_(i) and ρ(g_{−i}, k_loo) for every sorted i in O(n) (PKPO Thm. 6–7, eq. 30–34).

    Removing sample i keeps the sorted indices of j < i and shifts j > i down by one, so
    ρ(g_{−i}) = Σ_{j<i} u_j g_(j) + Σ_{j>i} u_{j−1} g_(j), u_t = C(t, k_loo−1)/C(n_g−1, k_loo).
    """
    # both weight vectors from one reverse cumulative product
    w, u = _max_weights(idx, jnp.stack([n_g, n_g - 1]), jnp.stack([k, k_loo])[:, None, None])
    u_prev = jnp.concatenate([jnp.zeros_like(u[..., :1]), u[..., :-1]], -1)
    (off_suffix, u_suffix), (u_prefix,) = _exclusive_scans(
        [_off_diagonal(w, idx, k) * g, u_prev * g], [u * g]
    )
    return w * g + off_suffix, u_prefix + u_suffix


def _k_ok(k: Array) -> Array:
    return (k >= 1) & (k == jnp.round(k))


@jax.jit
def _rho_kernel(rewards: Array, k: Array, mask: Array | None) -> Array:
    rewards, mask = _prepare(rewards, k, mask)
    g, _, idx, n_g = _sorted(rewards, mask)
    valid = _k_ok(k) & (k <= n_g[:, 0])
    return jnp.where(valid, jnp.sum(_max_weights(idx, n_g, k) * g, axis=-1), 0.0)


@jax.jit
def _s_kernel(rewards: Array, k: Array, mask: Array | None) -> Array:
    rewards, mask = _prepare(rewards, k, mask)
    g, rank, idx, n_g = _sorted(rewards, mask)
    valid = _k_ok(k) & (k <= n_g)
    return _unsort(jnp.where(valid, _s_sorted(g, idx, n_g, k), 0.0), rank, mask)


@jax.jit
def _sloo_kernel(rewards: Array, k: Array, mask: Array | None) -> Array:
    rewards, mask = _prepare(rewards, k, mask)
    g, rank, idx, n_g = _sorted(rewards, mask)
    valid = _k_ok(k) & (k <= n_g - 1)
    s_i, rho_loo = _s_and_rho_loo_sorted(g, idx, n_g, k, k)
    out = s_i - k / jnp.maximum(n_g, 1) * rho_loo
    return _unsort(jnp.where(valid, out, 0.0), rank, mask)


@jax.jit
def _sloo_minus_one_kernel(rewards: Array, k: Array, mask: Array | None) -> Array:
    rewards, mask = _prepare(rewards, k, mask)
    g, rank, idx, n_g = _sorted(rewards, mask)
    n_f = jnp.maximum(n_g, 1).astype(g.dtype)
    # k ≥ 2: s_i − (k/n) ρ(g_{−i}, k−1)   (PKPO eq. 33–34)
    k_loo = jnp.maximum(k - 1.0, 1.0)
    s_i, rho_loo = _s_and_rho_loo_sorted(g, idx, n_g, k, k_loo)
    general = s_i - k / n_f * rho_loo
    # k = 1: plain leave-one-out centring (g_i − mean_{j≠i} g_j)/n   (PKPO eq. 26)
    loo_mean = (jnp.sum(g, -1, keepdims=True) - g) / jnp.maximum(n_g - 1, 1).astype(g.dtype)
    centred = (g - loo_mean) / n_f
    out = jnp.where(k == 1, centred, general)
    valid = _k_ok(k) & (k <= n_g) & (n_g >= 2)
    return _unsort(jnp.where(valid, out, 0.0), rank, mask)


# ---------------------------------------------------------------- public API


def rho(rewards: Array, k, mask: Array | None = None) -> Array:
    """Unbiased max@k estimate per group, `ρ(g, k) = (1/C(n,k)) Σ_{|S|=k} max_{j∈S} g_j`.

    docs/kernels.md § PKPO estimators; PKPO eq. 12–14 (sorted form `Σ_i C(i, k−1) g_(i) / C(n, k)`). With 0/1 rewards
    this is pass@k (PKPO eq. 3). `rewards [G, n]`, `mask [G, n]` → `[G]`.
    """
    rewards, k_arr, mask_arr = _check_inputs("rho", rewards, k, mask, min_n=1)
    return _rho_kernel(rewards, k_arr, mask_arr)


def s(rewards: Array, k, mask: Array | None = None) -> Array:
    """Gradient weights `s_i = (1/C(n,k)) Σ_{|S|=k, S∋i} max_{j∈S} g_j` (docs/kernels.md § PKPO estimators; PKPO eq. 19).

    `Σ_i s_i ∇log π(x_i)` is an unbiased estimate of ∇ max@k (PKPO Thm. 4). `[G, n]` → `[G, n]`.
    """
    rewards, k_arr, mask_arr = _check_inputs("s", rewards, k, mask, min_n=1)
    return _s_kernel(rewards, k_arr, mask_arr)


def sloo(rewards: Array, k, mask: Array | None = None) -> Array:
    """`s_i − (k/n) ρ(g_{−i}, k)`: leave-one-out baseline with the same k (docs/kernels.md § PKPO estimators; PKPO eq. 29).

    Needs `k ≤ n − 1` (ρ of the n−1 other samples at k). Subset-average scaling k/n (the
    docs/kernels.md § PKPO estimators choice; the paper's listing uses k/(n−1)). `[G, n]` → `[G, n]`.
    """
    rewards, k_arr, mask_arr = _check_inputs("sloo", rewards, k, mask, min_n=2, k_min_extra=1)
    return _sloo_kernel(rewards, k_arr, mask_arr)


def sloo_minus_one(rewards: Array, k, mask: Array | None = None) -> Array:
    """PKPO's recommended transform: `s_i − (k/n) ρ(g_{−i}, k−1)` for k ≥ 2 (docs/kernels.md § PKPO estimators; PKPO eq. 33).

    For k = 1 it is leave-one-out centring `(g_i − mean_{j≠i} g_j)/n` (PKPO eq. 26, the
    paper's k = 1 baseline). Needs n ≥ 2. `[G, n]` → `[G, n]`.
    """
    rewards, k_arr, mask_arr = _check_inputs("sloo_minus_one", rewards, k, mask, min_n=2)
    return _sloo_minus_one_kernel(rewards, k_arr, mask_arr)


def _comb_ratio_host(a, b, k) -> np.ndarray:
    """C(a, k)/C(b, k) for 0 ≤ k ≤ a ≤ b in float64 through log-beta (no overflow).

    1/C(m, k) = (m+1) B(k+1, m−k+1); SciPy's betaln stays accurate for large arguments,
    where a difference of lgammas of size ~ n log n would lose digits.
    """
    betaln = scipy.special.betaln
    return np.exp(np.log1p(b) - np.log1p(a) + betaln(k + 1.0, b - k + 1.0) - betaln(k + 1.0, a - k + 1.0))


@jax.jit
def _comb_ratio_device(a: Array, b: Array, k: Array) -> Array:
    """C(a, k)/C(b, k) = Π_{t<k} (a−t)/(b−t) for 0 ≤ k ≤ a ≤ b, jit-able with traced k.

    Every factor is in [0, 1] (no overflow); relative error ≲ k·eps. The loop runs max(k)
    times over the whole broadcast array.
    """
    a, b, k = jnp.broadcast_arrays(a, b, k)

    def body(t, acc):
        t = jnp.asarray(t, acc.dtype)
        factor = jnp.clip((a - t) / jnp.maximum(b - t, 1.0), 0.0, 1.0)
        return acc * jnp.where(t < k, factor, 1.0)

    return jax.lax.fori_loop(0, jnp.max(k).astype(jnp.int32), body, jnp.ones_like(a))


def pass_at_k(n, c, k):
    """Unbiased pass@k from `c` correct out of `n` samples: `1 − C(n−c, k)/C(n, k)`.

    docs/kernels.md § PKPO estimators; PKPO eq. 3. Broadcasts over arrays. NumPy/Python integers are computed in
    float64 on the host with log-beta (returns NumPy); if any argument is a JAX array the
    result stays in JAX (jit-able, default float dtype) and uses the exact product
    Π_{t<k}(n−c−t)/(n−t), a loop of max(k) steps. Concrete inputs with `k > n`, `k < 1`,
    `c < 0`, `c > n` or non-integers raise `ValueError`; traced `k > n` gives 1.
    """
    use_jax = any(isinstance(v, jax.Array) for v in (n, c, k))
    if all(_is_concrete(v) for v in (n, c, k)):
        n_np, c_np, k_np = (np.asarray(v) for v in (n, c, k))
        for name, v in (("n", n_np), ("c", c_np), ("k", k_np)):
            if not np.all(v == np.round(v)):
                raise ValueError(f"pass_at_k: {name} must hold integers, got {v}")
        if np.any(k_np < 1) or np.any(k_np > n_np):
            raise ValueError(f"pass_at_k: need 1 ≤ k ≤ n, got n={n_np}, k={k_np}")
        if np.any(c_np < 0) or np.any(c_np > n_np):
            raise ValueError(f"pass_at_k: need 0 ≤ c ≤ n, got n={n_np}, c={c_np}")
    if use_jax:
        dtype = jnp.result_type(float)
        n_f, c_f, k_f = (jnp.asarray(v).astype(dtype) for v in (n, c, k))
        fail_possible = n_f - c_f >= k_f  # otherwise every k-subset holds a correct sample
        return jnp.where(fail_possible, 1.0 - _comb_ratio_device(n_f - c_f, n_f, k_f), 1.0)
    n_f, c_f, k_f = (np.asarray(v, np.float64) for v in (n, c, k))
    fail_possible = n_f - c_f >= k_f
    a = np.where(fail_possible, n_f - c_f, n_f)  # keeps betaln's arguments valid
    return np.where(fail_possible, 1.0 - _comb_ratio_host(a, n_f, k_f), 1.0)


@jax.jit
def _binary_kernel(correct: Array, k: Array, mask: Array | None) -> Array:
    _, mask = _prepare(correct, k, mask)
    dtype = k.dtype
    n_g = mask.sum(-1, keepdims=True).astype(dtype)
    c = (correct & mask).sum(-1, keepdims=True).astype(dtype)
    # C(n−1−c, k−1)/C(n−1, k−1) = Π_{t<k−1} (n−1−c−t)/(n−1−t): the chance that k−1 other
    # draws all miss the c correct samples; ≤ n−1 factors in [0, 1], one per column
    t = jnp.arange(correct.shape[1], dtype=dtype)[None, :]
    used = t < k - 1.0
    factor = jnp.where(
        used, jnp.clip((n_g - 1.0 - c - t) / jnp.maximum(n_g - 1.0 - t, 1.0), 0.0, 1.0), 1.0
    )
    miss = jnp.prod(factor, axis=-1, keepdims=True)
    top = k / jnp.maximum(n_g, 1.0)
    out = jnp.where(correct, top, top * (1.0 - miss))
    valid = _k_ok(k) & (k <= n_g)
    return jnp.where(valid & mask, out, 0.0)


def binary_transform(correct: Array, k, mask: Array | None = None) -> Array:
    """Closed form of `s` for 0/1 rewards (docs/kernels.md § PKPO estimators; PKPO §3.2).

    Correct samples get `k/n`; incorrect ones `(k/n)(1 − C(n−1−c, k−1)/C(n−1, k−1))`, with c
    the number of correct samples in the group. `correct [G, n]` bool → `[G, n]` float.
    """
    if not hasattr(correct, "dtype"):
        correct = np.asarray(correct)
    if correct.dtype != np.bool_:
        raise ValueError(f"binary_transform: correct must be bool, got dtype {correct.dtype}")
    _, k_arr, mask_arr = _check_inputs("binary_transform", correct, k, mask, min_n=1)
    return _binary_kernel(correct, k_arr, mask_arr)
