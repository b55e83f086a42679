"""Policy-gradient loss kernels: the TOPR family (TOPR arXiv:2503.14286) and its presets, and
AsymRE (arXiv:2506.20520), TOPR's own line: off-policy REINFORCE with a baseline below V^μ.

Every loss has the contract

    fn(per-token arrays [B, T], mask [B, T], per-record arrays [B], *, static options)
        -> LossOutput(total, weight, metrics)

with loss = `total / weight`, so summing `total` and `weight` over micro-batches and devices
gives the exact full-batch loss. Inputs are per-token log-probs (computed elsewhere, e.g.
`losses.logprobs.token_logprobs`); nothing here sees a model. Masks, record weights and the
log-ratio cap follow `losses.common`.

This module also re-exports the other policy-gradient kernels, so `policy_gradient.X` keeps
working for all of them: PPO / GRPO / Dr.GRPO live in `losses.ppo`, Off-RL / FPA and the KL
terms in `losses.off_rl`, the aggregation modes in `losses.common`.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from jaxrl_llm.losses.advantages import grpo_advantages
from jaxrl_llm.losses.common import (  # noqa: F401 (re-exported)
    AGGREGATIONS,
    LOG_RATIO_CAP,
    Aggregation,
    Array,
    Scalar,
    aggregate,
    aggregate_records,
    check_choice,
    check_records,
    check_tokens,
    completion_lengths,
    group_batch,
    masked,
    record_weights,
    safe_len,
    sequence_logprob,
    token_record_weights,
    wmax,
    wmean,
)
from jaxrl_llm.losses.off_rl import (  # noqa: F401 (re-exported)
    KL_DELTA_CLAMP,
    fpa_loss,
    kl_penalty,
    kl_per_record,
    kl_token_values,
    off_rl_kl_loss,
    off_rl_loss,
    token_forward_kl,
)
from jaxrl_llm.losses.ppo import dr_grpo_loss, grpo_loss, ppo_loss  # noqa: F401 (re-exported)
from jaxrl_llm.losses.types import LossOutput

# "sequence": r = π(y)/μ(y) (TOPR's); "token": r_t = π_t/μ_t per token; "geometric": the
# length-normalised r̄ = (π(y)/μ(y))^{1/|y|}, the geometric mean of the token ratios.
RatioLevel = Literal["sequence", "token", "geometric"]
RATIO_LEVELS: tuple[str, ...] = ("sequence", "token", "geometric")

# TOPR Table 1 (docs/kernels.md § TOPR family): truncation limits of each named member of the TOPR family.
TOPR_PRESETS: dict[str, dict[str, float]] = {
    "sft": {"a_pos": 1.0, "b_pos": 1.0, "a_neg": 0.0, "b_neg": 0.0},
    "reinforce": {"a_pos": 1.0, "b_pos": 1.0, "a_neg": 1.0, "b_neg": 1.0},
    "opr": {"a_pos": 0.0, "b_pos": float("inf"), "a_neg": 0.0, "b_neg": float("inf")},
    "tis": {"a_pos": 0.0, "b_pos": 1.0, "a_neg": 0.0, "b_neg": 1.0},
    "topr": {"a_pos": 1.0, "b_pos": 1.0, "a_neg": 0.0, "b_neg": 1.0},
}


def topr_preset(name: str) -> dict[str, float]:
    """Truncation limits `{a_pos, b_pos, a_neg, b_neg}` of a TOPR Table 1 preset."""
    if name not in TOPR_PRESETS:
        raise ValueError(f"unknown TOPR preset {name!r}; choose one of {sorted(TOPR_PRESETS)}")
    return dict(TOPR_PRESETS[name])


def topr_bounds(name: str, **overrides: Scalar | None) -> dict[str, Scalar]:
    """A preset's bounds with the non-None `overrides` (a_pos, b_pos, a_neg, b_neg) applied.

    Matches `LossConfig`, where a bound left at None means "the preset named by `name`".
    """
    unknown = set(overrides) - {"a_pos", "b_pos", "a_neg", "b_neg"}
    if unknown:
        raise ValueError(f"unknown TOPR bound(s) {sorted(unknown)}")
    bounds: dict[str, Scalar] = dict(topr_preset(name))
    bounds.update({k: v for k, v in overrides.items() if v is not None})
    return bounds


def _check_bounds(**bounds: Scalar) -> None:
    """Concrete truncation bounds must be ≥ 0 scalars (traced schedule values pass through)."""
    for name, value in bounds.items():
        if jnp.ndim(value) != 0:
            raise ValueError(f"{name} must be a scalar, got shape {jnp.shape(value)}")
        if not isinstance(value, jax.core.Tracer) and float(value) < 0:
            raise ValueError(f"{name} must be ≥ 0, got {float(value)}")
    for lo, hi in (("a_pos", "b_pos"), ("a_neg", "b_neg")):
        a, b = bounds.get(lo), bounds.get(hi)
        if a is None or b is None:
            continue
        if not isinstance(a, jax.core.Tracer) and not isinstance(b, jax.core.Tracer):
            if float(a) > float(b):
                raise ValueError(f"{lo} = {float(a)} must be ≤ {hi} = {float(b)} (docs/kernels.md § TOPR family)")




def _log_bounds(a: Scalar, b: Scalar, cap: float) -> tuple[Array, Array]:
    """`log a`, `min(log b, cap)` with log 0 = −inf (and b = inf → cap), no NaN anywhere."""
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    lo = jnp.where(a > 0, jnp.log(jnp.where(a > 0, a, 1.0)), -jnp.inf)
    hi = jnp.where(b > 0, jnp.minimum(jnp.log(jnp.where(b > 0, b, 1.0)), cap), -jnp.inf)
    return lo, hi


def taper(log_ratio: Array, log_a: Array, log_b: Array) -> tuple[Array, Array]:
    """The taper function of TOPR eq. 11 evaluated from `ℓ = log x`, and its weight.

    With `ℓ_c = [ℓ]_{log a}^{log b}` and `α = exp(ℓ_c) = [x]_a^b`:

        ρ(x, a, b) = α (1 + ℓ − ℓ_c)

    which is `a(1 + log(x/a))` below `a`, `b(1 + log(x/b))` above `b`, and `x` between, and
    `∂ρ/∂ℓ = α` everywhere. `log_a = −inf` (a = 0) and `log_b = −inf` (b = 0, α ≡ 0) are
    exact: the formula never forms `0 · inf`.
    """
    ell_c = jnp.minimum(jnp.maximum(log_ratio, log_a), log_b)
    alpha = jnp.exp(ell_c)
    finite_c = jnp.isfinite(ell_c)
    rho = alpha * (1.0 + log_ratio - jnp.where(finite_c, ell_c, log_ratio))
    return rho, alpha


def _sign_split_metrics(
    log_ratio: Array, w: Array, positive: Array, lo: Array, hi: Array
) -> dict[str, Array]:
    """Clip fractions at each bound among positive / negative units, and their log-ratios."""
    wp = w * positive
    wn = w * (1.0 - positive)
    below = (log_ratio < lo).astype(jnp.float32)
    above = (log_ratio > hi).astype(jnp.float32)
    return {
        "clip_frac_pos_low": wmean(below, wp),
        "clip_frac_pos_high": wmean(above, wp),
        "clip_frac_neg_low": wmean(below, wn),
        "clip_frac_neg_high": wmean(above, wn),
        "log_ratio_mean_pos": wmean(log_ratio, wp),
        "log_ratio_mean_neg": wmean(log_ratio, wn),
    }


def _log_ess(log_alpha: Array, w: Array) -> Array:
    """Effective sample size `(Σ w α)² / Σ w α²` of weights `α = exp(log_alpha)`, in log space."""
    w = jnp.where(w > 0, w, 0.0)
    la = jnp.where(w > 0, log_alpha, -jnp.inf)
    s1 = jax.nn.logsumexp(la, b=w)
    s2 = jax.nn.logsumexp(2.0 * la, b=w)
    ess = jnp.exp(2.0 * s1 - s2)
    return jnp.where(jnp.isfinite(s1) & jnp.isfinite(s2), ess, 0.0)


# ----------------------------------------------------------------------------- TOPR family


def _taper_sums(
    token_log_ratio: Array, m: Array, lo: Array, hi: Array, ratio_level: RatioLevel
) -> tuple[Array, Array, Array, Array, Array]:
    """Per record `S_b` with `∂S_b/∂log π(y_b) = [r]_a^b` for the chosen ratio `r`, plus the
    metric units: (S [B], unit log-ratios, unit weights m_u, lower, upper log-bounds).

    sequence:  S = ρ(r, a, b),            r = exp(ℓ)
    token:     S = Σ_t m_t ρ(r_t, a, b),  r_t = exp(logπ_t − logμ_t)
    geometric: S = |y| · ρ(r̄, a, b),      r̄ = exp(ℓ/|y|)  (∂S/∂ℓ = [r̄]_a^b by the chain rule)
    """
    if ratio_level == "token":
        rho_t, _ = taper(token_log_ratio, lo[:, None], hi[:, None])
        shape = token_log_ratio.shape
        return (jnp.sum(rho_t * m, axis=-1), token_log_ratio, m,
                jnp.broadcast_to(lo[:, None], shape), jnp.broadcast_to(hi[:, None], shape))
    ell = jnp.sum(token_log_ratio * m, axis=-1)
    ones = jnp.ones_like(ell)
    if ratio_level == "sequence":
        rho, _ = taper(ell, lo, hi)
        return rho, ell, ones, lo, hi
    lengths = jnp.sum(m, axis=-1)
    ell_bar = ell / jnp.maximum(lengths, 1.0)
    rho, _ = taper(ell_bar, lo, hi)
    return lengths * rho, ell_bar, ones, lo, hi


def _topr_aggregation(aggregation: Aggregation | None, length_norm: bool) -> str:
    """The aggregation mode: the given one, else `length_norm`'s per-record normalisation."""
    if aggregation is None:
        return "seq-mean-token-mean" if length_norm else "seq-mean-token-sum"
    check_choice("aggregation", aggregation, AGGREGATIONS)
    if not length_norm:
        raise ValueError(
            f"topr_loss: length_norm=False and aggregation={aggregation!r} both choose the "
            "normalisation; drop length_norm (length_norm=False is "
            "aggregation='seq-mean-token-sum')"
        )
    return aggregation


def topr_loss(
    logp: Array,
    logmu: Array,
    mask: Array,
    rewards: Array,
    *,
    a_pos: Scalar = 1.0,
    b_pos: Scalar = 1.0,
    a_neg: Scalar = 0.0,
    b_neg: Scalar = 1.0,
    baseline: Scalar = 0.0,
    length_norm: bool = True,
    ratio_level: RatioLevel = "sequence",
    aggregation: Aggregation | None = None,
    max_len: int | None = None,
    record_mask: Array | None = None,
    log_ratio_cap: float = LOG_RATIO_CAP,
) -> LossOutput:
    """Tapered off-policy REINFORCE (TOPR arXiv:2503.14286 §3, eq. 7 and 11, Table 1).

    `A = R − baseline` (scalar or [B]); a record is positive when `A ≥ 0`. With
    `ℓ = log π(y|x) − log μ(y|x)` (sequence level) the per-record loss is the taper form

        L = − A · ρ(exp ℓ, a, b) / N(y)        N = |y| if length_norm else 1

    whose value is the (negated, length-normalised) TOPR objective of eq. 11 and whose
    gradient is exactly `− [r]_a^b · A · ∇log π(y|x) / N` (eq. 7). `ratio_level="token"`
    applies the taper to each token's ratio and sums over the tokens; `"geometric"` uses the
    length-normalised ratio `r̄ = exp(ℓ/|y|)` (the geometric mean of the token ratios) with
    `L = − A · |y| · ρ(r̄, a, b) / N`, whose gradient is `− [r̄]_a^b · A · ∇log π(y|x) / N`.

    `aggregation` (verl's names, `common.aggregate_records`) replaces the per-record `N`:
    `"token-mean"` (Trinity-RFT's default) gives `total = Σ_b −A_b S_b`, `weight = Σ_b |y_b|`
    with `S_b` the per-record taper sum — the per-token loss summed over every completion
    token of the batch, divided by their number. None (default) keeps `length_norm`
    (`seq-mean-token-mean` when True, `seq-mean-token-sum` when False).
    `seq-mean-token-sum-norm` divides by the constant `max_len` (default: the padded T).

    Bounds may be traced scalars (schedules, e.g. an annealed upper bound `τ`); `a = 0` and `b = inf`
    are exact. Presets: `TOPR_PRESETS` / `topr_preset(name)`.
    Returns `total`, `weight` of the aggregation (records, or tokens for token-mean).
    """
    check_choice("ratio_level", ratio_level, RATIO_LEVELS)
    mode = _topr_aggregation(aggregation, length_norm)
    b, t = check_tokens(logp=logp, logmu=logmu, mask=mask)
    check_records(b, rewards=rewards, record_mask=record_mask)
    if jnp.shape(baseline) not in ((), (b,)):
        raise ValueError(f"baseline must be a scalar or shape ({b},), got {jnp.shape(baseline)}")
    _check_bounds(a_pos=a_pos, b_pos=b_pos, a_neg=a_neg, b_neg=b_neg)

    m, rm = token_record_weights(mask, record_mask, b)
    adv = jnp.asarray(rewards, jnp.float32) - jnp.asarray(baseline, jnp.float32)
    adv = jnp.where(rm > 0, adv, 0.0)
    positive = adv >= 0
    lo_p, hi_p = _log_bounds(a_pos, b_pos, log_ratio_cap)
    lo_n, hi_n = _log_bounds(a_neg, b_neg, log_ratio_cap)
    token_log_ratio = masked(logp, m) - masked(logmu, m)
    taper_sum, unit_ell, unit_m, lo, hi = _taper_sums(
        token_log_ratio, m, jnp.where(positive, lo_p, lo_n), jnp.where(positive, hi_p, hi_n),
        ratio_level,
    )
    total, weight = aggregate_records(-adv * taper_sum, jnp.sum(m, axis=-1), rm, mode,
                                      t if max_len is None else max_len)

    unit_w = unit_m * (rm if unit_m.ndim == 1 else rm[:, None])
    unit_pos = jnp.broadcast_to(positive.reshape(b, *([1] * (unit_m.ndim - 1))),
                                unit_m.shape).astype(jnp.float32)
    abs_adv = jnp.abs(adv) * rm
    log_alpha = jnp.minimum(jnp.maximum(unit_ell, lo), hi)
    metrics = {
        "objective": -total / jnp.maximum(weight, 1e-12),
        "log_ratio_mean": wmean(unit_ell, unit_w),
        "log_ratio_max": wmax(unit_ell, unit_w),
        "num_pos": jnp.sum(rm * positive),
        "num_neg": jnp.sum(rm * (~positive)),
        "effective_pos_fraction": (
            jnp.sum(abs_adv * positive) / jnp.maximum(jnp.sum(abs_adv), 1e-12)
        ),
        "ess": _log_ess(log_alpha, unit_w),
        **_sign_split_metrics(unit_ell, unit_w, unit_pos, lo, hi),
    }
    metrics["ess_fraction"] = metrics["ess"] / jnp.maximum(jnp.sum(unit_w), 1e-12)
    return LossOutput(total, weight, metrics)


# --------------------------------------------------------------------------------- AsymRE

# δV of the implementation read (Trinity-RFT's `asymre` advantage: group mean + baseline_shift
# −0.1); the paper recommends a slightly negative δV (V < V^μ) for its guarantee.
ASYMRE_DELTA_V = -0.1


def asymre_advantages(rewards: Array, group_ids: Array, record_mask: Array | None = None, *,
                      delta_v: Scalar = ASYMRE_DELTA_V, **_: object) -> Array:
    """AsymRE's `A_i = R_i − V_g`, `V_g = mean_{j∈g} R_j + δV` (the group's mean reward, the
    sample estimate of V^μ, shifted by δV ≤ 0), on whole groups; padding rows get 0."""
    rewards = jnp.asarray(rewards, jnp.float32)
    rm = record_weights(record_mask, rewards.shape[0])
    centred = grpo_advantages(rewards, group_ids, rm, scale_by_std=False)
    return jnp.where(rm > 0, centred - jnp.asarray(delta_v, jnp.float32), 0.0)


def asymre_loss(
    logp: Array,
    mask: Array,
    rewards: Array,
    group_ids: Array,
    *,
    delta_v: Scalar = ASYMRE_DELTA_V,
    length_norm: bool = True,
    aggregation: Aggregation | None = None,
    max_len: int | None = None,
    advantages: Array | None = None,
    record_mask: Array | None = None,
) -> LossOutput:
    """Asymmetric REINFORCE (Arnal et al., arXiv:2506.20520): maximise
    `E_{y∼μ}[log π(y) (r(y) − V)]` with `V = V^μ + δV`, V^μ estimated by the group's mean reward
    (`asymre_advantages`); no importance ratio (μ is not read).

    Per record `L = −A · log π(y) / N(y)`, `N = |y|` (`length_norm`, TOPR's convention) or 1
    (the paper's objective as written); `aggregation` as `topr_loss`'s. Its gradient is that of
    TOPR's `reinforce` preset with the per-record baseline `V` (docs/kernels.md § Async-RL
    objectives relates δV to TOPR eq. 12's baseline-as-composition)."""
    mode = _topr_aggregation(aggregation, length_norm)
    _, t, m, rm, adv = group_batch(
        dict(logp=logp, mask=mask), rewards, group_ids, advantages, record_mask,
        lambda rm: asymre_advantages(rewards, group_ids, rm, delta_v=delta_v))
    seq_logp = jnp.sum(masked(logp, m) * m, axis=-1)
    total, weight = aggregate_records(-adv * seq_logp, jnp.sum(m, axis=-1), rm, mode,
                                      t if max_len is None else max_len)
    positive = adv >= 0
    abs_adv = jnp.abs(adv) * rm
    metrics = {
        "objective": -total / jnp.maximum(weight, 1e-12),
        "num_pos": jnp.sum(rm * positive),
        "num_neg": jnp.sum(rm * (~positive)),
        "effective_pos_fraction": (
            jnp.sum(abs_adv * positive) / jnp.maximum(jnp.sum(abs_adv), 1e-12)),
        "advantage_mean": wmean(adv, rm),
        "baseline_mean": wmean(jnp.asarray(rewards, jnp.float32) - adv, rm),
    }
    return LossOutput(total, weight, metrics)
