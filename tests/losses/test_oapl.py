"""OAPL (arXiv:2602.19362) against a float64 transcription of its regression,
`Σ_x Σ_i (β₂ log(π(y_i|x)/π_lag(y_i|x)) − (r_i − V̂*(x)))²` averaged over records, with
`V̂*(x) = β₁ log (1/G) Σ_j exp(r_j/β₁)` over the prompt's group, π_lag = μ. OAPL has no
mask or clip: its cases check the completion mask (only model tokens enter log π(y)), the
closed-form optimum (loss and gradient 0 at `π = π_lag · exp(Â*/β₂)`) and V̂*'s limits."""

from __future__ import annotations

import numpy as np
import pytest

from tests.losses.async_helpers import GROUPS, batch, run, with_garbage


def soft_value(rewards, beta1):
    """β₁ log mean exp(r/β₁), directly (moderate r/β₁ here: no overflow)."""
    return beta1 * np.log(np.mean(np.exp(np.asarray(rewards) / beta1)))


def ref_oapl(lp, lm, m, r, groups, beta=1e-3, value_beta=1.0):
    """(loss, d loss / d log π_t, Â*) by loops."""
    b, t = lp.shape
    adv = np.array([r[i] - soft_value(r[groups == groups[i]], value_beta) for i in range(b)])
    loss, grad = 0.0, np.zeros((b, t))
    for i in range(b):
        ell = sum(lp[i, j] - lm[i, j] for j in range(t) if m[i, j])
        resid = beta * ell - adv[i]
        loss += resid**2 / b
        for j in range(t):
            if m[i, j]:
                grad[i, j] = 2 * resid * beta / b
    return loss, grad, adv


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("beta,value_beta", [(1e-3, 1.0), (0.5, 0.3)])
def test_value_and_gradient_match_the_regression(seed, beta, value_beta):
    lp, lm, m, r = batch(seed)
    want, dwant, _ = ref_oapl(lp, lm, m, r, GROUPS, beta, value_beta)
    out, got, grad = run("oapl", lp, lm, m, r, beta=beta, value_beta=value_beta)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(grad, dwant, rtol=2e-4, atol=1e-8)
    assert np.all(grad[m == 0] == 0) and np.all(grad[m > 0] != 0)


def test_the_closed_form_optimum_is_a_zero():
    """At log π(y) = log π_lag(y) + Â*/β₂ the regression's residual, loss and gradient vanish
    (the paper's closed form π* ∝ π_lag exp(r/β)); one token off it does not."""
    beta, value_beta = 0.5, 1.0
    _, lm, m, r = batch(3)
    _, _, adv = ref_oapl(lm, lm, m, r, GROUPS, beta, value_beta)
    lp = lm.copy()
    first = np.argmax(m > 0, axis=1)  # put each record's whole shift on one model token
    lp[np.arange(len(lp)), first] += adv / beta
    _, got, grad = run("oapl", lp, lm, m, r, beta=beta, value_beta=value_beta)
    assert got < 1e-9 and np.abs(grad).max() < 1e-6
    lp[0, first[0]] += 0.3
    _, got, grad = run("oapl", lp, lm, m, r, beta=beta, value_beta=value_beta)
    np.testing.assert_allclose(got, (beta * 0.3) ** 2 / len(lp), rtol=1e-4)


def test_soft_value_limits():
    """V̂* → max_g r as β₁ → 0 and → mean_g r as β₁ → ∞ (A*-PO's estimator)."""
    from jaxrl_llm.losses.optimal_advantage import oapl_advantages

    r = np.array([0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0], np.float32)
    g = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    cold = np.asarray(oapl_advantages(r, g, value_beta=1e-4))
    np.testing.assert_allclose(cold, r - np.repeat([1.0, 1.0], 4), atol=1e-3)
    hot = np.asarray(oapl_advantages(r, g, value_beta=1e4))
    np.testing.assert_allclose(hot, r - np.repeat([0.25, 0.75], 4), atol=1e-3)


def test_equals_a_star_po_with_the_lagged_policy_as_reference():
    """OAPL is A*-PO's loss with π_ref replaced by π_lag: the project's apo kernel with
    ref_logp = log μ gives the same value (its defaults differ: passed explicitly)."""
    from jaxrl_llm.losses.preference import apo_loss

    lp, lm, m, r = batch(6)
    _, got, _ = run("oapl", lp, lm, m, r, beta=1e-2, value_beta=0.5)
    apo = apo_loss(*(np.asarray(x, np.float32) for x in (lp, lm, m, r)), GROUPS,
                   beta1=0.5, beta2=1e-2)
    np.testing.assert_allclose(got, float(apo.loss), rtol=1e-5)


def test_masked_tokens_and_padding_rows_are_never_read():
    lp, lm, m, r = batch(4)
    _, clean, g_clean = run("oapl", lp, lm, m, r, beta=0.1)
    lp_nan, lm_nan = with_garbage(lp, lm, m)
    _, dirty, g_dirty = run("oapl", lp_nan, lm_nan, m, r, beta=0.1)
    assert dirty == clean
    np.testing.assert_array_equal(g_dirty, g_clean)
    lp2 = np.vstack([lp, np.full((1, lp.shape[1]), np.nan)])
    lm2 = np.vstack([lm, np.full((1, lp.shape[1]), np.nan)])
    m2 = np.vstack([m, np.ones((1, lp.shape[1]))])
    rm = np.r_[np.ones(len(lp)), 0.0].astype(np.float32)
    _, padded, _ = run("oapl", lp2, lm2, m2, np.r_[r, 9.0], groups=np.r_[GROUPS, 0],
                       beta=0.1, record_mask=rm)
    np.testing.assert_allclose(padded, clean, rtol=1e-6)  # the pad's reward 9 enters no V̂*
