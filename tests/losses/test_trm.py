"""TRM (arXiv:2512.23075, v3 source) against a float64 transcription: the masked surrogate of
eq. 22 `L = E[M(x,y)·A·Σ_t ρ_t]` normalised by the whole batch N (rejected records count in
N), Algorithm 1's criterion `M = 1[max_t D(c_t) ≤ δ]` with the appendix's sample estimates
`k2 = ½(log ρ)²` (max) and `k3 = ρ − 1 − log ρ` (the combined criterion's average), GRPO's
advantages (its experiments). Every case rejects some records and accepts others."""

from __future__ import annotations

import numpy as np
import pytest

from tests.losses.async_helpers import GROUPS, batch, normalised, run, with_garbage


def ref_trm(lp, lm, m, adv, *, delta=0.05, delta_avg=None, agg="seq-mean-token-sum"):
    """(loss, d loss / d log π_t, accepted [B]) by loops."""
    b, t = lp.shape
    accept = np.zeros(b, bool)
    sums, grad = np.zeros(b), np.zeros((b, t))
    for i in range(b):
        toks = [j for j in range(t) if m[i, j]]
        log_rho = np.array([lp[i, j] - lm[i, j] for j in toks])
        k2 = 0.5 * log_rho**2
        k3 = np.exp(log_rho) - 1 - log_rho
        accept[i] = k2.max() <= delta and (delta_avg is None or k3.mean() <= delta_avg)
        for j in toks:
            rho = np.exp(lp[i, j] - lm[i, j])
            a = 1.0 if accept[i] else 0.0
            sums[i] += -a * adv[i] * rho
            grad[i, j] = -a * adv[i] * rho  # ∂ρ_t/∂log π_t = ρ_t
    n = b if agg == "seq-mean-token-sum" else m.sum()
    return sums.sum() / n, grad / n, accept


def small_shift(seed):
    """μ and π close enough that the sequence max of ½(log ρ)² straddles δ = 0.05."""
    return batch(seed, spread=0.18)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_value_and_gradient_match_eq_22(seed):
    lp, lm, m, r = small_shift(seed)
    adv = normalised(r, GROUPS)
    want, dwant, accept = ref_trm(lp, lm, m, adv)
    assert 0 < accept.sum() < len(accept), accept  # the mask binds on some records only
    out, got, grad = run("trm", lp, lm, m, r)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(grad, dwant, rtol=2e-4, atol=1e-7)
    np.testing.assert_allclose(float(out.metrics["masked_frac"]), 1 - accept.mean(), rtol=1e-6)
    # a rejected record has exactly zero gradient; it still counts in N
    assert np.all(grad[~accept] == 0)


def test_combined_criterion_and_token_mean():
    lp, lm, m, r = small_shift(3)
    adv = normalised(r, GROUPS)
    max_only = ref_trm(lp, lm, m, adv, delta=0.1)[2]
    want, dwant, accept = ref_trm(lp, lm, m, adv, delta=0.1, delta_avg=0.015,
                                  agg="token-mean")
    # the average criterion rejects records the max criterion alone accepts, not all of them
    assert (max_only & ~accept).any() and accept.any(), (max_only, accept)
    _, got, grad = run("trm", lp, lm, m, r, delta=0.1, delta_avg=0.015,
                       aggregation="token-mean")
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(grad, dwant, rtol=2e-4, atol=1e-7)


def test_gradient_by_finite_differences_of_the_transcription():
    lp, lm, m, r = small_shift(5)
    adv = normalised(r, GROUPS)
    _, dwant, accept = ref_trm(lp, lm, m, adv)
    assert 0 < accept.sum() < len(accept)
    h = 1e-6
    for i, j in zip(*np.nonzero(m)):
        up, down = lp.copy(), lp.copy()
        up[i, j] += h
        down[i, j] -= h
        if (ref_trm(up, lm, m, adv)[2] == accept).all() and (ref_trm(down, lm, m, adv)[2] ==
                                                             accept).all():
            fd = (ref_trm(up, lm, m, adv)[0] - ref_trm(down, lm, m, adv)[0]) / (2 * h)
            np.testing.assert_allclose(dwant[i, j], fd, rtol=1e-4, atol=1e-8)


def test_the_mask_is_length_invariant_per_token():
    """Algorithm 1's δ does not depend on T: one token over δ rejects its record whatever its
    length, and a record of many tokens each under δ is accepted."""
    from jaxrl_llm.losses.trust_region import trm_sequence_mask

    t = 64
    log_rho = np.full((2, t), np.sqrt(2 * 0.04))  # k2 = 0.04 ≤ 0.05 on every token
    log_rho[1, 37] = np.sqrt(2 * 0.06)  # one token with k2 = 0.06 > 0.05
    keep, max_k2, _ = trm_sequence_mask(log_rho.astype(np.float32), np.ones((2, t), bool), 0.05)
    assert np.asarray(keep).tolist() == [True, False]
    np.testing.assert_allclose(np.asarray(max_k2), [0.04, 0.06], rtol=1e-5)


def test_masked_tokens_and_padding_rows_are_never_read():
    lp, lm, m, r = small_shift(4)
    _, clean, g_clean = run("trm", lp, lm, m, r)
    lp_nan, lm_nan = with_garbage(lp, lm, m, value=-1e4)  # a huge log-ratio off the mask
    _, dirty, g_dirty = run("trm", lp_nan, lm_nan, m, r)
    assert dirty == clean
    np.testing.assert_array_equal(g_dirty, g_clean)
    lp_nan, lm_nan = with_garbage(lp, lm, m)
    _, dirty, _ = run("trm", lp_nan, lm_nan, m, r)
    assert dirty == clean
