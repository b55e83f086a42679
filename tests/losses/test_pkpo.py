"""PKPO estimators (SPEC §5, paper 003) against brute-force enumeration of k-subsets.

The oracle below is a direct transcription of the SPEC definitions (itertools over all
subsets, Python floats); the kernels use sorted prefix/suffix sums, so agreement is a real
check. Each kernel compiles once per (n, dtype): `k` is a dynamic argument and the cases of
one n are stacked along the group axis.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special

from jaxrl_llm.losses import pkpo

N_MAX = 9


# ---------------------------------------------------------------- brute-force oracle (SPEC §5)


def bf_rho(g: list[float], k: int) -> float:
    subsets = list(itertools.combinations(range(len(g)), k))
    return sum(max(g[j] for j in S) for S in subsets) / len(subsets)


def bf_s(g: list[float], k: int) -> list[float]:
    n = len(g)
    out = [0.0] * n
    for S in itertools.combinations(range(n), k):
        best = max(g[j] for j in S)
        for j in S:
            out[j] += best
    return [v / math.comb(n, k) for v in out]


def bf_sloo(g: list[float], k: int) -> list[float]:
    n = len(g)
    return [s_i - k / n * bf_rho(g[:i] + g[i + 1 :], k) for i, s_i in enumerate(bf_s(g, k))]


def bf_sloo_minus_one(g: list[float], k: int) -> list[float]:
    n = len(g)
    if k == 1:
        return [(g[i] - (sum(g) - g[i]) / (n - 1)) / n for i in range(n)]
    return [s_i - k / n * bf_rho(g[:i] + g[i + 1 :], k - 1) for i, s_i in enumerate(bf_s(g, k))]


def cases(n: int, seed: int) -> np.ndarray:
    """[G, n] float64: continuous, binary, tied, all-equal and negative groups."""
    rng = np.random.default_rng(seed)
    rows = [
        rng.normal(size=n),
        rng.uniform(-1.0, 3.0, size=n),
        rng.exponential(size=n),
        rng.integers(0, 2, size=n).astype(float),  # binary 0/1
        np.where(rng.random(n) < 0.3, 1.0, -1.0),  # binary ±1 (SPEC §8 default rewards)
        np.ones(n),  # all correct
        rng.integers(0, 3, size=n).astype(float) * 0.5,  # many ties
        np.full(n, -0.7),  # all equal
        np.round(rng.normal(size=n), 1),  # ties among continuous values
    ]
    return np.stack(rows)


ORACLES = {
    "rho": (pkpo.rho, bf_rho, lambda n, k: k <= n),
    "s": (pkpo.s, bf_s, lambda n, k: k <= n),
    "sloo": (pkpo.sloo, bf_sloo, lambda n, k: k <= n - 1),
    "sloo_minus_one": (pkpo.sloo_minus_one, bf_sloo_minus_one, lambda n, k: n >= 2 and k <= n),
}


@pytest.fixture(scope="module")
def padded_cases():
    """Every n ≤ 9 as masked rows of one [G, 9] matrix (valid entries scattered), with the
    oracle's answers for every k: one compile per kernel and dtype covers all (n, k)."""
    rng = np.random.default_rng(0)
    rows, masks, sizes = [], [], []
    for n in range(1, N_MAX + 1):
        for row in cases(n, seed=n):
            where = np.sort(rng.choice(N_MAX, n, replace=False))
            full = np.full(N_MAX, 1e6)  # padding values must never leak in
            full[where] = row
            rows.append(full)
            masks.append(np.isin(np.arange(N_MAX), where))
            sizes.append(n)
    return np.stack(rows), np.stack(masks), np.array(sizes)


def check_against_oracle(padded_cases, dtype, atol: float) -> None:
    g, mask, sizes = padded_cases
    g_dev = jnp.asarray(g, dtype)
    g_used = np.asarray(g_dev, np.float64)  # the values the kernel actually sees
    for name, (fn, oracle, supported) in ORACLES.items():
        # under jit the mask is traced: groups too small for k must come back as zeros
        jitted = jax.jit(fn)
        for k in range(1, N_MAX + 1):
            got = np.asarray(jitted(g_dev, k, mask), np.float64)
            for r in range(g.shape[0]):
                valid = list(g_used[r][mask[r]])
                if not supported(sizes[r], k):
                    assert np.all(got[r] == 0.0), f"{name} n={sizes[r]} k={k}: want zeros"
                    continue
                want = oracle(valid, k)
                msg = f"{name} n={sizes[r]} k={k} row={r} {dtype}"
                if name == "rho":
                    np.testing.assert_allclose(got[r], want, rtol=0, atol=atol, err_msg=msg)
                else:
                    np.testing.assert_allclose(got[r][mask[r]], want, rtol=0, atol=atol, err_msg=msg)
                    assert np.all(got[r][~mask[r]] == 0.0), msg


def test_matches_brute_force_float64(padded_cases):
    with jax.enable_x64(True):
        check_against_oracle(padded_cases, jnp.float64, 1e-9)  # far inside the 1e-6 target
        assert pkpo.s(jnp.ones((1, 3), jnp.float64), 2).dtype == jnp.float64


def test_matches_brute_force_float32(padded_cases):
    check_against_oracle(padded_cases, jnp.float32, 1e-4)


def test_unpadded_shapes_match_brute_force():
    """An exact [G, n] shape with no mask, through the eager (concrete-checked) path."""
    n = 5
    g = cases(n, seed=n)
    for name, (fn, oracle, supported) in ORACLES.items():
        for k in range(1, n + 1):
            if supported(n, k):
                want = np.array([oracle(list(row), k) for row in g])
                np.testing.assert_allclose(fn(g, k), want, atol=1e-5, err_msg=f"{name} {k}")


def test_masked_ragged_groups_match_brute_force_of_the_valid_samples():
    rng = np.random.default_rng(7)
    g = rng.normal(size=(24, N_MAX))
    g[8:16] = rng.integers(0, 2, size=(8, N_MAX))  # binary rows
    sizes = np.concatenate([np.arange(4, N_MAX + 1), np.arange(4, N_MAX + 1), [9] * 12])[:24]
    mask = np.zeros_like(g, bool)
    for r, size in enumerate(sizes):
        mask[r, rng.choice(N_MAX, size, replace=False)] = True  # valid entries scattered
    g_masked_garbage = np.where(mask, g, 1e6)  # padding values must not leak in
    for name, (fn, oracle, supported) in ORACLES.items():
        for k in (1, 2, 3):
            if not supported(4, k):
                continue
            got = np.asarray(fn(jnp.asarray(g_masked_garbage, jnp.float32), k, mask))
            for r in range(g.shape[0]):
                valid = list(g[r][mask[r]].astype(np.float32).astype(np.float64))
                want = oracle(valid, k)
                if name == "rho":
                    np.testing.assert_allclose(got[r], want, atol=1e-4, err_msg=f"{name} {r}")
                else:
                    np.testing.assert_allclose(got[r][mask[r]], want, atol=1e-4, err_msg=name)
                    assert np.all(got[r][~mask[r]] == 0.0), f"{name}: masked entries must be 0"


def test_signed_zeros_extremes_and_subnormals_sort_correctly():
    """The kernels sort on an integer image of the float bits: check the awkward values."""
    g = np.array([
        [0.0, -0.0, -1.5, 2.0, -1.5, -3e38, 1e-40, -1e-40],
        [3e38, -2.0, 0.0, -0.0, 1e-45, -1e-45, 7.0, 7.0],
        [0.0, -0.0, 1e-45, -1e-45, 1e-40, -1e-40, 0.0, -0.0],  # only zeros and subnormals
    ], np.float32)
    scale = np.abs(g).max(axis=1, keepdims=True)  # float32 sums are exact only to eps · scale
    for k in (1, 2, 3, 5, 8):
        for name, (fn, oracle, supported) in ORACLES.items():
            if not supported(8, k):
                continue
            want = np.array([oracle([float(v) for v in row], k) for row in g])
            err = np.abs(np.asarray(fn(g, k), np.float64) - want)
            # + float32's smallest normal: XLA flushes subnormal results to zero
            tol = 1e-6 * (scale[:, 0] if name == "rho" else scale) + 1.2e-38
            assert np.all(err <= tol), (name, k, err)


def test_traced_k_schedule_matches_concrete_k():
    g = jnp.asarray(cases(8, seed=3), jnp.float32)
    ks = jnp.arange(1, 9)
    for fn in (pkpo.rho, pkpo.s, pkpo.sloo_minus_one):
        traced = jax.jit(jax.vmap(fn, in_axes=(None, 0)))(g, ks)
        for k in range(1, 9):
            np.testing.assert_allclose(traced[k - 1], fn(g, k), rtol=1e-5, atol=1e-6)
    # annealing 8 → 1 inside one jitted step, no recompilation needed
    step = jax.jit(lambda r, k: pkpo.sloo_minus_one(r, k))
    np.testing.assert_allclose(step(g, jnp.int32(1)), pkpo.sloo_minus_one(g, 1), atol=1e-6)


def test_traced_out_of_range_k_and_too_small_groups_give_zeros():
    g = jnp.asarray(cases(5, seed=4), jnp.float32)
    fn = jax.jit(pkpo.sloo_minus_one)
    assert np.all(np.asarray(fn(g, jnp.int32(6))) == 0.0)
    assert np.all(np.asarray(fn(g, jnp.int32(0))) == 0.0)
    mask = np.ones((g.shape[0], 5), bool)
    mask[0, 2:] = False  # group 0 has 2 samples: too few for k = 3
    out = np.asarray(jax.jit(pkpo.sloo_minus_one)(g, 3, jnp.asarray(mask)))
    assert np.all(out[0] == 0.0) and np.all(np.isfinite(out))
    want = [bf_sloo_minus_one(list(np.asarray(g[1], np.float64)), 3)]
    np.testing.assert_allclose(out[1], want[0], atol=1e-5)


@pytest.mark.parametrize(
    ("fn", "k", "match"),
    [
        (pkpo.rho, 6, r"k=6 is out of range for groups of n=5"),
        (pkpo.s, 0, r"k=0 is out of range"),
        (pkpo.sloo, 5, r"sloo: k=5 is out of range .*1 ≤ k ≤ 4"),
        (pkpo.sloo_minus_one, 2.5, r"k must be an integer"),
    ],
)
def test_concrete_bad_k_is_a_clear_error(fn, k, match):
    with pytest.raises(ValueError, match=match):
        fn(np.zeros((2, 5)), k)


def test_other_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match=r"sloo_minus_one: .*n ≥ 2"):
        pkpo.sloo_minus_one(np.zeros((3, 1)), 1)
    with pytest.raises(ValueError, match=r"rewards must have shape \[G, n\]"):
        pkpo.s(np.zeros(5), 1)
    with pytest.raises(ValueError, match=r"mask must have the shape"):
        pkpo.s(np.zeros((2, 5)), 1, np.ones((2, 4), bool))
    mask = np.ones((3, 5), bool)
    mask[2, 2:] = False
    with pytest.raises(ValueError, match=r"group 2 with 2 valid sample\(s\), too few for k=3"):
        pkpo.s(np.zeros((3, 5)), 3, mask)
    with pytest.raises(ValueError, match=r"correct must be bool"):
        pkpo.binary_transform(np.zeros((2, 5)), 1)


def test_binary_transform_equals_s_on_binary_rewards(padded_cases):
    _, mask, sizes = padded_cases
    rng = np.random.default_rng(5)
    correct = rng.random(mask.shape) < rng.random((mask.shape[0], 1))  # 0 % … 100 % correct
    binary, weights = jax.jit(pkpo.binary_transform), jax.jit(pkpo.s)
    for k in range(1, N_MAX + 1):
        np.testing.assert_allclose(
            binary(correct, k, mask), weights(correct.astype(np.float32), k, mask),
            atol=1e-6, err_msg=f"k={k}",
        )
    correct = rng.random((4, 1024)) < np.array([[0.001], [0.01], [0.3], [1.0]])
    mask = np.ones_like(correct)
    mask[0, 1000:] = False
    for k in (1, 8, 300, 1000):
        np.testing.assert_allclose(
            binary(correct, k, mask), weights(correct.astype(np.float32), k, mask),
            rtol=1e-4, atol=1e-7, err_msg=f"n=1024 k={k}",
        )


def test_pass_at_k_matches_enumeration_and_broadcasts():
    grid = []
    for n in range(1, N_MAX + 1):
        for c in range(n + 1):
            for k in range(1, n + 1):
                hits = [any(j < c for j in S) for S in itertools.combinations(range(n), k)]
                grid.append((n, c, k, sum(hits) / len(hits)))
                assert abs(pkpo.pass_at_k(n, c, k) - grid[-1][3]) < 1e-12, (n, c, k)
    n, c, k, want = (np.array(col) for col in zip(*grid))
    np.testing.assert_allclose(pkpo.pass_at_k(n, c, k), want, rtol=0, atol=1e-12)
    got_jax = pkpo.pass_at_k(jnp.asarray(n), jnp.asarray(c), jnp.asarray(k))
    assert isinstance(got_jax, jax.Array)
    np.testing.assert_allclose(got_jax, want, rtol=0, atol=1e-6)
    n = np.array([[16], [1024]])
    c = np.array([0, 1, 5, 16])
    got = pkpo.pass_at_k(n, c, 8)
    assert isinstance(got, np.ndarray) and got.shape == (2, 4) and got.dtype == np.float64
    exact = [[1 - Fraction(math.comb(int(a) - b, 8), math.comb(int(a), 8)) for b in c] for a in n[:, 0]]
    np.testing.assert_allclose(got, np.array(exact, float), atol=1e-12)
    got_jax = jax.jit(pkpo.pass_at_k)(jnp.asarray(n), jnp.asarray(c), jnp.asarray(8))
    np.testing.assert_allclose(got_jax, np.array(exact, float), atol=5e-5)
    with pytest.raises(ValueError, match=r"need 1 ≤ k ≤ n"):
        pkpo.pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match=r"need 0 ≤ c ≤ n"):
        pkpo.pass_at_k(4, 5, 2)


# ---------------------------------------------------------------- n = 1,024 in float32


def _log_comb(a, b):
    return scipy.special.gammaln(a + 1) - scipy.special.gammaln(b + 1) - scipy.special.gammaln(a - b + 1)


def _sorted_weights_f64(n: int, k: int) -> np.ndarray:
    """C(i, k−1)/C(n, k) for i = 0..n−1 through log-gamma in float64 (SPEC §5 host route)."""
    i = np.arange(n)
    return np.where(i >= k - 1, np.exp(_log_comb(np.maximum(i, k - 1), k - 1) - _log_comb(n, k)), 0.0)


def reference_sorted_formula(g: np.ndarray, k: int) -> tuple[float, np.ndarray, np.ndarray]:
    """ρ, s and sloo_minus_one of one group from SPEC §5's sorted formulas, O(n²), float64."""
    n = g.size
    order = np.argsort(g)
    x = g[order]
    w = _sorted_weights_f64(n, k)
    i = np.arange(n)
    off = np.zeros(n)  # C(j−1, k−2)/C(n, k)
    if k >= 2:
        ok = i - 1 >= k - 2
        off[ok] = np.exp(_log_comb(i[ok] - 1, k - 2) - _log_comb(n, k))
    upper = np.triu(np.ones((n, n)), 1)  # j > i
    s_sorted = w * x + upper @ (off * x)
    u = _sorted_weights_f64(n - 1, k - 1) if k >= 2 else None
    if k >= 2:
        # ρ(g_{−i}, k−1): j < i keeps index j, j > i moves to j − 1
        loo_w = np.tril(np.ones((n, n)), -1) * np.append(u, 0.0)[None, :]
        loo_w += upper * np.concatenate([[0.0], u])[None, :]
        sloo_m1 = s_sorted - k / n * (loo_w @ x)
    else:
        sloo_m1 = (x - (x.sum() - x) / (n - 1)) / n
    s_out, m1_out = np.empty(n), np.empty(n)
    s_out[order], m1_out[order] = s_sorted, sloo_m1
    return float(w @ x), s_out, m1_out


def test_n_1024_float32_is_finite_and_matches_float64_log_gamma_reference():
    g = np.random.default_rng(11).normal(size=(2, 1024))
    g[1] = np.round(g[1])  # heavy ties
    g32 = jnp.asarray(g, jnp.float32)
    for k in (1, 2, 8, 100, 512, 1024):
        rho32, s32, m132 = (np.asarray(f(g32, k)) for f in (pkpo.rho, pkpo.s, pkpo.sloo_minus_one))
        assert np.isfinite(s32).all() and np.isfinite(m132).all() and np.isfinite(rho32).all()
        for r in range(2):
            rho64, s64, m164 = reference_sorted_formula(np.asarray(g32[r], np.float64), k)
            scale = np.abs(g[r]).max() * k / 1024  # the size of the largest weight × reward
            np.testing.assert_allclose(rho32[r], rho64, atol=1e-5 * np.abs(g[r]).max())
            np.testing.assert_allclose(s32[r], s64, atol=1e-5 * scale, err_msg=f"s k={k}")
            np.testing.assert_allclose(m132[r], m164, atol=1e-5 * scale, err_msg=f"m1 k={k}")


# ---------------------------------------------------------------- unbiasedness (003 Thm. 4)

OUTCOME_REWARDS = np.array([0.0, 0.3, 0.5, 1.0])
THETA = np.array([0.4, -0.2, 0.3, -1.0])


def exact_max_at_k_grad(theta: jax.Array, k: int) -> np.ndarray:
    """∇θ E_{x_1..x_k ~ softmax(θ)}[max r(x_j)] by enumerating all 4^k outcome tuples."""
    tuples = np.array(list(itertools.product(range(4), repeat=k)))
    best = OUTCOME_REWARDS[tuples].max(axis=1)

    def objective(th):
        logp = jax.nn.log_softmax(th)
        return jnp.sum(jnp.exp(logp[tuples].sum(axis=1)) * best)

    with jax.enable_x64(True):
        return np.asarray(jax.grad(objective)(jnp.asarray(theta, jnp.float64)))


@pytest.fixture(scope="module")
def sampled_batches():
    n, batches = 6, 200_000
    x = jax.random.categorical(jax.random.key(0), jnp.asarray(THETA), shape=(batches, n))
    return x, jnp.asarray(OUTCOME_REWARDS, jnp.float32)[x]


@pytest.mark.parametrize("k", [2, 4])
def test_score_function_estimators_are_unbiased_for_grad_max_at_k(sampled_batches, k):
    x, g = sampled_batches
    p = jax.nn.softmax(jnp.asarray(THETA, jnp.float32))
    score = jax.nn.one_hot(x, 4) - p  # ∇θ log softmax(θ)[x]
    exact = exact_max_at_k_grad(THETA, k)

    def mc(weights):
        per_batch = np.asarray(jnp.einsum("bn,bnv->bv", weights, score), np.float64)
        return per_batch.mean(0), per_batch.std(0) / np.sqrt(per_batch.shape[0])

    for name, fn in (("s", pkpo.s), ("sloo", pkpo.sloo), ("sloo_minus_one", pkpo.sloo_minus_one)):
        mean, se = mc(fn(g, k))
        assert np.all(np.abs(mean - exact) < 4.5 * se + 1e-5), (name, mean, exact, se)
    # the same machinery detects bias: a baseline that includes the sample itself
    biased = pkpo.s(g, k) - k / g.shape[1] * pkpo.rho(g, k)[:, None]
    mean, se = mc(biased)
    assert np.max(np.abs(mean - exact) / se) > 20, "a biased estimator must be visible"
