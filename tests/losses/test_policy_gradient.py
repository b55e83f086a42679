"""Policy-gradient kernels against independently derived values (SPEC §2–3; 000; 002)."""

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_llm.losses import policy_gradient as pg
from jaxrl_llm.losses.advantages import effective_positive_fraction
from jaxrl_llm.losses.registry import LOSS_SPECS, check_loss_inputs

PRESETS = list(pg.TOPR_PRESETS)
B, T = 6, 7


def _random_batch(seed: int, b: int = B, t: int = T, spread: float = 0.4):
    """Per-token log-probs whose sequence log-ratios straddle 1 (both sides of every bound)."""
    rng = np.random.default_rng(seed)
    logmu = -rng.uniform(0.1, 3.0, (b, t)).astype(np.float32)
    logp = (logmu + rng.normal(0.0, spread, (b, t))).astype(np.float32)
    lengths = rng.integers(1, t + 1, b)
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    rewards = rng.choice([-1.0, 1.0], b) * rng.uniform(0.5, 2.0, b)
    return logp, logmu, mask, rewards.astype(np.float32)


def _np_seq(x, mask):
    return (np.asarray(x, np.float64) * mask).sum(-1)


@partial(jax.jit, static_argnames=("length_norm", "ratio_level"))
def _topr_value_and_grad(logp, logmu, mask, rewards, bounds, baseline=0.0, *, length_norm=True,
                         ratio_level="sequence"):
    """One compile per (length_norm, ratio_level): the bounds are traced (schedule-style)."""
    def loss(lp):
        return pg.topr_loss(lp, logmu, mask, rewards, a_pos=bounds[0], b_pos=bounds[1],
                            a_neg=bounds[2], b_neg=bounds[3], baseline=baseline,
                            length_norm=length_norm, ratio_level=ratio_level).loss

    return jax.value_and_grad(loss)(logp)


def _bounds(preset):
    p = pg.topr_preset(preset)
    return jnp.array([p["a_pos"], p["b_pos"], p["a_neg"], p["b_neg"]], jnp.float32)


# ----------------------------------------------------------------------------- TOPR gradients


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("length_norm", [True, False])
@pytest.mark.parametrize("ratio_level", ["sequence", "token"])
def test_taper_gradient_equals_stop_gradient_form(preset, length_norm, ratio_level):
    """∇ of the taper form == ∇ of −sg(α)·A·log π/N, α = [π/μ]_a^b (SPEC §2, 000 eq. 7)."""
    logp, logmu, mask, rewards = _random_batch(hash((preset, length_norm, ratio_level)) % 1000)
    baseline = 0.3
    bounds = pg.topr_preset(preset)
    _, grad = _topr_value_and_grad(logp, logmu, mask, rewards, _bounds(preset), baseline,
                                   length_norm=length_norm, ratio_level=ratio_level)

    # stop-gradient form, differentiated by hand: ∂/∂logπ_t [−α A Σ_t m logπ_t / N] / B
    adv = rewards.astype(np.float64) - baseline
    pos = adv >= 0
    a = np.where(pos, bounds["a_pos"], bounds["a_neg"])[:, None]
    b = np.where(pos, bounds["b_pos"], bounds["b_neg"])[:, None]
    if ratio_level == "sequence":
        ratio = np.exp(_np_seq(logp, mask) - _np_seq(logmu, mask))[:, None]
    else:
        ratio = np.exp(logp.astype(np.float64) - logmu)
    alpha = np.minimum(np.maximum(ratio, a), b)
    n = mask.sum(-1, keepdims=True) if length_norm else np.ones((B, 1))
    expected = -alpha * adv[:, None] * mask / n / B
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=2e-5, atol=1e-7)


def _taper_np(x, a, b):
    """000 eq. 11's taper function, transcribed piecewise."""
    if x < a:
        return a * (1 + math.log(x / a))
    if x > b:
        return b * (1 + math.log(x / b))
    return x


@pytest.mark.parametrize("bounds", [(1.0, 1.0), (0.0, 1.0), (0.5, 2.0), (0.0, math.inf),
                                    (1.0, 1.2)])
def test_taper_value_is_eq11(bounds):
    a, b = bounds
    log_r = np.linspace(-3, 3, 13)
    logp = log_r[:, None] / 2 + np.full((13, 2), -1.0)  # two tokens per record
    logmu = np.full((13, 2), -1.0)
    mask = np.ones((13, 2), np.float32)
    rewards = np.where(np.arange(13) % 2 == 0, 1.0, -0.5).astype(np.float32)
    loss, _ = _topr_value_and_grad(jnp.asarray(logp, jnp.float32),
                                   jnp.asarray(logmu, jnp.float32), mask, rewards,
                                   jnp.array([a, b, a, b], jnp.float32), length_norm=False)
    per_record = [-rewards[i] * _taper_np(math.exp(log_r[i]), a, b) for i in range(13)]
    np.testing.assert_allclose(float(loss), np.mean(per_record), rtol=1e-5)


# Table 1 of 000: effective weight ∂L/∂logπ(y) / (−A/N) as a function of r = π/μ.
TABLE1 = {
    "sft": (lambda r: np.ones_like(r), lambda r: np.zeros_like(r)),
    "reinforce": (lambda r: np.ones_like(r), lambda r: np.ones_like(r)),
    "opr": (lambda r: r, lambda r: r),
    "tis": (lambda r: np.minimum(r, 1.0), lambda r: np.minimum(r, 1.0)),
    "topr": (lambda r: np.ones_like(r), lambda r: np.minimum(r, 1.0)),
}


@pytest.mark.parametrize("preset", PRESETS)
def test_table1_effective_weights(preset):
    log_r = np.linspace(-4.0, 4.0, 33)
    n_rec = 2 * log_r.size
    t = 3
    logmu = np.full((n_rec, t), -2.0, np.float32)
    logp = (logmu + np.tile(log_r, 2)[:, None] / t).astype(np.float32)
    mask = np.ones((n_rec, t), np.float32)
    adv = np.concatenate([np.full(log_r.size, 1.5), np.full(log_r.size, -0.5)]).astype(np.float32)
    # through the registry entry itself (concrete preset bounds), jitted once per preset
    grad = jax.jit(jax.grad(lambda lp: LOSS_SPECS[preset].kernel(
        logp=lp, logmu=logmu, mask=mask, rewards=adv).total))(jnp.asarray(logp))
    weight = np.asarray(grad)[:, 0] / (-adv / t)
    r = np.exp(log_r)
    pos_fn, neg_fn = TABLE1[preset]
    np.testing.assert_allclose(weight[: log_r.size], pos_fn(r), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(weight[log_r.size:], neg_fn(r), rtol=1e-4, atol=1e-6)


def test_topr_bounds_merges_config_overrides():
    assert pg.topr_bounds("tis", a_pos=None, b_pos=2.0) == {
        "a_pos": 0.0, "b_pos": 2.0, "a_neg": 0.0, "b_neg": 1.0}
    with pytest.raises(ValueError, match="c_pos"):
        pg.topr_bounds("topr", c_pos=1.0)


def test_bounds_as_traced_schedule_values():
    logp, logmu, mask, rewards = _random_batch(3)

    @jax.jit
    def with_tau(tau):
        return pg.topr_loss(logp, logmu, mask, rewards, a_pos=0.0, b_pos=tau, a_neg=0.0,
                            b_neg=tau).loss

    for tau in (1.0, 1.7, 4.0):  # 001 anneals w = min(τ, π/μ) down to τ = 1
        eager = pg.topr_loss(logp, logmu, mask, rewards, a_pos=0.0, b_pos=tau, a_neg=0.0,
                             b_neg=tau).loss
        np.testing.assert_allclose(with_tau(jnp.float32(tau)), eager, rtol=1e-6)


def test_topr_metrics_by_hand():
    # four one-token records: log-ratios (−1, 0.5, −2, 1.5), rewards ±1, baseline 0
    log_r = np.array([-1.0, 0.5, -2.0, 1.5])
    logmu = np.full((4, 1), -1.0, np.float32)
    logp = (logmu + log_r[:, None]).astype(np.float32)
    mask = np.ones((4, 1), np.float32)
    rewards = np.array([1.0, 1.0, -1.0, -1.0], np.float32)
    out = pg.topr_loss(logp, logmu, mask, rewards)  # canonical TOPR: a+=b+=1, a-=0, b-=1
    m = {k: float(v) for k, v in out.metrics.items()}
    assert m["num_pos"] == 2 and m["num_neg"] == 2
    assert m["clip_frac_pos_low"] == 0.5 and m["clip_frac_pos_high"] == 0.5
    assert m["clip_frac_neg_low"] == 0.0 and m["clip_frac_neg_high"] == 0.5
    np.testing.assert_allclose(m["log_ratio_mean"], 0.0 + (-1 + 0.5 - 2 + 1.5) / 4, atol=1e-6)
    np.testing.assert_allclose(m["log_ratio_max"], 1.5, rtol=1e-6)
    np.testing.assert_allclose(m["log_ratio_mean_pos"], -0.25, rtol=1e-6)
    np.testing.assert_allclose(m["log_ratio_mean_neg"], -0.25, rtol=1e-6)
    alpha = np.array([1.0, 1.0, math.exp(-2.0), 1.0])
    np.testing.assert_allclose(m["ess"], alpha.sum() ** 2 / (alpha**2).sum(), rtol=1e-5)
    np.testing.assert_allclose(m["effective_pos_fraction"], 0.5, rtol=1e-6)
    # objective: positives ρ(e^-1,1,1) = 1 + (−1) = 0 and ρ(e^.5,1,1) = 1.5; negatives
    # ρ(e^-2,0,1) = e^-2 and ρ(e^1.5,0,1) = 1·(1 + log(e^1.5/1)) = 2.5
    np.testing.assert_allclose(m["objective"], (0 + 1.5 - math.exp(-2) - 2.5) / 4, rtol=1e-5)


@pytest.mark.parametrize("c", [-0.5, 0.0, 0.4])
def test_effective_positive_fraction_metric_matches_eq12(c):
    rewards = np.array([1, -1, -1, -1, 1, -1, -1, -1, -1, -1], np.float32)  # p = 0.2
    z = np.zeros((10, 2), np.float32)
    out = pg.topr_loss(z, z, np.ones((10, 2)), rewards, baseline=c)
    np.testing.assert_allclose(out.metrics["effective_pos_fraction"],
                               effective_positive_fraction(0.2, c), rtol=1e-5)


def test_record_mask_and_micro_batch_sums_are_exact():
    logp, logmu, mask, rewards = _random_batch(11, b=8)
    topr = jax.jit(pg.topr_loss)
    full = topr(logp, logmu, mask, rewards)
    halves = [topr(logp[s], logmu[s], mask[s], rewards[s]) for s in (slice(0, 3), slice(3, 8))]
    np.testing.assert_allclose(sum(h.total for h in halves) / sum(h.weight for h in halves),
                               full.loss, rtol=1e-6)
    # a padding row with garbage (NaN log-probs) contributes nothing
    lp = np.concatenate([logp, np.full((1, T), np.nan, np.float32)])
    lm = np.concatenate([logmu, np.full((1, T), np.inf, np.float32)])
    mk = np.concatenate([mask, np.ones((1, T), np.float32)])
    rw = np.concatenate([rewards, [np.nan]]).astype(np.float32)
    rm = np.concatenate([np.ones(8), [0.0]]).astype(np.float32)
    padded = topr(lp, lm, mk, rw, record_mask=rm)
    np.testing.assert_allclose(padded.loss, full.loss, rtol=1e-6)
    g = jax.jit(jax.grad(lambda x: pg.topr_loss(x, lm, mk, rw, record_mask=rm).loss))(lp)
    assert np.isfinite(np.asarray(g)).all()
    for value in padded.metrics.values():
        assert np.isfinite(float(value))


# ----------------------------------------------------------------------------- PPO / GRPO


def test_ppo_sequence_by_hand():
    ratios = np.array([1.5, 0.5, 0.5, 1.5, 1.1])
    adv = np.array([1.0, 1.0, -1.0, -1.0, 2.0], np.float32)
    logmu = np.full((5, 2), -1.0, np.float32)
    logp = (logmu + np.log(ratios)[:, None] / 2).astype(np.float32)
    mask = np.ones((5, 2), np.float32)
    out = pg.ppo_loss(logp, logmu, mask, adv)
    # −min(rA, clip(r, .8, 1.2)A) per record
    per = [-1.2, -0.5, 0.8, 1.5, -2.2]
    np.testing.assert_allclose(out.loss, np.mean(per), rtol=1e-5)
    grad = jax.grad(lambda lp: pg.ppo_loss(lp, logmu, mask, adv).total)(jnp.asarray(logp))
    # zero gradient where clipped (records 0, 2); −r A elsewhere, on every token
    np.testing.assert_allclose(np.asarray(grad)[:, 0], [0.0, -0.5, 0.0, 1.5, -2.2], rtol=1e-5,
                               atol=1e-7)
    np.testing.assert_allclose(out.metrics["clip_frac"], 2 / 5, rtol=1e-6)
    np.testing.assert_allclose(out.metrics["clip_frac_high"], 2 / 5, rtol=1e-6)
    np.testing.assert_allclose(out.metrics["clip_frac_low"], 2 / 5, rtol=1e-6)


AGG_LOSS = np.array([[1.0, 2.0, 3.0, 0.0], [4.0, 5.0, 0.0, 0.0], [6.0, 0.0, 0.0, 0.0]])
AGG_MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]], np.float32)


@pytest.mark.parametrize("mode,expected", [
    ("token-mean", (21.0, 6.0)),
    ("seq-mean-token-sum", (6.0 + 9.0 + 6.0, 3.0)),
    ("seq-mean-token-mean", (2.0 + 4.5 + 6.0, 3.0)),
    ("seq-mean-token-sum-norm", ((6.0 + 9.0 + 6.0) / 10.0, 3.0)),
])
def test_aggregation_by_hand(mode, expected):
    total, weight = pg.aggregate(AGG_LOSS, AGG_MASK, mode, max_len=10)
    np.testing.assert_allclose((float(total), float(weight)), expected, rtol=1e-6)


def test_aggregation_default_max_len_is_padded_length_and_record_mask():
    total, weight = pg.aggregate(AGG_LOSS, AGG_MASK, "seq-mean-token-sum-norm",
                                 record_mask=np.array([1.0, 0.0, 1.0]))
    np.testing.assert_allclose((float(total), float(weight)), ((6.0 + 6.0) / 4, 2.0))


GRPO_GROUPS = np.array([0, 0, 0, 1, 1], np.int32)
GRPO_REWARDS = np.array([1.0, -1.0, -1.0, 1.0, -1.0], np.float32)


def _grpo_by_hand(logp, logmu, mask, scale_by_std, aggregation, max_len):
    adv = np.zeros(5)
    for g in (0, 1):
        idx = GRPO_GROUPS == g
        r = GRPO_REWARDS[idx].astype(np.float64)
        centred = r - r.mean()
        adv[idx] = centred / (r.std() + 1e-6) if scale_by_std else centred
    per_record, tokens = [], []
    for i in range(5):
        terms = []
        for t in range(mask.shape[1]):
            if mask[i, t] == 0:
                continue
            r = math.exp(float(logp[i, t]) - float(logmu[i, t]))
            terms.append(-min(r * adv[i], min(max(r, 0.8), 1.2) * adv[i]))
        tokens += terms
        if aggregation == "seq-mean-token-mean":
            per_record.append(sum(terms) / len(terms))
        else:
            per_record.append(sum(terms) / max_len)
    return sum(tokens) / len(tokens) if aggregation == "token-mean" else sum(per_record) / 5


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_grpo_by_hand(aggregation):
    logp, logmu, mask, _ = _random_batch(5, b=5, t=6, spread=0.3)
    out = pg.grpo_loss(logp, logmu, mask, GRPO_REWARDS, GRPO_GROUPS, aggregation=aggregation)
    np.testing.assert_allclose(out.loss, _grpo_by_hand(logp, logmu, mask, True, aggregation, 6),
                               rtol=1e-5)


def test_dr_grpo_by_hand():
    logp, logmu, mask, _ = _random_batch(6, b=5, t=6, spread=0.3)
    out = LOSS_SPECS["dr_grpo"].kernel(logp=logp, logmu=logmu, mask=mask, rewards=GRPO_REWARDS,
                               group_ids=GRPO_GROUPS, max_len=16)
    expected = _grpo_by_hand(logp, logmu, mask, False, "seq-mean-token-sum-norm", 16)
    np.testing.assert_allclose(out.loss, expected, rtol=1e-5)


# ----------------------------------------------------------------------------- Off-RL / FPA / KL


def test_off_rl_value_gradient_and_metrics_by_hand():
    logp = np.array([[-0.1, -0.2, -0.3], [-1.0, -3.0, 0.0]], np.float32)
    mask = np.array([[1, 1, 1], [1, 1, 0]], np.float32)
    rewards = np.array([1.0, -1.0], np.float32)
    ref = np.array([[-0.2, -0.2, -0.2], [-1.0, -1.0, -9.0]], np.float32)
    out = pg.off_rl_loss(logp, mask, rewards, ref_logp=ref)
    p0, p1 = math.exp(-0.6 / 3), math.exp(-4.0 / 2)
    np.testing.assert_allclose(out.loss, (-p0 + p1) / 2, rtol=1e-6)
    grad = jax.grad(lambda lp: pg.off_rl_loss(lp, mask, rewards).total)(jnp.asarray(logp))
    np.testing.assert_allclose(np.asarray(grad), [[-p0 / 3] * 3, [p1 / 2, p1 / 2, 0.0]],
                               rtol=1e-5)
    m = out.metrics
    np.testing.assert_allclose(m["pi_norm_mean_correct"], p0, rtol=1e-6)
    np.testing.assert_allclose(m["pi_norm_mean_incorrect"], p1, rtol=1e-6)
    assert float(m["count_pi_below_0.2_incorrect"]) == 1.0  # e^-2 ≈ 0.135
    np.testing.assert_allclose(m["logp_minus_ref_mean_correct"], -0.6 + 0.6, atol=1e-6)
    np.testing.assert_allclose(m["logp_minus_ref_mean_incorrect"], -4.0 + 2.0, rtol=1e-6)


@pytest.mark.parametrize("fpa_on", ["both", "negatives", "positives"])
def test_fpa_at_lambda_zero_has_off_rl_gradient(fpa_on):
    logp, _, mask, rewards = _random_batch(21)
    g_fpa = jax.grad(lambda lp: pg.fpa_loss(lp, lp, mask, rewards, fpa_on=fpa_on).loss)(
        jnp.asarray(logp))
    g_off = jax.grad(lambda lp: pg.off_rl_loss(lp, mask, rewards).loss)(jnp.asarray(logp))
    np.testing.assert_allclose(np.asarray(g_fpa), np.asarray(g_off), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("fpa_on", ["both", "negatives", "positives"])
def test_fpa_gradient_by_hand(fpa_on):
    logp, logp_hat, mask, rewards = _random_batch(22)
    grad = jax.grad(lambda lp: pg.fpa_loss(lp, logp_hat, mask, rewards, fpa_on=fpa_on).total)(
        jnp.asarray(logp))
    n = mask.sum(-1)
    correct = rewards > 0
    use_hat = {"both": np.ones(B, bool), "negatives": ~correct, "positives": correct}[fpa_on]
    w = np.where(use_hat, np.exp(_np_seq(logp_hat, mask) / n), np.exp(_np_seq(logp, mask) / n))
    expected = -(rewards * w / n)[:, None] * mask  # 002 eq. 3: ∇ = R π̂^{1/|y|} ∇log π / |y|
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-5, atol=1e-8)
    out = pg.fpa_loss(logp, logp_hat, mask, rewards, fpa_on=fpa_on)
    hat = np.exp(_np_seq(logp_hat, mask) / n)
    np.testing.assert_allclose(out.metrics["pi_hat_norm_mean_correct"], hat[correct].mean(),
                               rtol=1e-5)
    np.testing.assert_allclose(out.metrics["count_pi_hat_below_0.2_incorrect"],
                               (hat[~correct] < 0.2).sum())


def test_fpa_correct_flags_override_reward_sign():
    logp, logp_hat, mask, _ = _random_batch(23)
    rewards = np.ones(B, np.float32)
    correct = np.array([True, False] * 3)
    grad = jax.grad(lambda lp: pg.fpa_loss(lp, logp_hat, mask, rewards, fpa_on="negatives",
                                           correct=correct).total)(jnp.asarray(logp))
    n = mask.sum(-1)
    w = np.where(correct, np.exp(_np_seq(logp, mask) / n), np.exp(_np_seq(logp_hat, mask) / n))
    np.testing.assert_allclose(np.asarray(grad), -(w / n)[:, None] * mask, rtol=1e-5, atol=1e-8)


def test_off_rl_kl_by_hand():
    logp, ref, mask, rewards = _random_batch(31)
    out = pg.off_rl_kl_loss(logp, ref, mask, rewards, tau=0.04)
    n = mask.sum(-1)
    off = -rewards * np.exp(_np_seq(logp, mask) / n)
    kl = (_np_seq(ref, mask) - _np_seq(logp, mask)) / n
    np.testing.assert_allclose(out.loss, np.mean(off + 0.04 * kl), rtol=1e-5)
    seq = pg.off_rl_kl_loss(logp, ref, mask, rewards, tau=0.5, kl_length_norm=False)
    np.testing.assert_allclose(seq.loss, np.mean(off + 0.5 * kl * n), rtol=1e-5)


def test_off_rl_kl_exact_token_form():
    rng = np.random.default_rng(0)
    ref_logits = rng.normal(size=(2, 3, 5)).astype(np.float32)
    logits = rng.normal(size=(2, 3, 5)).astype(np.float32)
    p = np.exp(ref_logits) / np.exp(ref_logits).sum(-1, keepdims=True)
    q = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    exact = (p * np.log(p / q)).sum(-1)
    token_kl = pg.token_forward_kl(ref_logits, logits)
    np.testing.assert_allclose(token_kl, exact, rtol=1e-5)
    mask = np.array([[1, 1, 0], [1, 1, 1]], np.float32)
    logp = -np.ones((2, 3), np.float32)
    rewards = np.array([1.0, -1.0], np.float32)
    out = pg.off_rl_kl_loss(logp, logp, mask, rewards, tau=0.1, token_kl=token_kl)
    kl = (exact * mask).sum(-1) / mask.sum(-1)
    np.testing.assert_allclose(out.loss, np.mean(-rewards * math.exp(-1) + 0.1 * kl), rtol=1e-5)


def test_kl_estimators_by_hand():
    logp = np.array([[-1.0, -2.0, -1.0, -3.0]], np.float32)
    ref = np.array([[-1.5, -0.5, 49.0, 0.0]], np.float32)
    mask = np.array([[1, 1, 1, 0]], np.float32)
    delta = np.array([-0.5, 1.5, 20.0])  # third δ = 50 clamped to 20; fourth token masked
    expected = {
        "k1": -delta,
        "k2": delta**2 / 2,
        "k3": np.exp(delta) - 1 - delta,
    }
    for kind, values in expected.items():
        out = pg.kl_penalty(logp, ref, mask, kind=kind)
        np.testing.assert_allclose(out.loss, values.mean(), rtol=1e-5)
        np.testing.assert_allclose(pg.kl_per_record(logp, ref, mask, kind=kind), [values.sum()],
                                   rtol=1e-5)


# ----------------------------------------------------------------------------- extreme inputs

EXTREME_T = 4096


@pytest.fixture(scope="module")
def extreme_batch():
    rng = np.random.default_rng(7)
    logmu = -rng.uniform(0.0, 2.0, (4, EXTREME_T)).astype(np.float32)
    target = np.array([1000.0, -1000.0, 1000.0, -1000.0])  # sequence log-ratios
    logp = (logmu + (target / EXTREME_T)[:, None]).astype(np.float32)
    mask = np.ones((4, EXTREME_T), np.float32)
    rewards = np.array([1.0, 1.0, -1.0, -1.0], np.float32)
    return logp, logmu, mask, rewards


EXTREME_CALLS = {
    **{name: lambda lp, lm, m, r, name=name: LOSS_SPECS[name].kernel(logp=lp, logmu=lm, mask=m, rewards=r)
       for name in PRESETS},
    **{f"{name}_token": lambda lp, lm, m, r, name=name: LOSS_SPECS[name].kernel(
        logp=lp, logmu=lm, mask=m, rewards=r, ratio_level="token") for name in ("opr", "topr")},
    "ppo": lambda lp, lm, m, r: pg.ppo_loss(lp, lm, m, r),
    "grpo": lambda lp, lm, m, r: pg.grpo_loss(lp, lm, m, r, jnp.array([0, 0, 1, 1])),
    "off_rl": lambda lp, lm, m, r: pg.off_rl_loss(lp, m, r),
    "fpa": lambda lp, lm, m, r: pg.fpa_loss(lp, lm + 1.0, m, r),
    "off_rl_kl": lambda lp, lm, m, r: pg.off_rl_kl_loss(lp, lm, m, r),
    "kl_k3": lambda lp, lm, m, r: pg.kl_penalty(lp, lm - 30.0, m, kind="k3"),
}


@pytest.mark.parametrize("name", list(EXTREME_CALLS))
def test_extreme_log_ratios_stay_finite(name, extreme_batch):
    logp, logmu, mask, rewards = extreme_batch
    fn = EXTREME_CALLS[name]

    def loss(lp):
        out = fn(lp, logmu, mask, rewards)
        return out.loss, out.metrics

    (value, metrics), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(jnp.asarray(logp))
    assert np.isfinite(float(value)), name
    assert np.isfinite(np.asarray(grad)).all(), name
    assert np.isfinite(float(jnp.sum(grad.astype(jnp.float32) ** 2))), name  # grad-norm safe
    for key, value in metrics.items():
        assert np.isfinite(float(value)), (name, key)


def test_opr_full_importance_weight_below_the_cap():
    # r = e^20 is below LOG_RATIO_CAP: opr's gradient weight is exactly r (no hidden clip)
    logmu = np.full((1, 4), -1.0, np.float32)
    logp = logmu + 5.0
    grad = jax.grad(lambda lp: LOSS_SPECS["opr"].kernel(logp=lp, logmu=logmu, mask=np.ones((1, 4)),
                                                rewards=np.ones(1)).total)(jnp.asarray(logp))
    np.testing.assert_allclose(np.asarray(grad), -math.exp(20.0) / 4, rtol=1e-5)


# ----------------------------------------------------------------------------- properties

HB, HT = 5, 6
_ids = jnp.array([0, 0, 1, 1, 1])


def _property_losses(logp, logmu, mask, rewards):
    return jnp.stack([
        pg.topr_loss(logp, logmu, mask, rewards).total,
        pg.topr_loss(logp, logmu, mask, rewards, ratio_level="token").total,
        LOSS_SPECS["opr"].kernel(logp=logp, logmu=logmu, mask=mask, rewards=rewards).total,
        LOSS_SPECS["sft"].kernel(logp=logp, logmu=logmu, mask=mask, rewards=rewards).total,
        pg.ppo_loss(logp, logmu, mask, rewards).total,
        pg.grpo_loss(logp, logmu, mask, rewards, _ids).total,
        pg.fpa_loss(logp, logmu, mask, rewards).total,
        pg.off_rl_kl_loss(logp, logmu, mask, rewards).total,
    ])


_jit_losses = jax.jit(_property_losses)
_jit_grads = jax.jit(jax.jacrev(_property_losses))

token_values = st.lists(st.floats(-60.0, 0.0, width=32), min_size=HB * HT, max_size=HB * HT)


@st.composite
def batches(draw):
    logp = np.array(draw(token_values), np.float32).reshape(HB, HT)
    logmu = np.array(draw(token_values), np.float32).reshape(HB, HT)
    lengths = np.array(draw(st.lists(st.integers(0, HT), min_size=HB, max_size=HB)))
    mask = (np.arange(HT)[None, :] < lengths[:, None]).astype(np.float32)
    rewards = np.array(draw(st.lists(st.floats(-2.0, 2.0, width=32), min_size=HB,
                                     max_size=HB)), np.float32)
    return logp, logmu, mask, rewards


@settings(max_examples=15, deadline=None)
@given(batches())
def test_property_finite_and_jit_matches_eager(batch):
    logp, logmu, mask, rewards = batch
    jitted = np.asarray(_jit_losses(logp, logmu, mask, rewards))
    assert np.isfinite(jitted).all()
    assert np.isfinite(np.asarray(_jit_grads(logp, logmu, mask, rewards))).all()
    eager = np.asarray(_property_losses(logp, logmu, mask, rewards))
    np.testing.assert_allclose(jitted, eager, rtol=1e-4, atol=1e-4)


def _equivariance_losses(lp, lm, mk, rw, gid):
    return jnp.stack([
        pg.topr_loss(lp, lm, mk, rw).total,
        pg.ppo_loss(lp, lm, mk, rw, ratio_level="token").total,
        pg.grpo_loss(lp, lm, mk, rw, gid).total,
        pg.fpa_loss(lp, lm, mk, rw).total,
    ])


_jit_equivariance = jax.jit(_equivariance_losses)
_jit_equivariance_grads = jax.jit(jax.jacrev(_equivariance_losses))


@settings(max_examples=15, deadline=None)
@given(batches(), st.permutations(range(HB)))
def test_property_permutation_equivariance(batch, perm):
    """Permuting the records (with their group ids) permutes per-record gradients and
    leaves every loss unchanged."""
    logp, logmu, mask, rewards = batch
    perm = np.asarray(perm)
    ids = np.asarray(_ids)
    args = (logp, logmu, mask, rewards, ids)
    permuted_args = tuple(x[perm] for x in args)
    np.testing.assert_allclose(_jit_equivariance(*permuted_args), _jit_equivariance(*args),
                               rtol=1e-4, atol=1e-4)
    g_base = np.asarray(_jit_equivariance_grads(*args))
    g_perm = np.asarray(_jit_equivariance_grads(*permuted_args))
    np.testing.assert_allclose(g_perm, g_base[:, perm], rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- bad input


def test_shape_and_dtype_errors_name_arguments():
    logp, logmu, mask, rewards = _random_batch(1)
    with pytest.raises(AssertionError, match="logmu"):
        pg.topr_loss(logp, logmu[:, :-1], mask, rewards)
    with pytest.raises(ValueError, match="rewards"):
        pg.topr_loss(logp, logmu, mask, rewards[:-1])
    with pytest.raises(ValueError, match="record_mask"):
        pg.topr_loss(logp, logmu, mask, rewards, record_mask=np.ones(2))
    with pytest.raises(ValueError, match="logp must be floating"):
        pg.topr_loss(logp.astype(np.int32), logmu, mask, rewards)
    with pytest.raises(ValueError, match="a_neg"):
        pg.topr_loss(logp, logmu, mask, rewards, a_neg=2.0, b_neg=1.0)
    with pytest.raises(ValueError, match="ratio_level"):
        pg.topr_loss(logp, logmu, mask, rewards, ratio_level="tokens")
    with pytest.raises(ValueError, match="mode"):
        pg.aggregate(logp, mask, "mean")
    with pytest.raises(ValueError, match="unknown TOPR preset"):
        pg.topr_preset("ppo")
    with pytest.raises(AssertionError, match="logp_hat"):
        pg.fpa_loss(logp, logp[:2], mask, rewards)


def test_check_loss_inputs_names_nan_and_missing_arguments():
    logp, logmu, mask, rewards = _random_batch(2)
    check_loss_inputs("topr", logp=logp, logmu=logmu, mask=mask, rewards=rewards)
    bad = rewards.copy()
    bad[3] = np.nan
    with pytest.raises(ValueError, match=r"loss 'topr': rewards .*index \[3\]"):
        check_loss_inputs("topr", logp=logp, logmu=logmu, mask=mask, rewards=bad)
    bad_lp = logp.copy()
    bad_lp[0, 0] = -np.inf
    with pytest.raises(ValueError, match="logp contains 1 non-finite"):
        check_loss_inputs("fpa", logp=bad_lp, logp_hat=logp, mask=mask, rewards=rewards)
    # NaN on a masked (padding) token is not an error
    masked = logp.copy()
    masked[mask == 0] = np.nan
    if (mask == 0).any():
        check_loss_inputs("off_rl", logp=masked, mask=mask, rewards=rewards)
    with pytest.raises(ValueError, match=r"needs argument\(s\) \['group_ids'\]"):
        check_loss_inputs("grpo", logp=logp, logmu=logmu, mask=mask, rewards=rewards)
    with pytest.raises(ValueError, match="unknown loss"):
        check_loss_inputs("dpo_typo")


def test_registry_covers_config_names_and_inputs():
    from jaxrl_llm.config import ConfigError, load_config

    stale = {"cispo", "gspo", "icepop", "m2po", "vespo"}  # tests/losses/test_stale_is.py
    async_rl = {"dppo", "trm", "oapl", "vcpo"}  # tests/losses/test_{dppo,trm,oapl,vcpo}.py
    names = {"topr", "sft", "reinforce", "opr", "tis", "ppo", "grpo", "dr_grpo",
             "off_rl", "off_rl_kl", "fpa", "dpo", "rpo", "kto", "apo", "asymre"} | stale | async_rl
    assert set(LOSS_SPECS) == names
    for name in names:  # the config accepts exactly the registry's names
        assert load_config(None, [f"loss.name={name}"]).loss.name == name
    with pytest.raises(ConfigError, match="unknown loss 'dpo_typo'"):
        load_config(None, ["loss.name=dpo_typo"])
    logp, logmu, mask, rewards = _random_batch(4)
    arrays = {"logp": logp, "logmu": logmu, "mask": mask, "rewards": rewards,
              "group_ids": np.array([0, 0, 1, 1, 2, 2]), "ref_logp": logmu, "logp_hat": logmu,
              "score_sq_norms": np.linspace(1.0, 2.0, 6)}
    for name, spec in LOSS_SPECS.items():
        if spec.family == "preference":
            continue  # pair/group fields: tests/losses/test_preference.py
        out = spec.kernel(**{k: arrays[k] for k in spec.inputs})
        # grpo's default aggregation is token-mean (weight = tokens), as cispo, icepop, m2po and
        # vespo's (the papers' 1/Σ|o_i|); the rest count records (gspo: 1/G; dppo, trm, vcpo:
        # Σ over a sequence's tokens, mean over sequences; oapl, asymre: per record)
        expected_weight = mask.sum() if name == "grpo" or name in stale - {"gspo"} else B
        assert float(out.weight) == expected_weight and np.isfinite(float(out.loss)), name
    # the ratio losses are exactly those with μ in their inputs and a truncation bound < ∞ or PPO,
    # and OAPL, whose μ is its π_lag (no ratio weight)
    assert {n for n, s in LOSS_SPECS.items() if s.needs_mu} == {
        "topr", "opr", "tis", "ppo", "grpo", "dr_grpo"} | stale | async_rl
