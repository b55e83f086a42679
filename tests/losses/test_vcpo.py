"""VCPO (arXiv:2602.17616; formulas as its authors' README states them, defaults from their
code) against a float64 transcription: the sequence weight w = π(y)/μ(y), truncated at C = 8
in the gradient, the per-group OPOB `b* = Σ w²‖∇log π‖² R / Σ w²‖∇log π‖²`, the advantage
`(R − b*)/std_g R`, the loss `−(1/N) Σ_i w̄_i A_i log π(y_i)`, `ρ_ess = (Σw)²/(N Σw²)` and the
step scale `√min(1, ρ_ess)`. The truncation binds on some records and not on others; the
OPOB is checked to minimise the estimator's second moment by brute force."""

from __future__ import annotations

import numpy as np
import pytest

from tests.losses.async_helpers import GROUPS, batch, run, with_garbage


def spread_batch(seed):
    """Sequence ratios from ≪ 1 to ≫ 8 (per-token spread 0.8 over ~7 tokens; μ's token
    probabilities low enough that π's are rarely clipped at 1)."""
    return batch(seed, spread=0.8, low=0.01, high=0.2)


def score_norms(seed, b=12):
    return np.random.default_rng(100 + seed).uniform(0.5, 20.0, b)


def ref_vcpo(lp, lm, m, r, groups, s, *, cap=8.0, scale_by_std=True, baseline="opob",
             rule="sqrt", base=1.0):
    """(loss, d loss / d log π_t, w̄ [B], step scale, b [B]) by loops."""
    b, t = lp.shape
    w = np.array([np.exp(sum(lp[i, j] - lm[i, j] for j in range(t) if m[i, j])) for i in range(b)])
    base_g = np.zeros(b)
    adv = np.zeros(b)
    for i in range(b):
        sel = groups == groups[i]
        if baseline == "opob":
            weight = w[sel] ** 2 * s[sel]
            base_g[i] = (weight * r[sel]).sum() / weight.sum()
        else:
            base_g[i] = r[sel].mean()
        adv[i] = r[i] - base_g[i]
        if scale_by_std:
            adv[i] /= r[sel].std() + 1e-6
    w_bar = np.minimum(w, cap) if cap is not None else w
    loss, grad = 0.0, np.zeros((b, t))
    for i in range(b):
        for j in range(t):
            if m[i, j]:
                loss += -w_bar[i] * adv[i] * lp[i, j] / b
                grad[i, j] = -w_bar[i] * adv[i] / b
    rho = w.sum() ** 2 / (b * (w**2).sum())
    scale = {"sqrt": np.sqrt(min(1.0, rho / base)), "linear": min(1.0, rho / base),
             "off": 1.0}[rule]
    return loss, grad, w_bar, scale, base_g, rho


@pytest.mark.parametrize("seed", [0, 1, 3])
def test_value_gradient_ess_and_scale_match(seed):
    lp, lm, m, r = spread_batch(seed)
    s = score_norms(seed)
    want, dwant, w_bar, scale, _, rho = ref_vcpo(lp, lm, m, r, GROUPS, s)
    w = np.exp(((lp - lm) * m).sum(1))
    assert (w > 8).any() and (w < 8).any(), w  # the truncation binds on some records only
    out, got, grad = run("vcpo", lp, lm, m, r, score_sq_norms=s.astype(np.float32))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(grad, dwant, rtol=2e-4, atol=1e-7)
    np.testing.assert_allclose(float(out.metrics["ess_ratio"]), rho, rtol=1e-4)
    np.testing.assert_allclose(float(out.metrics["update_scale"]), scale, rtol=1e-4)
    assert 0 < scale < 1


@pytest.mark.parametrize("options,ref", [
    (dict(is_cap=None, ess_rule="linear", ess_base=0.5), dict(cap=None, rule="linear", base=0.5)),
    (dict(baseline="group_mean", scale_by_std=False, aggregation="seq-mean-token-sum"),
     dict(baseline="group_mean", scale_by_std=False)),
])
def test_options_against_the_transcription(options, ref):
    lp, lm, m, r = spread_batch(4)
    s = score_norms(4)
    want, dwant, _, scale, _, _ = ref_vcpo(lp, lm, m, r, GROUPS, s, **ref)
    out, got, grad = run("vcpo", lp, lm, m, r, score_sq_norms=s.astype(np.float32), **options)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(grad, dwant, rtol=2e-4, atol=1e-7)
    np.testing.assert_allclose(float(out.metrics["update_scale"]), scale, rtol=1e-4)


def test_opob_minimises_the_second_moment_by_brute_force():
    """For each group, b* minimises Σ_i ‖w_i (R_i − b) s_i‖² = Σ_i w_i² ‖s_i‖² (R_i − b)² (the
    variance of the estimator up to b-independent terms): no b on a fine grid does better."""
    from jaxrl_llm.losses.variance_controlled import opob_baselines

    lp, lm, m, r = spread_batch(6)
    s = score_norms(6)
    ell = ((lp - lm) * m).sum(1)
    got = np.asarray(opob_baselines(r.astype(np.float32), GROUPS, ell.astype(np.float32),
                                    s.astype(np.float32), np.ones(len(r), bool)))
    w2s = np.exp(2 * ell) * s
    for g in np.unique(GROUPS):
        sel = GROUPS == g
        grid = np.linspace(r[sel].min() - 1, r[sel].max() + 1, 20001)
        moment = (w2s[sel][None] * (r[sel][None] - grid[:, None]) ** 2).sum(1)
        best = grid[np.argmin(moment)]
        assert abs(got[sel][0] - best) <= 2 * (grid[1] - grid[0]), (got[sel][0], best)
        # and it differs from the on-policy group mean here (the weights are far from equal)
        assert abs(got[sel][0] - r[sel].mean()) > 1e-3


def test_all_masked_batch_is_a_counted_zero_step_not_nan():
    """No completion token anywhere: no ESS (0/0). The step scale is 0 and `empty_batch`
    counts it; loss, gradient and every metric are finite."""
    lp, lm, m, r = spread_batch(7)
    m0 = np.zeros_like(m)
    lp_nan, lm_nan = with_garbage(lp, lm, m0)
    out, got, grad = run("vcpo", lp_nan, lm_nan, m0, r, score_sq_norms=np.zeros(len(r), np.float32))
    assert got == 0.0 and np.all(grad == 0)
    metrics = {k: float(v) for k, v in out.metrics.items()}
    assert all(np.isfinite(v) for v in metrics.values()), metrics
    assert metrics["update_scale"] == 0.0 and metrics["empty_batch"] == 1.0
    assert metrics["ess_ratio"] == 0.0


def test_records_without_tokens_enter_neither_ess_nor_baseline():
    lp, lm, m, r = spread_batch(8)
    s = score_norms(8)
    m2 = m.copy()
    m2[[1, 6]] = 0.0  # two records lose every token
    keep = m2.sum(1) > 0
    out, _, _ = run("vcpo", lp, lm, m2, r, score_sq_norms=s.astype(np.float32))
    w = np.exp(((lp - lm) * m2).sum(1))[keep]
    rho = w.sum() ** 2 / (keep.sum() * (w**2).sum())
    np.testing.assert_allclose(float(out.metrics["ess_ratio"]), rho, rtol=1e-4)
    assert float(out.metrics["empty_batch"]) == 0.0


def test_opob_needs_the_score_norms():
    lp, lm, m, r = spread_batch(0)
    with pytest.raises(ValueError, match="score_sq_norms"):
        run("vcpo", lp, lm, m, r)
    run("vcpo", lp, lm, m, r, baseline="group_mean")  # the ablation needs none


def test_masked_tokens_are_never_read():
    lp, lm, m, r = spread_batch(5)
    s = score_norms(5).astype(np.float32)
    _, clean, g_clean = run("vcpo", lp, lm, m, r, score_sq_norms=s)
    lp_nan, lm_nan = with_garbage(lp, lm, m)
    _, dirty, g_dirty = run("vcpo", lp_nan, lm_nan, m, r, score_sq_norms=s)
    assert dirty == clean
    np.testing.assert_array_equal(g_dirty, g_clean)
