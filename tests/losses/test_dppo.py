"""DPPO (arXiv:2602.04879) against a float64 transcription of its equations, token by token:
the objective eq. 11 `E_y[Σ_t M_t r_t Â_t]`, the mask eq. 12, the Binary TV eq. 13 and KL
eq. 14, the advantage `R − mean_group R` of its §4.1, and the gradient of the appendix's
unified form `M_t min(r_t, C) Â_t ∇log π_t`; prime-rl's `kl_tau (log π/μ)²` term. Every case
asserts that the mask drops some tokens of each advantage sign and keeps others."""

from __future__ import annotations

import numpy as np
import pytest

from tests.losses.async_helpers import GROUPS, batch, centred, normalised, run, with_garbage


def divergence(p: float, q: float, kind: str) -> float:
    """Eq. 13 |q − p| or eq. 14 q log(q/p) + (1 − q) log((1 − q)/(1 − p)); q = μ(a), p = π(a)."""
    if kind == "tv":
        return abs(q - p)
    return q * np.log(q / p) + (1 - q) * np.log((1 - q) / (1 - p))


def ref_dppo(lp, lm, m, adv, *, kind="tv", delta=None, delta_low=None, cap=None, kl_tau=0.0,
             agg="seq-mean-token-sum"):
    """(loss, d loss/d log π_t, kept mask) by loops over records and tokens."""
    d_hi = {"tv": 0.15, "kl": 0.05}[kind] if delta is None else delta
    d_lo = d_hi if delta_low is None else delta_low
    b, t = lp.shape
    keep = np.zeros((b, t), bool)
    sums, dsum = np.zeros(b), np.zeros((b, t))
    for i in range(b):
        for j in range(t):
            if not m[i, j]:
                continue
            p, q = np.exp(lp[i, j]), np.exp(lm[i, j])
            r, d = p / q, divergence(p, q, kind)
            out = (adv[i] > 0 and r > 1 and d > d_hi) or (adv[i] < 0 and r < 1 and d > d_lo)
            keep[i, j] = not out
            ell = lp[i, j] - lm[i, j]
            if cap is None or r <= cap:
                value, weight = r, r
            else:
                value, weight = cap * (1 + np.log(r / cap)), cap
            k = 0.0 if out else 1.0
            sums[i] += -k * value * adv[i] + kl_tau * ell**2
            dsum[i, j] = -k * weight * adv[i] + 2 * kl_tau * ell
    if agg == "seq-mean-token-sum":
        return sums.sum() / b, dsum / b, keep
    assert agg == "token-mean"
    n = m.sum()
    return sums.sum() / n, dsum / n, keep


def assert_binds(keep, m, adv):
    """Some tokens of positive and of negative records dropped, others kept."""
    for side in (adv > 0, adv < 0):
        sel = (m > 0) & side[:, None]
        assert 0 < (~keep[sel]).sum() < sel.sum(), (int((~keep[sel]).sum()), int(sel.sum()))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_value_and_gradient_match_the_paper(seed, kind):
    lp, lm, m, r = batch(seed)
    adv = centred(r, GROUPS)
    want, dwant, keep = ref_dppo(lp, lm, m, adv, kind=kind)
    assert_binds(keep, m, adv)
    out, got, grad = run("dppo", lp, lm, m, r, divergence=kind)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(grad, dwant, rtol=2e-4, atol=1e-6)
    np.testing.assert_allclose(float(out.metrics["masked_frac"]), (~keep[m > 0]).mean(),
                               rtol=1e-6)


@pytest.mark.parametrize("options,ref", [
    (dict(delta=0.3, delta_low=0.1), dict(delta=0.3, delta_low=0.1)),
    (dict(ratio_cap=1.3), dict(cap=1.3)),
    (dict(kl_tau=1e-2, aggregation="token-mean"), dict(kl_tau=1e-2, agg="token-mean")),
])
def test_options_against_the_transcription(options, ref):
    lp, lm, m, r = batch(5)
    adv = centred(r, GROUPS)
    want, dwant, keep = ref_dppo(lp, lm, m, adv, **ref)
    assert_binds(keep, m, adv)
    if "cap" in ref:  # the cap binds on some kept tokens and not on others
        ratio = np.exp(lp - lm)[keep & (m > 0)]
        assert (ratio > ref["cap"]).any() and (ratio <= ref["cap"]).any()
    _, got, grad = run("dppo", lp, lm, m, r, **options)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(grad, dwant, rtol=2e-4, atol=1e-6)


def test_gradient_by_finite_differences_of_the_transcription():
    """The analytic derivative above is itself checked: central differences of the
    transcription's value in each unmasked log π_t (masks held fixed at the point)."""
    lp, lm, m, r = batch(7)
    adv = centred(r, GROUPS)
    _, dwant, keep = ref_dppo(lp, lm, m, adv, cap=1.3, kl_tau=1e-2)
    _, _, grad = run("dppo", lp, lm, m, r, ratio_cap=1.3, kl_tau=1e-2)
    h = 1e-6
    for i, j in zip(*np.nonzero(m)):
        up, down = lp.copy(), lp.copy()
        up[i, j] += h
        down[i, j] -= h
        fd = (ref_dppo(up, lm, m, adv, cap=1.3, kl_tau=1e-2)[0]
              - ref_dppo(down, lm, m, adv, cap=1.3, kl_tau=1e-2)[0]) / (2 * h)
        if ref_dppo(up, lm, m, adv)[2][i, j] == keep[i, j] == ref_dppo(down, lm, m, adv)[2][i, j]:
            np.testing.assert_allclose(dwant[i, j], fd, rtol=1e-4, atol=1e-7)
            np.testing.assert_allclose(grad[i, j], fd, rtol=2e-3, atol=1e-6)


def test_std_scaled_advantages_and_given_advantages():
    lp, lm, m, r = batch(3)
    adv = normalised(r, GROUPS)
    want, _, keep = ref_dppo(lp, lm, m, adv)
    assert_binds(keep, m, adv)
    _, got, _ = run("dppo", lp, lm, m, r, scale_by_std=True)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    _, got, _ = run("dppo", lp, lm, m, r, advantages=adv.astype(np.float32))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)


def test_masked_tokens_and_padding_rows_are_never_read():
    lp, lm, m, r = batch(4)
    _, clean, g_clean = run("dppo", lp, lm, m, r)
    lp_nan, lm_nan = with_garbage(lp, lm, m)
    _, dirty, g_dirty = run("dppo", lp_nan, lm_nan, m, r)
    assert dirty == clean
    np.testing.assert_array_equal(g_dirty[m > 0], g_clean[m > 0])
    assert np.all(g_dirty[m == 0] == 0)
    # a padding row (record_mask 0, NaN everywhere) adds nothing and is in no group's mean
    lp2 = np.vstack([lp, np.full((1, lp.shape[1]), np.nan)])
    lm2 = np.vstack([lm, np.full((1, lp.shape[1]), np.nan)])
    m2 = np.vstack([m, np.ones((1, lp.shape[1]))])
    rm = np.r_[np.ones(len(lp)), 0.0].astype(np.float32)
    out, padded, _ = run("dppo", lp2, lm2, m2, np.r_[r, 5.0], groups=np.r_[GROUPS, 0],
                         record_mask=rm)
    np.testing.assert_allclose(padded, clean, rtol=1e-6)
    assert np.isfinite(float(out.metrics["log_ratio_max"]))


def test_binary_divergences_on_hand_values():
    """DPPO §4.2's own example: μ(a) = 0.99 → π(a) = 0.80 moves 0.19 of mass (TV 0.19), while
    μ(a) = 1e-4 → π(a) = 1e-2 moves < 0.01: the TV mask blocks the first (Â < 0, r < 1, 0.19 >
    0.15) and not the second (Â > 0, r = 100 > 1, but 0.0099 < 0.15), where PPO's ratio clip
    would do the opposite."""
    from jaxrl_llm.losses.trust_region import binary_kl, binary_tv, dppo_mask

    lp = np.log(np.array([[0.80, 1e-2]], np.float32))
    lm = np.log(np.array([[0.99, 1e-4]], np.float32))
    tv = np.asarray(binary_tv(lp, lm))
    np.testing.assert_allclose(tv, [[0.19, 0.0099]], rtol=1e-4)
    kl = np.asarray(binary_kl(lp, lm))
    np.testing.assert_allclose(kl, [[divergence(0.80, 0.99, "kl"), divergence(1e-2, 1e-4, "kl")]],
                               rtol=1e-4)
    keep_neg = np.asarray(dppo_mask(lp - lm, tv, np.array([-1.0]), np.ones((1, 2), bool),
                                    0.15, 0.15))
    keep_pos = np.asarray(dppo_mask(lp - lm, tv, np.array([1.0]), np.ones((1, 2), bool),
                                    0.15, 0.15))
    assert keep_neg.tolist() == [[False, True]]
    assert keep_pos.tolist() == [[True, True]]  # the low-probability token's update goes through
