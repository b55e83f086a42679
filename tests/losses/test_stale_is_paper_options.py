"""M2PO's mask and IcePop's aggregation as their papers define them, beside the variants kept
as named options (losses/stale_is.py; docs/kernels.md § Stale-sample losses):

- M2PO (arXiv:2510.01161 Algorithm 1): the second moment and the drop loop cover only the
  trust-region tokens, (Â > 0 and r > 1) or (Â < 0 and r < 1), r = π/μ at the step; every
  other token is kept (`mask_tokens="trust_region"`, `loss.m2po_mask`). AReaL's variant
  covers every token (`"all_tokens"`).
- IcePop (arXiv:2510.18855): GRPO's 1/G Σ_i 1/|o_i| Σ_t (`aggregation="seq-mean-token-mean"`,
  `loss.icepop_aggregation`) beside the token mean (default).

Masks are worked out by hand in the comments; values and gradients are compared with the
papers' procedures transcribed here as plain float64 loops (never the kernels' output).
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl_llm.losses import stale_is
from jaxrl_llm.train.loss_fn import compute_loss
from tests.losses.test_peer_options import GROUPS as PEER_GROUPS
from tests.losses.test_peer_options import _config, _model_batch, group_advantages
from tests.losses.test_stale_is import run

F, T_ = False, True


def paper_mask(log_r, adv, valid, tau, tokens="trust_region"):
    """The keep mask of `stale_is.m2po_mask`."""
    return np.asarray(stale_is.m2po_mask(np.asarray(log_r, np.float32),
                                         np.asarray(adv, np.float32), np.asarray(valid), tau,
                                         tokens))


# ------------------------------------------------------------------ masks worked by hand


def test_m2po_trust_region_mask_by_hand():
    """Â = (+1, −1); the last column is invalid (|log r| = 3 on the trust side, never read).

    Trust region: row 0 (Â > 0) keeps log r > 0: 0.5, 0.1 (not −0.5, not 0.0: r = 1); row 1
    (Â < 0) keeps log r < 0: −0.3, −0.05, −1.0. (log r)² = .25, .01, .09, .0025, 1: mean .2705
    > .04 → drop 1 → .3525/4 = .0881 > .04 → drop .25 → .1025/3 = .0342 ≤ .04: stop. The
    dropped are 0.5 (row 0) and −1.0 (row 1); −0.5, 0.0 and 0.3 are outside and kept.

    All tokens (AReaL): (log r)² of the 8 valid = .25 .25 .01 0 | .09 .09 .0025 1, mean .2116
    → drop 1 → .0989 → drop .25 (row 0, first) → .0738 → drop .25 (row 0, second) →
    .1925/5 = .0385 ≤ .04: −0.5 with Â > 0 is dropped too.
    """
    log_r = [[0.5, -0.5, 0.1, 0.0, 3.0], [0.3, -0.3, -0.05, -1.0, -3.0]]
    valid = np.array([[T_] * 4 + [F], [T_] * 4 + [F]])
    adv = [1.0, -1.0]
    np.testing.assert_array_equal(paper_mask(log_r, adv, valid, 0.04),
                                  [[F, T_, T_, T_, F], [T_, T_, T_, F, F]])
    np.testing.assert_array_equal(paper_mask(log_r, adv, valid, 0.04, "all_tokens"),
                                  [[F, F, T_, T_, F], [T_, T_, T_, F, F]])
    np.testing.assert_array_equal(
        np.asarray(stale_is.m2po_trust_region(np.asarray(log_r), np.asarray(adv), valid)),
        [[T_, F, T_, F, F], [F, T_, T_, T_, F]])


def test_m2po_loss_uses_the_hand_mask():
    """The same batch through `m2po_loss` (given Â, log μ = −1): value −Σ M·r·Â / 8 and
    gradient −M·r·Â / 8 with the hand mask above; the invalid column adds nothing."""
    log_r = np.array([[0.5, -0.5, 0.1, 0.0, 3.0], [0.3, -0.3, -0.05, -1.0, -3.0]])
    mask = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 0]], np.float64)
    adv = np.array([1.0, -1.0])
    lm = np.full((2, 5), -1.0)
    lp = (lm + log_r).astype(np.float32).astype(np.float64)
    r = np.exp(lp - lm)
    for tokens, keep in [("trust_region", [[0, 1, 1, 1, 0], [1, 1, 1, 0, 0]]),
                         ("all_tokens", [[0, 0, 1, 1, 0], [1, 1, 1, 0, 0]])]:
        out, val, grad = run("m2po", lp, lm, mask, np.zeros(2), groups=np.array([0, 0]),
                             advantages=adv.astype(np.float32), mask_tokens=tokens)
        want_grad = -np.array(keep) * r * adv[:, None] / 8
        np.testing.assert_allclose(val, want_grad.sum(), rtol=1e-5)
        np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-9)
        assert float(out.weight) == 8.0
        np.testing.assert_allclose(float(out.metrics["masked_frac"]), 2 / 8 if tokens ==
                                   "trust_region" else 3 / 8)
        np.testing.assert_allclose(float(out.metrics["region_frac"]), 5 / 8 if tokens ==
                                   "trust_region" else 1.0)


def test_m2po_ties_break_by_position_and_a_mean_equal_to_tau_stops():
    """log r = 0.5 (Â > 0) and −0.5 (Â < 0) are both in the trust region with (log r)² = .25;
    0.25 in row 0 too (.0625), 0.25 in row 1 is not (Â < 0, r > 1). Mean (.25 + .0625 + .25)/3
    = .1875 > τ = .15625 → drop the first .25 (row 0) → .3125/2 = .15625 = τ: the loop (while
    M₂ > τ) stops. All tokens: mean (.25+.0625)·2/4 = .15625 = τ at once: nothing dropped.
    (Binary-exact numbers, so float32 meets τ exactly.)"""
    log_r, adv, valid = [[0.5, 0.25], [-0.5, 0.25]], [1.0, -1.0], np.ones((2, 2), bool)
    np.testing.assert_array_equal(paper_mask(log_r, adv, valid, 0.15625), [[F, T_], [T_, T_]])
    np.testing.assert_array_equal(paper_mask(log_r, adv, valid, 0.15625, "all_tokens"),
                                  np.ones((2, 2), bool))


def test_m2po_zero_advantage_is_outside_the_trust_region():
    """Row 0 has Â = 0 and |log r| = 2: outside the trust region, kept, and not in the mean, so
    row 1's 0.25 (Â > 0, .0625 > .04) is dropped alone. All tokens: 4, 4, .0625, .0625 — every
    suffix mean (.0625 the smallest) > .04, so all four are dropped."""
    log_r, adv, valid = [[2.0, -2.0], [0.25, -0.25]], [0.0, 1.0], np.ones((2, 2), bool)
    np.testing.assert_array_equal(paper_mask(log_r, adv, valid, 0.04), [[T_, T_], [F, T_]])
    np.testing.assert_array_equal(paper_mask(log_r, adv, valid, 0.04, "all_tokens"),
                                  np.zeros((2, 2), bool))


def test_m2po_ratio_exactly_one_is_not_in_the_mean():
    """r = 1 (log r = 0) is outside the trust region: the mean is over the one trust-region
    token, .0625 > .04, so it is dropped; over all tokens the mean is .0625/3 ≤ .04."""
    log_r, adv, valid = [[0.25, 0.0, 0.0]], [1.0], np.ones((1, 3), bool)
    np.testing.assert_array_equal(paper_mask(log_r, adv, valid, 0.04), [[F, T_, T_]])
    np.testing.assert_array_equal(paper_mask(log_r, adv, valid, 0.04, "all_tokens"),
                                  [[T_, T_, T_]])


def test_m2po_every_trust_region_token_dropped():
    """All four tokens in the trust region with (log r)² = 1 > τ: all dropped, loss 0 and no
    gradient, the dropped tokens still in 1/Σ|o_i|. With row 0's second token at r = e⁻¹
    instead (Â > 0: outside), only the trust-region tokens go: value −Σ M r Â / 4 by hand."""
    lm = np.full((2, 2), -1.0)
    adv = np.array([1.0, -1.0], np.float32)
    lp = lm + np.array([[1.0, 1.0], [-1.0, -1.0]])
    out, val, grad = run("m2po", lp, lm, np.ones((2, 2)), np.zeros(2), groups=np.array([0, 0]),
                         advantages=adv)
    assert val == 0.0 and np.all(grad == 0) and float(out.weight) == 4.0
    assert float(out.metrics["masked_frac"]) == 1.0 and float(out.metrics["region_frac"]) == 1.0
    lp = lm + np.array([[1.0, -1.0], [1.0, 1.0]])  # only row 0's first token is trust-region
    out, val, grad = run("m2po", lp, lm, np.ones((2, 2)), np.zeros(2), groups=np.array([0, 0]),
                         advantages=adv)
    e = np.e
    np.testing.assert_allclose(val, -(1 / e - e - e) / 4, rtol=1e-5)
    np.testing.assert_allclose(grad, [[0.0, -1 / e / 4], [e / 4, e / 4]], rtol=1e-5)
    np.testing.assert_allclose(float(out.metrics["masked_frac"]), 0.25)


# ------------------------------------------------- Algorithm 1 as a loop, random batches


def algorithm1(lp, lm, m, adv, tau, tokens="trust_region"):
    """arXiv:2510.01161 Algorithm 1 with θ_old = θ: collect the trust-region tokens,
    (Â > 0 and r > 1) or (Â < 0 and r < 1) (`tokens="all_tokens"`: every token, AReaL's);
    while their mean (log r)² > τ, remove the largest (the first of equal ones). Loss
    −1/Σ|o_i| Σ M r Â, M = 0 on the removed; gradient w.r.t. log π: −M r Â / Σ|o_i|."""
    r = np.exp(lp - lm)
    covered = [(i, t) for i in range(lp.shape[0]) for t in range(lp.shape[1])
               if m[i, t] > 0 and (tokens == "all_tokens" or (adv[i] > 0 and r[i, t] > 1)
                                   or (adv[i] < 0 and r[i, t] < 1))]
    kept = list(covered)
    while kept:
        sq = [np.log(r[p]) ** 2 for p in kept]
        if sum(sq) / len(kept) <= tau:
            break
        kept.pop(int(np.argmax(sq)))
    keep = (m > 0).astype(np.float64)
    for p in covered:
        keep[p] = float(p in kept)
    n = m.sum()
    coef = np.where(m > 0, keep * r * adv[:, None], 0.0)
    return float(-coef.sum() / n), -coef / n


def random_batch(seed, b=8, t=9):
    rng = np.random.default_rng(seed)
    lm = rng.uniform(-3.0, -0.05, (b, t))
    lp = lm + rng.normal(0.0, 0.35, (b, t))
    m = (rng.random((b, t)) > 0.2).astype(np.float64)
    m[:, 0] = 1.0
    adv = rng.normal(0.0, 1.0, b)
    adv[2] = 0.0  # a record with Â = 0
    f32 = lambda x: x.astype(np.float32).astype(np.float64)
    return f32(lp), f32(lm), m, f32(adv)


@pytest.mark.parametrize("tokens", ["trust_region", "all_tokens"])
@pytest.mark.parametrize("seed,tau", [(0, 0.04), (1, 0.04), (2, 0.01), (3, 0.1), (4, 0.04)])
def test_m2po_matches_algorithm_1_loop(seed, tau, tokens):
    lp, lm, m, adv = random_batch(seed)
    want, want_grad = algorithm1(lp, lm, m, adv, tau, tokens)
    out, got, grad = run("m2po", lp, lm, m, np.zeros(len(lp)), groups=np.arange(len(lp)),
                         advantages=adv.astype(np.float32), tau=tau, mask_tokens=tokens)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(grad, want_grad, rtol=2e-5, atol=1e-8)
    assert 0 < float(out.metrics["masked_frac"]) < 1  # the loop dropped some, not all


def test_m2po_group_advantages_and_a_padding_row():
    """Â from the rewards (a group of equal rewards gives Â = 0); a padding row (record_mask
    0) of trust-side garbage neither counts in the moment nor is kept."""
    lp, lm, m, _ = random_batch(5)
    groups = np.array([0, 0, 1, 1, 2, 2, 3, 3])
    rewards = np.array([1.0, 0.0, 0.5, 0.5, 0.0, 1.0, 2.0, -1.0])
    adv = np.zeros(8)
    for g in range(4):
        sel = groups == g
        adv[sel] = (rewards[sel] - rewards[sel].mean()) / (rewards[sel].std() + 1e-6)
    for tokens in ("trust_region", "all_tokens"):
        want, want_grad = algorithm1(lp, lm, m, adv.astype(np.float32), 0.04, tokens)
        pad = lambda x, v: np.vstack([x, np.full((1, x.shape[1]), v)])
        _, got, grad = run("m2po", pad(lp, 5.0), pad(lm, -5.0), pad(m, 1.0),
                           np.append(rewards, 3.0), groups=np.append(groups, 4),
                           record_mask=np.append(np.ones(8), 0.0), mask_tokens=tokens)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
        np.testing.assert_allclose(grad[:-1], want_grad, rtol=2e-5, atol=1e-8)
        assert np.all(grad[-1] == 0)


# ---------------------------------------------------------------- IcePop's aggregation


def test_icepop_seq_mean_token_mean_by_hand():
    """Record 0 (Â = a): one token, k = 2; record 1 (Â = −a): k = 1, 0.25 (< α: masked), 1.5.
    Per token −M·k·Â: −2a | a, 0, 1.5a. Token mean: (−2a + a + 1.5a)/4 = a/8. The paper's
    1/G Σ_i 1/|o_i| Σ_t: (−2a/1 + 2.5a/3)/2 = −7a/12; its gradient −M·k·Â/(|o_i|·G):
    −a | a/6, 0, a/4."""
    lm = np.full((2, 3), -1.0)
    lp = lm + np.log([[2.0, 1.0, 1.0], [1.0, 0.25, 1.5]])
    mask = np.array([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    a = 0.5 / (0.5 + 1e-6)  # rewards 1, 0 in one group
    g = np.array([0, 0])
    out, val, grad = run("icepop", lp, lm, mask, np.array([1.0, 0.0]), groups=g)
    np.testing.assert_allclose(val, a / 8, rtol=1e-5)
    assert float(out.weight) == 4.0
    out, val, grad = run("icepop", lp, lm, mask, np.array([1.0, 0.0]), groups=g,
                         aggregation="seq-mean-token-mean")
    np.testing.assert_allclose(val, -7 * a / 12, rtol=1e-5)
    np.testing.assert_allclose(grad, [[-a, 0, 0], [a / 6, 0, a / 4]], rtol=1e-5, atol=1e-9)
    assert float(out.weight) == 2.0


def icepop_paper(lp, lm, m, adv, rm, alpha=0.5, beta=5.0, level="token"):
    """arXiv:2510.18855 with θ_old = θ: −1/G Σ_i 1/|o_i| Σ_t M(k_it)·k_it·Â_i over the real
    records (G = their number), M = 1[α ≤ k ≤ β]; gradient w.r.t. log π_it: the summand."""
    value, grad = 0.0, np.zeros_like(lp)
    g = rm.sum()
    for i in range(len(lp)):
        if not rm[i]:
            continue
        toks = [t for t in range(lp.shape[1]) if m[i, t]]
        seq_k = np.exp(sum(lp[i, t] - lm[i, t] for t in toks))
        for t in toks:
            k = seq_k if level == "sequence" else np.exp(lp[i, t] - lm[i, t])
            term = -float(alpha <= k <= beta) * k * adv[i] / len(toks) / g
            value += term
            grad[i, t] = term
    return value, grad


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kw", [{}, {"alpha": 0.8, "beta": 1.3},
                                {"level": "sequence", "alpha": 0.3, "beta": 3.0}])
def test_icepop_seq_mean_token_mean_matches_the_paper(seed, kw):
    lp, lm, m, adv = random_batch(seed)
    rm = np.ones(len(lp))
    rm[3] = 0.0  # a padding row: not one of the G records
    want, want_grad = icepop_paper(lp, lm, m, adv * rm, rm, **kw)
    _, got, grad = run("icepop", lp, lm, m, np.zeros(len(lp)), groups=np.arange(len(lp)),
                       advantages=adv.astype(np.float32), record_mask=rm,
                       aggregation="seq-mean-token-mean", **kw)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(grad, want_grad, rtol=2e-5, atol=1e-8)


# ------------------------------------------------------- through the config (public path)


def test_config_options_reach_the_kernels():
    """`loss.m2po_mask` and `loss.icepop_aggregation` through `compute_loss` (log-probs from a
    tiny model, group advantages, a padding row) against the loops above."""
    batch, hidden, unembed, logp, logmu, mask, rewards, rm = _model_batch(3)
    lm = np.where(mask > 0, logmu, 0.0).astype(np.float64)
    m = mask * rm[:, None]
    adv = group_advantages(rewards, PEER_GROUPS, rm, 0)
    values = {}
    for tokens in ("trust_region", "all_tokens"):
        out = compute_loss(_config("m2po", m2po_mask=tokens), batch, hidden, unembed)
        values[tokens] = float(out.loss)
        np.testing.assert_allclose(values[tokens], algorithm1(logp, lm, m, adv, 0.04, tokens)[0],
                                   rtol=1e-4, atol=1e-6)
    assert values["trust_region"] != values["all_tokens"]
    out = compute_loss(_config("icepop", icepop_aggregation="seq-mean-token-mean", icepop_alpha=0.8,
                               icepop_beta=1.2), batch, hidden, unembed)
    want, _ = icepop_paper(logp, lm, m, adv, rm, alpha=0.8, beta=1.2)
    np.testing.assert_allclose(float(out.loss), want, rtol=1e-4, atol=1e-6)
