"""CISPO, GSPO, IcePop, M2PO and VESPO against direct float64 NumPy transcriptions of their
papers' equations (losses/stale_is.py; docs/kernels.md § Stale-sample losses).

Every expected value and gradient below is computed here from the equation, token by token,
never from the kernels; the gradients are the equations' analytic derivatives with respect to
log π_t, compared with `jax.grad` of the kernels' loss.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxrl_llm.config import ConfigError, load_config
from jaxrl_llm.losses import stale_is
from jaxrl_llm.losses.registry import LOSS_SPECS

NAMES = ("cispo", "gspo", "icepop", "m2po", "vespo")
GROUPS = np.array([0, 0, 0, 1, 1, 1, 2, 2])


def batch(seed: int, b: int = 8, t: int = 7, spread: float = 0.4):
    rng = np.random.default_rng(seed)
    logmu = rng.uniform(-3.0, -0.05, (b, t))
    logp = logmu + rng.normal(0.0, spread, (b, t))
    mask = (rng.random((b, t)) > 0.25).astype(np.float64)
    mask[:, 0] = 1.0  # every record has a completion token
    rewards = rng.integers(0, 2, b).astype(np.float64) + rng.normal(0, 0.1, b)
    return logp, logmu, mask, rewards


def group_adv(rewards, groups):
    """Â = (R − mean_g R)/(std_g R + 1e-6), population std (FPA arXiv:2509.19893 eq. 34)."""
    adv = np.zeros_like(rewards)
    for g in np.unique(groups):
        sel = groups == g
        adv[sel] = (rewards[sel] - rewards[sel].mean()) / (rewards[sel].std() + 1e-6)
    return adv


def run(name, logp, logmu, mask, rewards, groups=GROUPS, **kw):
    """The kernel's loss and d loss / d log π_t (float32 inputs, as the trainer gives them)."""
    kernel = LOSS_SPECS[name].kernel
    args = [np.asarray(x, np.float32) for x in (logmu, mask, rewards)]

    def f(lp):
        return kernel(lp, args[0], args[1], args[2], groups, **kw).loss

    lp = np.asarray(logp, np.float32)
    out = kernel(lp, *args, groups, **kw)
    return out, float(out.loss), np.asarray(jax.grad(f)(lp), np.float64)


# ------------------------------------------------------------ float64 transcriptions


def ref_cispo(lp, lm, m, adv, eps_low=None, eps_high=0.28):
    """arXiv:2506.13585 eq. 4–5: J = 1/Σ|o_i| Σ_i Σ_t sg(r̂_it) Â_i log π_it."""
    n = m.sum()
    r = np.exp(lp - lm)
    lo = 0.0 if eps_low is None else 1 - eps_low
    w = np.minimum(np.maximum(r, lo), 1 + eps_high)
    loss = sum(-w[i, t] * adv[i] * lp[i, t] for i in range(len(lp)) for t in range(lp.shape[1])
               if m[i, t]) / n
    grad = -w * adv[:, None] * m / n
    return loss, grad


def ref_gspo(lp, lm, m, adv, eps_low=3e-4, eps_high=4e-4):
    """arXiv:2507.18071 eq. 5–7: J = 1/G Σ_i min(s_i Â_i, clip(s_i, 1−ε, 1+ε) Â_i)."""
    b = len(lp)
    loss, grad = 0.0, np.zeros_like(lp)
    for i in range(b):
        sel = m[i] > 0
        s = np.exp(np.mean(lp[i, sel] - lm[i, sel]))
        unclipped, clipped = s * adv[i], min(max(s, 1 - eps_low), 1 + eps_high) * adv[i]
        loss += -min(unclipped, clipped) / b
        if 1 - eps_low < s < 1 + eps_high or unclipped < clipped:
            # the unclipped branch is active: ∂s_i/∂log π_t = s_i/|y_i|
            grad[i, sel] = -adv[i] * s / sel.sum() / b
    return loss, grad


def ref_icepop(lp, lm, m, adv, alpha=0.5, beta=5.0, level="token"):
    """arXiv:2510.18855 with θ_old = θ: J = 1/Σ|y_i| Σ M(k_it; α, β) k_it Â_i, ∇ through log π."""
    n = m.sum()
    k = np.exp(lp - lm)
    if level == "sequence":
        k = np.repeat(np.exp(((lp - lm) * m).sum(1, keepdims=True)), lp.shape[1], 1)
    keep = (k >= alpha) & (k <= beta)
    loss = float(np.sum(-(keep * k) * adv[:, None] * m)) / n
    return loss, -(keep * k) * adv[:, None] * m / n


def brute_m2_keep(log_r, valid, tau):
    """arXiv:2510.01161's masking loop: while the kept tokens' mean (log r)² > τ, drop the largest."""
    kept = {(i, t) for i, t in zip(*np.nonzero(valid))}
    while kept and np.mean([log_r[p] ** 2 for p in kept]) > tau:
        kept.remove(max(kept, key=lambda p: log_r[p] ** 2))
    keep = np.zeros(valid.shape, bool)
    for p in kept:
        keep[p] = True
    return keep


def ref_m2po(lp, lm, m, adv, tau=0.04, mask_tokens="trust_region"):
    """J = 1/Σ|o_i| Σ_i Σ_t M_it r_it Â_i (AReaL docs/en/algorithms/m2po.md, arXiv:2510.01161);
    the paper's loop (default) runs over the tokens with Â·log r > 0 only, keeping the rest."""
    n = m.sum()
    covered = m > 0
    if mask_tokens == "trust_region":
        covered &= adv[:, None] * (lp - lm) > 0
    keep = brute_m2_keep(lp - lm, covered, tau) | ((m > 0) & ~covered)
    r = np.exp(lp - lm)
    return float(np.sum(-(keep * r) * adv[:, None])) / n, -(keep * r) * adv[:, None] / n


def ref_vespo(lp, lm, m, adv, k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0):
    """arXiv:2602.10693 / the reference code: −φ(W)·Â·log π_t, φ(W) = W^k e^{λ(1−W)}."""
    n = m.sum()
    log_w = np.clip((np.clip(lp - lm, -20, 20) * m).sum(1), -20, 20)
    w = np.exp(log_w)
    k = np.where(adv >= 0, k_pos, k_neg)
    lam = np.where(adv >= 0, lambda_pos, lambda_neg)
    phi = w**k * np.exp(lam * (1 - w))
    loss = float(np.sum(-phi[:, None] * adv[:, None] * lp * m)) / n
    return loss, -phi[:, None] * adv[:, None] * m / n


REFS = {"cispo": ref_cispo, "gspo": ref_gspo, "icepop": ref_icepop, "m2po": ref_m2po,
        "vespo": ref_vespo}


# ------------------------------------------------------------------------- random inputs


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name,kw", [
    ("cispo", {}), ("cispo", {"eps_low": 0.2, "eps_high": 0.1}),
    ("gspo", {}), ("gspo", {"eps_low": 0.05, "eps_high": 0.05}),
    ("icepop", {}), ("icepop", {"alpha": 0.8, "beta": 1.3}),
    ("icepop", {"level": "sequence", "alpha": 0.3, "beta": 3.0}),
    ("m2po", {}), ("m2po", {"tau": 0.1}), ("m2po", {"mask_tokens": "all_tokens"}),
    ("m2po", {"mask_tokens": "all_tokens", "tau": 0.1}),
    ("vespo", {}), ("vespo", {"k_pos": 1.0, "lambda_pos": 0.5, "k_neg": 5.0, "lambda_neg": 4.0}),
])
def test_value_and_gradient_match_the_equation(name, kw, seed):
    lp, lm, m, rewards = batch(seed)
    lp, lm = lp.astype(np.float32).astype(np.float64), lm.astype(np.float32).astype(np.float64)
    want, want_grad = REFS[name](lp, lm, m, group_adv(rewards.astype(np.float32), GROUPS), **kw)
    _, got, grad = run(name, lp, lm, m, rewards, **kw)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=2e-4, atol=1e-6)
    assert np.all(grad[m == 0] == 0)


@pytest.mark.parametrize("name", NAMES)
def test_masked_tokens_and_padding_rows_are_ignored(name):
    """Garbage (NaN, huge) under the mask or in padding rows changes neither value nor grad."""
    lp, lm, m, rewards = batch(3)
    out, base, g = run(name, lp, lm, m, rewards)
    lp2, lm2 = lp.copy(), lm.copy()
    lp2[m == 0], lm2[m == 0] = np.nan, 1e4
    _, val2, g2 = run(name, lp2, lm2, m, rewards)
    np.testing.assert_allclose(val2, base, rtol=1e-6)
    np.testing.assert_allclose(g2, g, rtol=1e-6, atol=1e-9)
    # a padding row (record_mask 0) with NaN log-probs adds nothing
    pad_lp, pad_lm = np.vstack([lp, np.full((1, lp.shape[1]), np.nan)]), np.vstack([lm, lm[:1]])
    pad_m, pad_r = np.vstack([m, np.ones((1, m.shape[1]))]), np.append(rewards, 5.0)
    out3, val3, g3 = run(name, pad_lp, pad_lm, pad_m, pad_r, groups=np.append(GROUPS, 3),
                         record_mask=np.append(np.ones(8), 0.0))
    np.testing.assert_allclose(val3, base, rtol=1e-5)
    np.testing.assert_allclose(g3[:-1], g, rtol=1e-5, atol=1e-9)
    assert float(out3.weight) == float(out.weight)


@pytest.mark.parametrize("name", NAMES)
def test_all_tokens_masked_gives_zero_and_finite(name):
    lp, lm, _, rewards = batch(4)
    out, val, g = run(name, lp, lm, np.zeros_like(lp), rewards)
    assert val == 0.0 and np.all(g == 0)
    assert all(np.isfinite(float(v)) for v in out.metrics.values())


@pytest.mark.parametrize("name", NAMES)
def test_extreme_log_ratios_stay_finite(name):
    lp, lm, m, rewards = batch(5)
    lp = lm + np.where(np.arange(lp.shape[1]) % 2, 1e4, -1e4)
    out, val, g = run(name, lp, lm, m, rewards)
    assert np.isfinite(val) and np.all(np.isfinite(g))
    assert all(np.isfinite(float(v)) for v in out.metrics.values())


@pytest.mark.parametrize("name", NAMES)
def test_given_advantages_replace_the_group_statistics(name):
    """The trainer passes full-batch advantages (micro-batches may cut groups)."""
    lp, lm, m, rewards = batch(6)
    adv = np.linspace(-1.0, 1.0, 8)
    want, want_grad = REFS[name](lp.astype(np.float32).astype(np.float64),
                                 lm.astype(np.float32).astype(np.float64), m, adv)
    _, got, grad = run(name, lp, lm, m, rewards, advantages=adv.astype(np.float32))
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=2e-4, atol=1e-6)


# --------------------------------------------------------------------------- edge cases


def one_record(log_ratios, adv=1.0, logmu=-1.0):
    """A batch of two records (one group) whose first record has the given token log-ratios
    and advantage sign(adv), the second the opposite (rewards 1, 0 → Â = ±0.5/(0.5 + 1e-6))."""
    t = len(log_ratios)
    lm = np.full((2, t), logmu)
    lp = lm + np.array([log_ratios, np.zeros(t)])
    rewards = np.array([1.0, 0.0]) if adv > 0 else np.array([0.0, 1.0])
    return lp, lm, np.ones((2, t)), rewards, np.array([0, 0])


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    """Unlike PPO, a token whose ratio is above 1 + ε_high still gets −(1+ε_high)·Â/N."""
    lp, lm, m, rewards, g = one_record([np.log(3.0), 0.0])
    out, _, grad = run("cispo", lp, lm, m, rewards, groups=g, eps_high=0.28)
    adv = 0.5 / (0.5 + 1e-6)
    np.testing.assert_allclose(grad[0], [-1.28 * adv / 4, -adv / 4], rtol=1e-5)
    np.testing.assert_allclose(float(out.metrics["clip_frac_high"]), 0.25)
    # no lower bound by default; with ε_low = 0.5 a ratio of 0.1 is raised to 0.5
    lp, lm, m, rewards, g = one_record([np.log(0.1), 0.0])
    _, _, grad = run("cispo", lp, lm, m, rewards, groups=g)
    np.testing.assert_allclose(grad[0, 0], -0.1 * adv / 4, rtol=1e-4)
    _, _, grad = run("cispo", lp, lm, m, rewards, groups=g, eps_low=0.5)
    np.testing.assert_allclose(grad[0, 0], -0.5 * adv / 4, rtol=1e-5)


def test_cispo_ratio_exactly_on_the_bound_is_the_bound():
    lp, lm, m, rewards, g = one_record([0.0, 0.0])  # r = 1 exactly
    _, val, grad = run("cispo", lp, lm, m, rewards, groups=g, eps_high=0.0)
    adv = 0.5 / (0.5 + 1e-6)
    np.testing.assert_allclose(grad[0], [-adv / 4, -adv / 4], rtol=1e-6)
    np.testing.assert_allclose(val, -(adv * -1.0 * 2 - adv * -1.0 * 2) / 4, atol=1e-6)


@pytest.mark.parametrize("adv,clipped", [(1.0, True), (-1.0, False)])
def test_gspo_clip_zeroes_the_gradient_only_on_the_trust_region_side(adv, clipped):
    """s = exp(mean log r) = e^0.01 > 1 + 4e-4: clipped (no gradient) for Â > 0, not for Â < 0."""
    lp, lm, m, rewards, g = one_record([0.02, 0.0], adv=adv)
    out, _, grad = run("gspo", lp, lm, m, rewards, groups=g)
    s = np.exp(0.01)
    a = np.sign(adv) * 0.5 / (0.5 + 1e-6)
    want = np.zeros(2) if clipped else np.full(2, -a * s / 2 / 2)
    np.testing.assert_allclose(grad[0], want, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(float(out.metrics["clip_frac"]), 0.5 if clipped else 0.0)


@pytest.mark.parametrize("alpha,beta,kept", [(1.0, 2.0, True), (0.5, 1.0, True),
                                              (0.5, 0.999, False), (1.001, 2.0, False)])
def test_icepop_ratio_on_a_bound_is_kept(alpha, beta, kept):
    lp, lm, m, rewards, g = one_record([0.0, 0.0])  # k = 1 exactly
    out, _, grad = run("icepop", lp, lm, m, rewards, groups=g, alpha=alpha, beta=beta)
    adv = 0.5 / (0.5 + 1e-6)
    np.testing.assert_allclose(grad[0], [-adv / 4] * 2 if kept else [0.0, 0.0], rtol=1e-6)
    assert float(out.metrics["masked_frac"]) == (0.0 if kept else 1.0)


def test_icepop_sequence_level_masks_by_the_product():
    """Each token ratio (2.5) is inside [0.5, 5] but their product 6.25 is not: the token
    variant keeps both tokens, the sequence variant drops the whole record."""
    lp, lm, m, rewards, g = one_record([np.log(2.5), np.log(2.5)])
    adv = 0.5 / (0.5 + 1e-6)
    _, _, tok = run("icepop", lp, lm, m, rewards, groups=g)
    _, _, seq = run("icepop", lp, lm, m, rewards, groups=g, level="sequence")
    np.testing.assert_allclose(tok[0], [-2.5 * adv / 4] * 2, rtol=1e-5)
    np.testing.assert_allclose(seq[0], [0.0, 0.0])
    np.testing.assert_allclose(seq[1], tok[1])  # record 2: ratio 1 either way


def test_m2po_mask_known_answer():
    """(log r)² = 0.01, 0.04, 0.25, 1: mean 0.325 > 0.04 → drop 1 (mean 0.1) → drop 0.25
    (mean 0.025 ≤ 0.04): the tokens with log r = 0.1, 0.2 remain."""
    log_r = np.array([[0.5, 0.1], [1.0, 0.2]], np.float32)
    keep = stale_is.m2po_keep_mask(log_r, np.ones((2, 2), bool), 0.04)
    np.testing.assert_array_equal(np.asarray(keep), [[False, True], [False, True]])
    # invalid tokens neither count nor are kept, however large
    valid = np.array([[True, True], [False, True]])
    keep = stale_is.m2po_keep_mask(log_r, valid, 0.04)  # 0.25, 0.01, 0.04: drop 0.25 → 0.025
    np.testing.assert_array_equal(np.asarray(keep), [[False, True], [False, True]])


def test_m2po_mean_equal_to_tau_stops_the_loop():
    """The paper's loop runs while M2 > τ: a mean exactly τ keeps every token."""
    log_r = np.array([[0.5, -0.5]], np.float32)  # (log r)² = 0.25 exactly
    keep = stale_is.m2po_keep_mask(log_r, np.ones((1, 2), bool), 0.25)
    assert np.asarray(keep).all()
    keep = stale_is.m2po_keep_mask(log_r, np.ones((1, 2), bool), 0.2499)
    assert not np.asarray(keep).any()  # every suffix mean is 0.25 > τ: all dropped


@pytest.mark.parametrize("seed", range(6))
def test_m2po_mask_matches_the_brute_force_loop(seed):
    rng = np.random.default_rng(seed)
    log_r = rng.normal(0, 0.3, (5, 6)).astype(np.float32)
    valid = rng.random((5, 6)) > 0.3
    tau = float(rng.choice([0.005, 0.02, 0.04, 0.2]))
    want = brute_m2_keep(log_r.astype(np.float64), valid, tau)
    np.testing.assert_array_equal(np.asarray(stale_is.m2po_keep_mask(log_r, valid, tau)), want)


def test_m2po_all_tokens_dropped_gives_zero_loss():
    """AReaL's all-token mask: (log r)² = 1 everywhere, every suffix mean 1 > τ: all dropped
    (the paper's trust-region mask: tests/losses/test_stale_is_paper_options.py)."""
    lp, lm, m, rewards, g = one_record([1.0, -1.0])
    lp[1] = lm[1] + 1.0
    out, val, grad = run("m2po", lp, lm, m, rewards, groups=g, mask_tokens="all_tokens")
    assert val == 0.0 and np.all(grad == 0) and float(out.metrics["masked_frac"]) == 1.0
    assert float(out.weight) == 4.0  # the dropped tokens still count in 1/Σ|o_i|


def test_vespo_weight_is_one_on_policy_and_vanishes_far_off():
    """φ(1) = 1: at π = μ VESPO is −Â·log π averaged over tokens; at W = e^20, φ = 0."""
    lp, lm, m, rewards, g = one_record([0.0, 0.0])
    out, val, grad = run("vespo", lp, lm, m, rewards, groups=g)
    adv = 0.5 / (0.5 + 1e-6)
    np.testing.assert_allclose(val, (-adv * -2.0 + adv * -2.0) / 4, atol=1e-6)
    np.testing.assert_allclose(grad, [[-adv / 4] * 2, [adv / 4] * 2], rtol=1e-6)
    lp, lm, m, rewards, g = one_record([30.0, 0.0])
    _, _, grad = run("vespo", lp, lm, m, rewards, groups=g)
    assert np.all(grad[0] == 0) and np.all(np.isfinite(grad))


@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_vespo_shapes_follow_the_advantage_sign(adv):
    lp, lm, m, rewards, g = one_record([np.log(2.0), 0.0], adv=adv)
    kw = {"k_pos": 1.0, "lambda_pos": 1.0, "k_neg": 2.0, "lambda_neg": 3.0}
    _, _, grad = run("vespo", lp, lm, m, rewards, groups=g, **kw)
    k, lam = (1.0, 1.0) if adv > 0 else (2.0, 3.0)
    phi = 2.0**k * np.exp(lam * (1 - 2.0))
    a = np.sign(adv) * 0.5 / (0.5 + 1e-6)
    np.testing.assert_allclose(grad[0], [-phi * a / 4] * 2, rtol=1e-5)


# ----------------------------------------------------------------------------- arguments


def test_kernel_arguments_are_checked():
    lp, lm, m, rewards = batch(7)
    with pytest.raises(ValueError, match="alpha must be < beta"):
        run("icepop", lp, lm, m, rewards, alpha=2.0, beta=2.0)
    with pytest.raises(ValueError, match="level must be one of"):
        run("icepop", lp, lm, m, rewards, level="geometric")
    with pytest.raises(ValueError, match="tau must be > 0"):
        run("m2po", lp, lm, m, rewards, tau=0.0)
    with pytest.raises(ValueError, match="mask_tokens must be one of"):
        run("m2po", lp, lm, m, rewards, mask_tokens="paper")
    with pytest.raises(ValueError, match="aggregation must be one of"):
        run("icepop", lp, lm, m, rewards, aggregation="seq-mean-token-sum")
    with pytest.raises(ValueError, match="clip_eps_high must satisfy"):
        run("gspo", lp, lm, m, rewards, eps_high=-1e-4)
    with pytest.raises(ValueError, match="group_ids must have shape"):
        run("cispo", lp, lm, m, rewards, groups=np.zeros(3, int))


@pytest.mark.parametrize("overrides,key", [
    (["loss.name=icepop", "loss.icepop_alpha=2", "loss.icepop_beta=1"], "loss.icepop_alpha"),
    (["loss.name=icepop", "loss.icepop_alpha=-0.1"], "loss.icepop_alpha"),
    (["loss.name=cispo", "loss.cispo_eps_high=-0.1"], "loss.cispo_eps_high"),
    (["loss.name=gspo", "loss.gspo_eps_low=1.5"], "loss.gspo_eps_low"),
    (["loss.name=m2po", "loss.m2po_tau=0"], "loss.m2po_tau"),
    (["loss.name=m2po", "loss.m2po_mask=paper"], "loss.m2po_mask"),
    (["loss.name=icepop", "loss.icepop_aggregation=seq-mean-token-sum"],
     "loss.icepop_aggregation"),
    (["loss.name=icepop", "loss.m2po_mask=all_tokens"], "loss.m2po_mask"),
    (["loss.name=m2po", "loss.icepop_aggregation=seq-mean-token-mean"],
     "loss.icepop_aggregation"),
    (["loss.name=vespo", "loss.vespo_lambda_neg=0"], "loss.vespo_lambda_neg"),
    (["loss.name=grpo", "loss.m2po_tau=0.1"], "loss.m2po_tau"),
    (["loss.name=cispo", "loss.gspo_eps_low=0.1"], "loss.gspo_eps_low"),
    (["loss.name=cispo", "loss.clip_eps_high=0.3"], "loss.clip_eps_high"),
])
def test_bad_config_values_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert key in str(err.value) or f"'{key}'" in str(err.value), str(err.value)


def test_config_defaults_reach_the_kernels():
    """Each default stated in the config is the kernel's (one source of the papers' values)."""
    import inspect

    lc = load_config(None, ["loss.name=cispo"]).loss
    pairs = {"cispo": {"eps_low": lc.cispo_eps_low, "eps_high": lc.cispo_eps_high},
             "gspo": {"eps_low": lc.gspo_eps_low, "eps_high": lc.gspo_eps_high},
             "icepop": {"alpha": lc.icepop_alpha, "beta": lc.icepop_beta,
                        "level": lc.icepop_level, "aggregation": lc.icepop_aggregation},
             "m2po": {"tau": lc.m2po_tau, "mask_tokens": lc.m2po_mask},
             "vespo": {"k_pos": lc.vespo_k_pos, "lambda_pos": lc.vespo_lambda_pos,
                       "k_neg": lc.vespo_k_neg, "lambda_neg": lc.vespo_lambda_neg}}
    assert pairs["gspo"] == {"eps_low": 3e-4, "eps_high": 4e-4}  # arXiv:2507.18071
    # arXiv:2510.18855's α, β; token-mean kept for existing runs (docs/kernels.md § IcePop)
    assert pairs["icepop"] == {"alpha": 0.5, "beta": 5.0, "level": "token",
                               "aggregation": "token-mean"}
    assert pairs["m2po"] == {"tau": 0.04, "mask_tokens": "trust_region"}  # arXiv:2510.01161
    assert pairs["vespo"] == {"k_pos": 2.0, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.0}
    for name, options in pairs.items():
        sig = inspect.signature(LOSS_SPECS[name].kernel)
        assert {k: sig.parameters[k].default for k in options} == options, name
