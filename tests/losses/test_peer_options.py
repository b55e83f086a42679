"""Options users of other frameworks expect, each against its peer's formula transcribed here
in plain NumPy (float64, loops where the paper has sums):

- the length-normalised (geometric-mean) ratio r̄ = exp(ℓ/|y|) for the TOPR family — value:
  TOPR arXiv:2503.14286 eq. 11's taper of r̄; gradient: verl's `loss_mode=topr` proposal,
  `−sg([r̄]_a^b)·A·logπ_t` reduced by verl's `agg_loss`;
- `token-mean` aggregation for `topr_loss` — gradient: Trinity-RFT's TOPR loss
  (`masked_mean(−sg(α)·R·logπ_t)` with token ratios, α = [r_t]_0^1 on negatives);
- DAPO's clip-higher (arXiv:2503.14476: `min(r Â, clip(r, 1−ε_low, 1+ε_high) Â)`, token
  mean over the group's tokens) and dual-clip PPO (arXiv:1912.09729:
  `max(min(r A, clip(r) A), c A)` for A < 0), as verl's `compute_policy_loss` computes them;
- GRPO's group std with ddof 0 or 1 (verl / TRL / Tunix use 1).

Values are compared with the transcriptions; gradients with finite differences of the
transcribed values (an independent check of the taper identity) and with the peers'
stop-gradient forms. Every batch has padding: masked tokens hold NaN and one record is a
padding row (record_mask 0). The last tests go through the public path (`LossConfig` →
`train.loss_fn.compute_loss`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.config import ConfigError, config_from_dict
from jaxrl_llm.data.batch import Batch
from jaxrl_llm.losses import policy_gradient as pg
from jaxrl_llm.losses.advantages import grpo_advantages
from jaxrl_llm.train.loss_fn import compute_loss

B, T = 6, 7
PAD_ROW = 4  # record_mask 0: never read


def _batch(seed: int, spread: float = 0.35):
    """logp, logmu [B, T] (NaN on masked tokens and on the padding row), mask, rewards, rm."""
    rng = np.random.default_rng(seed)
    logmu = -rng.uniform(0.1, 3.0, (B, T))
    logp = logmu + rng.normal(0.0, spread, (B, T))
    lengths = rng.integers(1, T + 1, B)
    lengths[0] = T
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    rewards = rng.choice([-1.0, 1.0], B) * rng.uniform(0.5, 2.0, B)
    rewards[:2] = (1.5, -0.7)  # both signs present
    rm = np.ones(B, np.float32)
    rm[PAD_ROW] = 0.0
    logp = np.where(mask > 0, logp, np.nan)
    logmu = np.where(mask > 0, logmu, np.nan)
    logp[PAD_ROW] = np.nan
    logmu[PAD_ROW] = np.nan
    return (logp.astype(np.float32), logmu.astype(np.float32), mask, rewards.astype(np.float32),
            rm)


def _real(mask, rm):
    """[B, T] bool: the entries a loss may read (completion tokens of real records)."""
    return (mask > 0) & (rm[:, None] > 0)


def _fd_grad(f, x, keep, h=1e-6):
    """Central finite differences of a float64 function over the entries `keep`."""
    x = np.where(keep, np.asarray(x, np.float64), 0.0)
    g = np.zeros_like(x)
    for idx in zip(*np.nonzero(keep)):
        up, down = x.copy(), x.copy()
        up[idx] += h
        down[idx] -= h
        g[idx] = (f(up) - f(down)) / (2 * h)
    return g


def _jax_value_grad(loss_fn, logp):
    value, grad = jax.value_and_grad(loss_fn)(jnp.asarray(logp))
    return float(value), np.asarray(grad, np.float64)


def _assert_grad(got, want, keep):
    np.testing.assert_allclose(np.where(keep, got, 0.0), want, rtol=2e-4, atol=2e-6)
    assert np.all(got[~keep] == 0.0)  # padding gets no gradient (and no NaN)


# ----------------------------------------------------------------------------- TOPR transcriptions


def taper_000(x: float, a: float, b: float) -> float:
    """TOPR arXiv:2503.14286 eq. 11: a(1 + log(x/a)) below a, x in [a, b], b(1 + log(x/b))
    above b (b = 0: the limit 0)."""
    if x < a:
        return a * (1.0 + math.log(x / a))
    if x > b:
        return 0.0 if b == 0 else b * (1.0 + math.log(x / b))
    return x


def topr_terms(logp, logmu, mask, rewards, rm, bounds, ratio_level):
    """Per record: (S_b, α-weight per token [T], |y_b|) of the taper form (TOPR eq. 11) with
    ratio sequence exp(ℓ), token exp(ℓ_t), or geometric exp(ℓ/|y|)."""
    rewards = np.asarray(rewards, np.float64)
    out = []
    for i in range(B):
        n = int(mask[i].sum())
        adv = float(rewards[i])
        a, b = ((bounds["a_pos"], bounds["b_pos"]) if adv >= 0
                else (bounds["a_neg"], bounds["b_neg"]))
        lr = [float(logp[i, t]) - float(logmu[i, t]) for t in range(n)]
        alpha = np.zeros(T)
        if ratio_level == "token":
            s = sum(taper_000(math.exp(x), a, b) for x in lr)
            alpha[:n] = [min(max(math.exp(x), a), b) for x in lr]
        else:
            ell = sum(lr)
            r = math.exp(ell) if ratio_level == "sequence" else math.exp(ell / n)
            s = taper_000(r, a, b) * (1 if ratio_level == "sequence" else n)
            alpha[:n] = min(max(r, a), b)
        out.append((s, alpha, n))
    return out


def topr_value_000(logp, logmu, mask, rewards, rm, bounds, ratio_level, aggregation):
    """Loss of the taper form: per record −A·S_b, reduced by `aggregation` ("record": ÷|y|,
    mean over records — today's length_norm; "token-mean": ÷ all completion tokens)."""
    terms = topr_terms(logp, logmu, mask, rewards, rm, bounds, ratio_level)
    rewards = np.asarray(rewards, np.float64)
    num = den = 0.0
    for i, (s, _, n) in enumerate(terms):
        if rm[i] == 0:
            continue
        if aggregation == "token-mean":
            num, den = num - rewards[i] * s, den + n
        else:
            num, den = num - rewards[i] * s / n, den + 1
    return num / den


def topr_grad_peer(logp, logmu, mask, rewards, rm, bounds, ratio_level, aggregation):
    """∂/∂logπ_t of the peers' stop-gradient loss −sg(α)·A·logπ_t reduced by verl's
    agg_loss: token-mean (÷ Σ tokens; Trinity-RFT's default) or seq-mean-token-mean."""
    terms = topr_terms(logp, logmu, mask, rewards, rm, bounds, ratio_level)
    rewards = np.asarray(rewards, np.float64)
    real = [i for i in range(B) if rm[i] > 0]
    tokens = sum(terms[i][2] for i in real)
    g = np.zeros((B, T))
    for i in real:
        _, alpha, n = terms[i]
        denom = tokens if aggregation == "token-mean" else n * len(real)
        g[i, :n] = -rewards[i] * alpha[:n] / denom
    return g


def trinity_topr_grad(logp, logmu, mask, rewards, rm):
    """Trinity-RFT's TOPR (token ratios): loss = masked_mean(−sg(α)·R·logπ_t) with
    α = clamp(r_t, 0, 1) where R ≤ 0, else 1; its gradient is −α·R·mask / Σ mask."""
    keep = _real(mask, rm)
    ratio = np.exp(np.where(keep, logp.astype(np.float64) - logmu, 0.0))
    alpha = np.where(rewards[:, None] <= 0, np.clip(ratio, 0.0, 1.0), 1.0)
    return np.where(keep, -alpha * rewards[:, None], 0.0) / keep.sum()


CUSTOM = {"a_pos": 0.8, "b_pos": 1.25, "a_neg": 0.5, "b_neg": 2.0}  # every taper region


@pytest.mark.parametrize("bounds", [pg.topr_preset("topr"), pg.topr_preset("tis"), CUSTOM],
                         ids=["topr", "tis", "custom"])
@pytest.mark.parametrize("aggregation", [None, "token-mean"])
def test_geometric_ratio_topr_value_and_gradient(bounds, aggregation):
    logp, logmu, mask, rewards, rm = _batch(1, spread=0.9)
    keep = _real(mask, rm)
    agg = "token-mean" if aggregation else "record"

    def ours(lp):
        return pg.topr_loss(lp, logmu, mask, rewards, **bounds, ratio_level="geometric",
                            aggregation=aggregation, record_mask=rm).loss

    value, grad = _jax_value_grad(ours, logp)
    want = topr_value_000(logp, logmu, mask, rewards, rm, bounds, "geometric", agg)
    np.testing.assert_allclose(value, want, rtol=1e-5)
    # Finite differences of the transcribed taper value: −[r̄]_a^b·A·∇log π(y)/N holds.
    fd = _fd_grad(lambda lp: topr_value_000(lp, logmu, mask, rewards, rm, bounds, "geometric",
                                            agg), logp, keep)
    _assert_grad(grad, fd, keep)
    peer = topr_grad_peer(logp, logmu, mask, rewards, rm, bounds, "geometric",
                          "token-mean" if aggregation else "seq-mean-token-mean")
    _assert_grad(grad, peer, keep)
    out = pg.topr_loss(logp, logmu, mask, rewards, **bounds, ratio_level="geometric",
                       aggregation=aggregation, record_mask=rm)
    outside = sum(float(out.metrics[f"clip_frac_{s}_{e}"]) for s in ("pos", "neg")
                  for e in ("low", "high"))
    assert outside > 0  # some records beyond a bound: the taper's log branches are tested
    # The geometric ratio is not the sequence one: the test would notice a mix-up.
    seq = pg.topr_loss(logp, logmu, mask, rewards, **bounds, aggregation=aggregation,
                       record_mask=rm).loss
    assert abs(float(seq) - value) > 1e-3


def test_geometric_ratio_metrics_are_per_record_mean_log_ratios():
    logp, logmu, mask, rewards, rm = _batch(2)
    out = pg.topr_loss(logp, logmu, mask, rewards, ratio_level="geometric", record_mask=rm)
    keep = _real(mask, rm)
    ell_bar = [np.where(keep[i], logp[i].astype(np.float64) - logmu[i], 0.0).sum() / mask[i].sum()
               for i in range(B) if rm[i] > 0]
    np.testing.assert_allclose(out.metrics["log_ratio_mean"], np.mean(ell_bar), rtol=1e-5)
    np.testing.assert_allclose(out.metrics["log_ratio_max"], np.max(ell_bar), rtol=1e-5)
    neg = [e for e, i in zip(ell_bar, [i for i in range(B) if rm[i] > 0]) if rewards[i] < 0]
    np.testing.assert_allclose(out.metrics["clip_frac_neg_high"], np.mean(np.array(neg) > 0))


@pytest.mark.parametrize("ratio_level", ["token", "sequence", "geometric"])
def test_topr_token_mean_aggregation(ratio_level):
    logp, logmu, mask, rewards, rm = _batch(3)
    keep = _real(mask, rm)
    bounds = pg.topr_preset("topr")

    def ours(lp):
        return pg.topr_loss(lp, logmu, mask, rewards, ratio_level=ratio_level,
                            aggregation="token-mean", record_mask=rm).loss

    value, grad = _jax_value_grad(ours, logp)
    want = topr_value_000(logp, logmu, mask, rewards, rm, bounds, ratio_level, "token-mean")
    np.testing.assert_allclose(value, want, rtol=1e-5)
    out = pg.topr_loss(logp, logmu, mask, rewards, ratio_level=ratio_level,
                       aggregation="token-mean", record_mask=rm)
    assert float(out.weight) == keep.sum()  # the weight counts completion tokens
    _assert_grad(grad, topr_grad_peer(logp, logmu, mask, rewards, rm, bounds, ratio_level,
                                      "token-mean"), keep)
    if ratio_level == "token":  # exactly Trinity-RFT's TOPR gradient
        _assert_grad(grad, trinity_topr_grad(logp, logmu, mask, rewards, rm), keep)


def test_topr_default_aggregation_is_unchanged_and_conflicts_are_refused():
    logp, logmu, mask, rewards, rm = _batch(4)
    default = pg.topr_loss(logp, logmu, mask, rewards, record_mask=rm)
    named = pg.topr_loss(logp, logmu, mask, rewards, aggregation="seq-mean-token-mean",
                         record_mask=rm)
    np.testing.assert_allclose(default.total, named.total, rtol=1e-6)
    assert float(default.weight) == float(named.weight) == rm.sum()
    unnorm = pg.topr_loss(logp, logmu, mask, rewards, length_norm=False, record_mask=rm)
    summed = pg.topr_loss(logp, logmu, mask, rewards, aggregation="seq-mean-token-sum",
                          record_mask=rm)
    np.testing.assert_allclose(unnorm.total, summed.total, rtol=1e-6)
    with pytest.raises(ValueError, match="length_norm=False and aggregation"):
        pg.topr_loss(logp, logmu, mask, rewards, length_norm=False, aggregation="token-mean")
    with pytest.raises(ValueError, match="ratio_level"):
        pg.topr_loss(logp, logmu, mask, rewards, ratio_level="length_norm")
    with pytest.raises(ValueError, match="aggregation"):
        pg.topr_loss(logp, logmu, mask, rewards, aggregation="token-sum")


# ----------------------------------------------------------------------------- PPO / GRPO (verl)


def verl_policy_loss(logp, logmu, mask, adv, rm, eps_low, eps_high, clip_c, agg):
    """verl's compute_policy_loss + agg_loss, transcribed (rows with rm 0 dropped):

        pg1 = −A r;  pg2 = −A clip(r, 1 − ε_low, 1 + ε_high);  L1 = max(pg1, pg2)
        pg3 = −A c;  L = where(A < 0, min(pg3, L1), L1)       (dual clip, c = inf: off)
    """
    adv = np.asarray(adv, np.float64)
    num = den = 0.0
    rows = [i for i in range(B) if rm[i] > 0]
    for i in rows:
        seq = 0.0
        n = int(mask[i].sum())
        for t in range(n):
            r = math.exp(float(logp[i, t]) - float(logmu[i, t]))
            pg1 = -adv[i] * r
            pg2 = -adv[i] * min(max(r, 1 - eps_low), 1 + eps_high)
            loss = max(pg1, pg2)
            if adv[i] < 0:
                loss = min(-adv[i] * clip_c, loss)
            seq += loss
        if agg == "token-mean":
            num, den = num + seq, den + n
        else:  # seq-mean-token-mean
            num, den = num + seq / n, den + 1
    return num / den


def dapo_clip_higher(logp, logmu, mask, adv, rm, eps_low, eps_high):
    """DAPO arXiv:2503.14476 objective, negated: −1/Σ|o_i| Σ_i Σ_t min(r Â, clip(r, 1−ε_low,
    1+ε_high) Â)."""
    adv = np.asarray(adv, np.float64)
    total, tokens = 0.0, 0
    for i in range(B):
        if rm[i] == 0:
            continue
        for t in range(int(mask[i].sum())):
            r = math.exp(float(logp[i, t]) - float(logmu[i, t]))
            clipped = min(max(r, 1 - eps_low), 1 + eps_high)
            total += min(r * adv[i], clipped * adv[i])
            tokens += 1
    return -total / tokens


def dual_clip_ppo(logp, logmu, mask, adv, rm, eps, c):
    """Dual-clip PPO arXiv:1912.09729, negated, per token and token-mean: for Â < 0 the
    objective is max(min(r Â, clip(r, 1−ε, 1+ε) Â), c Â), else min(r Â, clip(r) Â)."""
    adv = np.asarray(adv, np.float64)
    total, tokens = 0.0, 0
    for i in range(B):
        if rm[i] == 0:
            continue
        for t in range(int(mask[i].sum())):
            r = math.exp(float(logp[i, t]) - float(logmu[i, t]))
            obj = min(r * adv[i], min(max(r, 1 - eps), 1 + eps) * adv[i])
            if adv[i] < 0:
                obj = max(obj, c * adv[i])
            total += obj
            tokens += 1
    return -total / tokens


def group_advantages(rewards, groups, rm, ddof):
    """(R − mean_g R) / (std_g R + 1e-6) with NumPy's std(ddof) (verl/TRL/Tunix: ddof=1)."""
    adv = np.zeros(B)
    for g in set(groups[rm > 0].tolist()):
        idx = np.nonzero((groups == g) & (rm > 0))[0]
        r = rewards[idx].astype(np.float64)
        adv[idx] = (r - r.mean()) / (np.std(r, ddof=ddof) + 1e-6)
    return adv


def _assert_exercised(out, clip_c):
    """The batch reaches the options under test: some tokens above 1 + ε_high, and some
    dual-clipped when dual clip is on (else a wrong dual clip could pass unnoticed)."""
    assert float(out.metrics["clip_frac_high"]) > 0
    if clip_c is not None:
        assert float(out.metrics["clip_frac_dual"]) > 0


GROUPS = np.array([0, 0, 0, 1, 1, 1], np.int32)  # row 4 (padding) leaves group 1 with 2 records


@pytest.mark.parametrize(("eps_low", "eps_high", "clip_c"), [
    (0.2, 0.28, None), (0.2, 0.2, 3.0), (0.1, 0.3, 1.5)])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_ppo_token_ratio_clip_higher_and_dual_clip_equal_verl(eps_low, eps_high, clip_c,
                                                             aggregation):
    logp, logmu, mask, rewards, rm = _batch(5, spread=0.5)
    keep = _real(mask, rm)
    adv = rewards.astype(np.float64) - 0.25

    def ours(lp):
        return pg.ppo_loss(lp, logmu, mask, rewards, baseline=0.25, ratio_level="token",
                           clip_eps_low=eps_low, clip_eps_high=eps_high, dual_clip_c=clip_c,
                           aggregation=aggregation, record_mask=rm).loss

    c = math.inf if clip_c is None else clip_c

    def peer(lp):
        return verl_policy_loss(lp, logmu, mask, adv, rm, eps_low, eps_high, c, aggregation)

    value, grad = _jax_value_grad(ours, logp)
    np.testing.assert_allclose(value, peer(logp), rtol=1e-5)
    _assert_grad(grad, _fd_grad(peer, logp, keep), keep)
    _assert_exercised(pg.ppo_loss(logp, logmu, mask, rewards, baseline=0.25, ratio_level="token",
                                  clip_eps_low=eps_low, clip_eps_high=eps_high,
                                  dual_clip_c=clip_c, record_mask=rm), clip_c)
    if aggregation == "token-mean":
        if clip_c is None:
            np.testing.assert_allclose(
                value, dapo_clip_higher(logp, logmu, mask, adv, rm, eps_low, eps_high), rtol=1e-5)
        elif eps_low == eps_high:
            np.testing.assert_allclose(
                value, dual_clip_ppo(logp, logmu, mask, adv, rm, eps_low, clip_c), rtol=1e-5)


def test_ppo_sequence_ratio_dual_clip_caps_negative_losses():
    """Sequence ratios far above 1 + ε: for A < 0 the loss is −c·A (zero gradient)."""
    logp, logmu, mask, rewards, rm = _batch(6)
    logp = np.where(mask > 0, logmu + 0.4, np.nan).astype(np.float32)  # r = e^{0.4|y|} ≥ 1.49
    rewards = np.where(np.arange(B) % 2 == 0, -1.0, 1.0).astype(np.float32)
    r = np.exp(0.4 * mask.sum(-1).astype(np.float64))
    obj = np.minimum(r * rewards, np.clip(r, 0.8, 1.2) * rewards)
    obj = np.where(rewards < 0, np.maximum(obj, 2.0 * rewards), obj)
    want = -(obj * rm).sum() / rm.sum()
    out = pg.ppo_loss(logp, logmu, mask, rewards, dual_clip_c=2.0, record_mask=rm)
    np.testing.assert_allclose(out.loss, want, rtol=1e-5)
    dual = (rewards < 0) & (r > 2.0) & (rm > 0)
    assert dual.sum() >= 1
    np.testing.assert_allclose(out.metrics["clip_frac_dual"], dual.sum() / rm.sum(), rtol=1e-6)
    grad = jax.grad(lambda lp: pg.ppo_loss(lp, logmu, mask, rewards, dual_clip_c=2.0,
                                           record_mask=rm).loss)(jnp.asarray(logp))
    assert np.all(np.asarray(grad)[dual] == 0.0)


@pytest.mark.parametrize("ddof", [0, 1])
@pytest.mark.parametrize(("eps_low", "eps_high", "clip_c"), [(0.2, 0.28, None), (0.2, 0.28, 1.5)])
def test_grpo_clip_higher_dual_clip_and_ddof_equal_verl(ddof, eps_low, eps_high, clip_c):
    logp, logmu, mask, rewards, rm = _batch(7, spread=0.5)
    keep = _real(mask, rm)
    adv = group_advantages(rewards, GROUPS, rm, ddof)
    np.testing.assert_allclose(grpo_advantages(rewards, GROUPS, rm, ddof=ddof), adv, rtol=1e-5)

    def ours(lp):
        return pg.grpo_loss(lp, logmu, mask, rewards, GROUPS, clip_eps_low=eps_low,
                            clip_eps_high=eps_high, dual_clip_c=clip_c, std_ddof=ddof,
                            record_mask=rm).loss

    c = math.inf if clip_c is None else clip_c

    def peer(lp):
        return verl_policy_loss(lp, logmu, mask, adv, rm, eps_low, eps_high, c, "token-mean")

    value, grad = _jax_value_grad(ours, logp)
    np.testing.assert_allclose(value, peer(logp), rtol=1e-5)
    _assert_grad(grad, _fd_grad(peer, logp, keep), keep)
    _assert_exercised(pg.grpo_loss(logp, logmu, mask, rewards, GROUPS, clip_eps_low=eps_low,
                                   clip_eps_high=eps_high, dual_clip_c=clip_c, std_ddof=ddof,
                                   record_mask=rm), clip_c)
    if clip_c is None:
        np.testing.assert_allclose(
            value, dapo_clip_higher(logp, logmu, mask, adv, rm, eps_low, eps_high), rtol=1e-5)


def test_ddof_changes_the_advantage_scale_by_the_bessel_factor():
    """Group of n: ddof=1 divides by a std larger by sqrt(n/(n−1))."""
    rewards = np.array([1.0, -1.0, -1.0, 2.0, 0.0], np.float32)
    groups = np.zeros(5, np.int32)
    a0 = np.asarray(grpo_advantages(rewards, groups, ddof=0), np.float64)
    a1 = np.asarray(grpo_advantages(rewards, groups, ddof=1), np.float64)
    np.testing.assert_allclose(a0 / a1, math.sqrt(5 / 4), rtol=1e-5)


def test_clip_options_refuse_bad_values():
    logp, logmu, mask, rewards, rm = _batch(8)
    with pytest.raises(ValueError, match="clip_eps_high must satisfy ε ≥ 0"):
        pg.ppo_loss(logp, logmu, mask, rewards, clip_eps_high=-0.1)
    with pytest.raises(ValueError, match="clip_eps_low must satisfy 0 ≤ ε ≤ 1"):
        pg.grpo_loss(logp, logmu, mask, rewards, GROUPS, clip_eps_low=1.5)
    with pytest.raises(ValueError, match="dual_clip_c must be a scalar > 1"):
        pg.ppo_loss(logp, logmu, mask, rewards, dual_clip_c=1.0)
    with pytest.raises(ValueError, match="ddof"):
        pg.grpo_loss(logp, logmu, mask, rewards, GROUPS, std_ddof=2)
    with pytest.raises(ValueError, match="ratio_level"):
        pg.ppo_loss(logp, logmu, mask, rewards, ratio_level="geometric")


# ----------------------------------------------------------------------------- public path


VOCAB, D = 11, 5


def _config(name: str, **loss):
    return config_from_dict({"loss": {"name": name, "logprob_chunk_size": 4, **loss},
                             "train": {"batch_size": B, "max_seq_len": T}})


def _model_batch(seed: int):
    """A tiny Batch and hidden/unembed whose log-probs NumPy recomputes (float64)."""
    rng = np.random.default_rng(seed)
    _, logmu, mask, rewards, rm = _batch(seed)
    targets = rng.integers(0, VOCAB, (B, T)).astype(np.int32)
    hidden = rng.normal(size=(B, T, D)).astype(np.float32)
    unembed = rng.normal(size=(D, VOCAB)).astype(np.float32)
    logits = np.einsum("btd,dv->btv", hidden.astype(np.float64), unembed)
    logsm = logits - logits.max(-1, keepdims=True)
    logsm -= np.log(np.exp(logsm).sum(-1, keepdims=True))
    logp = np.take_along_axis(logsm, targets[..., None], -1)[..., 0]
    # μ near π so ratios straddle the clip bounds; NaN-free zeros on padding (as the loader).
    logmu = np.where(mask > 0, logp + rng.normal(0, 0.3, (B, T)), 0.0).astype(np.float32)
    batch = Batch(
        inputs=targets, targets=targets,
        positions=np.tile(np.arange(T, dtype=np.int32), (B, 1)),
        segment_ids=np.ones((B, T), np.int32), loss_mask=mask, behavior_logprobs=logmu,
        mu_logprobs=logmu, ref_logprobs=np.zeros((B, T), np.float32), rewards=rewards,
        correct=rewards > 0, group_ids=GROUPS, record_mask=rm,
        pair_index=np.zeros((0, 2), np.int32),
    )
    return batch, jnp.asarray(hidden), jnp.asarray(unembed), logp, logmu, mask, rewards, rm


def test_public_path_topr_geometric_ratio():
    batch, hidden, unembed, logp, logmu, mask, rewards, rm = _model_batch(11)
    out = compute_loss(_config("topr", ratio_level="geometric"), batch, hidden, unembed)
    want = topr_value_000(logp, logmu, mask, rewards, rm, pg.topr_preset("topr"), "geometric",
                          "record")
    np.testing.assert_allclose(float(out.loss), want, rtol=1e-5)


def test_public_path_tis_token_mean():
    batch, hidden, unembed, logp, logmu, mask, rewards, rm = _model_batch(12)
    out = compute_loss(_config("tis", ratio_level="token", aggregation="token-mean"), batch,
                       hidden, unembed)
    want = topr_value_000(logp, logmu, mask, rewards, rm, pg.topr_preset("tis"), "token",
                          "token-mean")
    np.testing.assert_allclose(float(out.loss), want, rtol=1e-5)
    assert float(out.weight) == _real(mask, rm).sum()


def test_public_path_ppo_clip_higher_dual_clip():
    batch, hidden, unembed, logp, logmu, mask, rewards, rm = _model_batch(13)
    config = _config("ppo", ratio_level="token", clip_eps_low=0.1, clip_eps_high=0.3,
                     dual_clip_c=1.5, baseline=0.2)
    out = compute_loss(config, batch, hidden, unembed)
    want = verl_policy_loss(logp, logmu, mask, rewards - 0.2, rm, 0.1, 0.3, 1.5, "token-mean")
    np.testing.assert_allclose(float(out.loss), want, rtol=1e-5)
    _assert_exercised(out, 1.5)


def test_public_path_grpo_clip_higher_dual_clip_ddof1():
    batch, hidden, unembed, logp, logmu, mask, rewards, rm = _model_batch(14)
    config = _config("grpo", clip_eps_low=0.2, clip_eps_high=0.28, dual_clip_c=1.5, std_ddof=1,
                     aggregation="seq-mean-token-mean")
    out = compute_loss(config, batch, hidden, unembed)
    adv = group_advantages(rewards, GROUPS, rm, 1)
    want = verl_policy_loss(logp, logmu, mask, adv, rm, 0.2, 0.28, 1.5, "seq-mean-token-mean")
    np.testing.assert_allclose(float(out.loss), want, rtol=1e-5)
    _assert_exercised(out, 1.5)
    # ddof matters here: the ddof=0 advantages give another value.
    adv0 = group_advantages(rewards, GROUPS, rm, 0)
    assert abs(verl_policy_loss(logp, logmu, mask, adv0, rm, 0.2, 0.28, 1.5,
                                "seq-mean-token-mean") - want) > 1e-4
    default = compute_loss(_config("grpo"), batch, hidden, unembed)  # ddof 0, ε = 0.2
    want0 = verl_policy_loss(logp, logmu, mask, group_advantages(rewards, GROUPS, rm, 0), rm,
                             0.2, 0.2, math.inf, "token-mean")
    np.testing.assert_allclose(float(default.loss), want0, rtol=1e-5)


@pytest.mark.parametrize(("loss", "match"), [
    ({"name": "ppo", "clip_eps_high": -0.1}, r"clip_eps_high.*greater than or equal to 0"),
    ({"name": "grpo", "clip_eps_low": 1.2}, r"clip_eps_low.*less than or equal to 1"),
    ({"name": "ppo", "dual_clip_c": 1.0}, r"dual_clip_c.*dual clip needs c > 1"),
    ({"name": "grpo", "std_ddof": 2}, r"std_ddof"),
    ({"name": "ppo", "ratio_level": "geometric"}, r"loss\.ratio_level=geometric has no effect"),
    ({"name": "topr", "dual_clip_c": 3.0}, r"loss\.dual_clip_c has no effect with loss\.name=topr"),
    ({"name": "dr_grpo", "std_ddof": 1}, r"loss\.std_ddof has no effect"),
    ({"name": "dr_grpo", "aggregation": "token-mean"}, r"loss\.aggregation has no effect"),
    ({"name": "ppo", "aggregation": "token-mean"}, r"loss\.aggregation has no effect.*ratio_level"),
    ({"name": "topr", "length_norm": False, "aggregation": "token-mean"},
     r"loss\.length_norm=false and loss\.aggregation=token-mean"),
    # sft and reinforce read no μ: a ratio bound would weigh records by π/μ over zeros
    ({"name": "reinforce", "a_neg": 0.5}, r"loss\.a_neg=0\.5 with loss\.name=reinforce.*μ of zeros"),
    ({"name": "sft", "b_pos": 2.0}, r"loss\.b_pos=2\.0 with loss\.name=sft.*topr, tis, opr"),
    # a loss whose advantages come from elsewhere never reads loss.baseline
    ({"name": "grpo", "baseline": 0.3}, r"loss\.baseline=0\.3 has no effect with loss\.name=grpo"),
    ({"name": "dpo", "baseline": -0.3}, r"loss\.baseline=-0\.3 has no effect with loss\.name=dpo"),
])
def test_config_refuses_bad_or_unread_options(loss, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict({"loss": loss})
