"""AsymRE (arXiv:2506.20520) against a float64 transcription of its objective
`J(π) = E_{y∼μ}[log π(y) (r(y) − V)]`, `V = V^μ + δV` with V^μ the group's mean reward, per
record length-normalised (TOPR's convention) or not (the objective as written); its relation
to TOPR: the gradient of TOPR's `reinforce` preset with that baseline, and TOPR eq. 12's
effective positive fraction `p(1 − c)/(1 + (1 − 2p)c)` with c the group baseline on ±1
rewards. The shift δV moves some records across the sign line and not others."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxrl_llm.losses.registry import LOSS_SPECS
from tests.losses.async_helpers import GROUPS, batch, run


def ref_asymre(lp, m, r, groups, delta_v=-0.1, length_norm=True):
    """(loss, d loss / d log π_t, A) by loops."""
    b, t = lp.shape
    adv = np.array([r[i] - (r[groups == groups[i]].mean() + delta_v) for i in range(b)])
    loss, grad = 0.0, np.zeros((b, t))
    for i in range(b):
        n = m[i].sum() if length_norm else 1.0
        loss += -adv[i] * sum(lp[i, j] for j in range(t) if m[i, j]) / n / b
        grad[i] = -adv[i] * m[i] / n / b
    return loss, grad, adv


def noisy(seed):
    """Rewards near their group's mean, so that δV = −0.1 changes some records' sign."""
    lp, lm, m, _ = batch(seed)
    r = np.random.default_rng(seed).normal(0.0, 0.08, len(lp)) + np.repeat([0.2, 0.5, 0.9], 4)
    return lp, lm, m, r


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("length_norm", [True, False])
def test_value_and_gradient_match_the_objective(seed, length_norm):
    lp, _, m, r = noisy(seed)
    want, dwant, adv = ref_asymre(lp, m, r, GROUPS, length_norm=length_norm)
    flipped = np.sign(adv) != np.sign(adv - 0.1)  # vs. the symmetric baseline δV = 0
    assert flipped.any() and (~flipped).any(), adv  # δV moves some records across, not all
    out, got, grad = run("asymre", lp, None, m, r, length_norm=length_norm)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(grad, dwant, rtol=2e-5, atol=1e-8)
    np.testing.assert_allclose(float(out.metrics["num_pos"]), (adv >= 0).sum())


def test_gradient_is_topr_reinforce_with_the_group_baseline():
    """The same gradient as TOPR's `reinforce` preset (weights 1/1, TOPR Table 1) with the
    per-record baseline V = mean_group R + δV."""
    lp, lm, m, r = batch(5)
    _, _, adv = ref_asymre(lp, m, r, GROUPS, delta_v=-0.2)
    baseline = (r - adv).astype(np.float32)
    _, _, g_asym = run("asymre", lp, None, m, r, delta_v=-0.2)

    def topr(x):
        return LOSS_SPECS["reinforce"].kernel(
            x, np.asarray(lm, np.float32), np.asarray(m, np.float32),
            np.asarray(r, np.float32), baseline=baseline).loss

    g_topr = np.asarray(jax.grad(topr)(np.asarray(lp, np.float32)))
    np.testing.assert_allclose(g_asym, g_topr, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("delta_v", [0.0, -0.1, -0.2])
def test_effective_positive_fraction_is_topr_eq_12_per_group(delta_v):
    """±1 rewards, a group with a fraction p of positives: V = (2p − 1) + δV, so AsymRE is TOPR
    eq. 12 with the baseline c = 2p − 1 + δV; its effective positive fraction
    Σ_{A≥0}|A| / Σ|A| is p(1 − c)/(1 + (1 − 2p)c) (= 1/2 at δV = 0 for any p)."""
    for k, g in ((2, 8), (3, 8), (6, 8)):
        r = np.r_[np.ones(k), -np.ones(g - k)]
        lp = np.full((g, 3), -1.0)
        m = np.ones((g, 3))
        out, _, _ = run("asymre", lp, None, m, r, groups=np.zeros(g, int), delta_v=delta_v)
        p, c = k / g, 2 * k / g - 1 + delta_v
        assert -1 <= c <= 1  # eq. 12's range
        eq12 = p * (1 - c) / (1 + (1 - 2 * p) * c)
        np.testing.assert_allclose(float(out.metrics["effective_pos_fraction"]), eq12,
                                   rtol=1e-5)
        if delta_v == 0.0:
            np.testing.assert_allclose(eq12, 0.5, rtol=1e-12)


def test_masked_tokens_are_never_read():
    lp, _, m, r = batch(6)
    _, clean, g_clean = run("asymre", lp, None, m, r)
    _, dirty, g_dirty = run("asymre", np.where(m > 0, lp, np.nan), None, m, r)
    assert dirty == clean
    np.testing.assert_array_equal(g_dirty, g_clean)
