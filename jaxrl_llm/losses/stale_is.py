"""Importance-weighted policy gradients for stale or mismatched samples: CISPO, GSPO, IcePop,
M2PO and VESPO.

Each kernel reads per-token log-probs of the policy `logp` (π_θ) and of the sampling policy
`logmu` (μ), the completion `mask`, and per-record rewards with their `group_ids`; the
advantages are GRPO's group-normalised `Â = (R − mean_g R)/(std_g R + 1e-6)`
(`advantages.grpo_advantages`, FPA arXiv:2509.19893 eq. 34), or the given `advantages [B]`
when the caller computed them on the full batch. Same contract as every kernel
(`losses.common`): `LossOutput(total, weight, metrics)` with loss = `total / weight`.

The trainer takes one gradient step per batch, so the "old" policy of each paper's objective
(the one its ratio divides by, besides μ) is the current π_θ under stop-gradient: every ratio
here is π_θ/μ, and docs/kernels.md § Stale-sample losses gives each formula and its source.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from jaxrl_llm.losses.advantages import check_ddof, grpo_advantages
from jaxrl_llm.losses.common import (
    LOG_RATIO_CAP,
    Array,
    Scalar,
    aggregate,
    check_choice,
    check_records,
    check_tokens,
    masked,
    token_record_weights,
    wmax,
    wmean,
)
from jaxrl_llm.losses.ppo import clip_bounds, clipped_surrogate
from jaxrl_llm.losses.types import LossOutput

IcePopLevel = Literal["token", "sequence"]
IcePopAggregation = Literal["token-mean", "seq-mean-token-mean"]
M2POTokens = Literal["trust_region", "all_tokens"]
sg = jax.lax.stop_gradient


def _concrete(value: object) -> float | None:
    """The float of a concrete scalar; None for a traced one (schedules pass unchecked)."""
    return None if isinstance(value, jax.core.Tracer) else float(value)  # type: ignore[arg-type]


def _prepare(
    logp: Array, logmu: Array, mask: Array, rewards: Array, group_ids: Array,
    advantages: Array | None, record_mask: Array | None, std_ddof: int,
) -> tuple[Array, Array, Array, Array]:
    """Checked inputs as `(m, rm, Â, log r)`: token and record weights, advantages [B] and the
    per-token log-ratio `log π_t − log μ_t` (0 off the mask, so padding garbage never enters)."""
    check_ddof(std_ddof)
    b, _ = check_tokens(logp=logp, logmu=logmu, mask=mask)
    check_records(b, rewards=rewards, group_ids=group_ids, advantages=advantages,
                   record_mask=record_mask)
    m, rm = token_record_weights(mask, record_mask, b)
    if advantages is None:
        adv = grpo_advantages(jnp.asarray(rewards, jnp.float32), group_ids, rm,
                              scale_by_std=True, ddof=std_ddof)
    else:
        adv = jnp.where(rm > 0, jnp.asarray(advantages, jnp.float32), 0.0)
    return m, rm, adv, masked(logp, m) - masked(logmu, m)


def _ratio_metrics(ell: Array, w: Array, adv: Array, rm: Array) -> dict[str, Array]:
    """Token log-ratio statistics every μ-loss reports (the trainer checks log π/μ ≈ 0 at
    step 1), and the mean advantage."""
    return {"log_ratio_mean": wmean(ell, w), "log_ratio_max": wmax(ell, w),
            "advantage_mean": wmean(adv, rm), "advantage_abs_mean": wmean(jnp.abs(adv), rm)}


# ----------------------------------------------------------------------------------- CISPO


def cispo_loss(
    logp: Array, logmu: Array, mask: Array, rewards: Array, group_ids: Array, *,
    eps_low: Scalar | None = None,
    eps_high: Scalar = 0.28,
    std_ddof: int = 0,
    advantages: Array | None = None,
    record_mask: Array | None = None,
    log_ratio_cap: float = LOG_RATIO_CAP,
) -> LossOutput:
    """CISPO (MiniMax-M1, arXiv:2506.13585 eq. 4–5): per token
    `−sg(clip(r_t, 1 − ε_low, 1 + ε_high))·Â·log π_t`, `r_t = π_t/μ_t`, averaged over all
    completion tokens of the batch (eq. 4's `1/Σ_i|o_i|`).

    `eps_low=None` sets no lower bound (the paper: "we did not impose a lower bound on the IS
    weight"); `eps_high` (ε_high^IS, the one the paper tunes) defaults to 0.28 as Trinity-RFT's
    CISPO. Clipped tokens keep their gradient: only the weight is bounded.
    """
    m, rm, adv, ell = _prepare(logp, logmu, mask, rewards, group_ids, advantages, record_mask,
                               std_ddof)
    eps_low_, eps_high_ = clip_bounds(1.0 if eps_low is None else eps_low, None, eps_high)
    lower = 0.0 if eps_low is None else 1.0 - eps_low_
    r = jnp.exp(jnp.minimum(ell, log_ratio_cap))
    # the weight is a stop-gradient coefficient (eq. 4): clipping it never zeroes a gradient
    weight_t = sg(jnp.clip(r, lower, 1.0 + eps_high_))
    per_token = -weight_t * adv[:, None] * masked(logp, m)
    total, weight = aggregate(per_token, m, "token-mean", record_mask=rm)
    w = m * rm[:, None]
    metrics = _ratio_metrics(ell, w, adv, rm)
    metrics.update(
        clip_frac_high=wmean((r > 1.0 + eps_high_).astype(jnp.float32), w),
        clip_frac_low=wmean((r < lower).astype(jnp.float32), w),
        is_weight_mean=wmean(weight_t, w),
    )
    return LossOutput(total, weight, metrics)


# ------------------------------------------------------------------------------------ GSPO


def gspo_loss(
    logp: Array, logmu: Array, mask: Array, rewards: Array, group_ids: Array, *,
    eps_low: Scalar = 3e-4,
    eps_high: Scalar = 4e-4,
    std_ddof: int = 0,
    advantages: Array | None = None,
    record_mask: Array | None = None,
    log_ratio_cap: float = LOG_RATIO_CAP,
) -> LossOutput:
    """GSPO (arXiv:2507.18071 eq. 5–7): per record `−min(s_i Â_i, clip(s_i, 1−ε_low, 1+ε_high) Â_i)`
    with the length-normalised sequence ratio `s_i = exp(mean_t (log π_t − log μ_t))`,
    averaged over records (eq. 5's `1/G Σ_i`).

    Defaults ε_low = 3e-4, ε_high = 4e-4 are the paper's experimental setting. GSPO-token
    (its per-token form) has the same value and gradient when the advantage is per sequence,
    as it always is here.
    """
    m, rm, adv, ell = _prepare(logp, logmu, mask, rewards, group_ids, advantages, record_mask,
                               std_ddof)
    eps_low_, eps_high_ = clip_bounds(eps_low, None, eps_high)
    lengths = jnp.sum(m, axis=-1)
    log_s = jnp.sum(ell * m, axis=-1) / jnp.maximum(lengths, 1.0)  # eq. 7: geometric mean
    per_record, clipped, _ = clipped_surrogate(log_s, adv, eps_low_, eps_high_, None,
                                                log_ratio_cap)
    has_tokens = rm * (lengths > 0)  # an empty completion has no ratio and adds nothing
    total, weight = jnp.sum(has_tokens * per_record), jnp.sum(rm)
    metrics = _ratio_metrics(ell, m * rm[:, None], adv, rm)
    metrics.update(
        clip_frac=wmean(clipped.astype(jnp.float32), has_tokens),
        seq_log_ratio_mean=wmean(log_s, has_tokens),
        seq_log_ratio_max=wmax(log_s, has_tokens),
    )
    return LossOutput(total, weight, metrics)


# ---------------------------------------------------------------------------------- IcePop


def check_interval(alpha: Scalar, beta: Scalar) -> None:
    """IcePop's interval needs `0 ≤ α < β` (concrete values; traced ones pass)."""
    a, b = _concrete(alpha), _concrete(beta)
    if a is not None and not a >= 0:
        raise ValueError(f"alpha must be ≥ 0 (a ratio bound), got {a}")
    if a is not None and b is not None and not a < b:
        raise ValueError(f"alpha must be < beta (the kept ratio interval [α, β]), got {a} ≥ {b}")


def icepop_loss(
    logp: Array, logmu: Array, mask: Array, rewards: Array, group_ids: Array, *,
    alpha: Scalar = 0.5,
    beta: Scalar = 5.0,
    level: IcePopLevel = "token",
    aggregation: IcePopAggregation = "token-mean",
    std_ddof: int = 0,
    advantages: Array | None = None,
    record_mask: Array | None = None,
    log_ratio_cap: float = LOG_RATIO_CAP,
) -> LossOutput:
    """IcePop (arXiv:2510.18855, masked importance sampling): per token
    `−M(k)·sg(k)·Â·π_t/sg(π_t)` with `M(k) = 1[α ≤ k ≤ β]`, averaged over all tokens
    (`aggregation="token-mean"`, the default) or, as the paper's GRPO objective
    `1/G Σ_i 1/|o_i| Σ_t`, per record then over records (`"seq-mean-token-mean"`).

    The paper multiplies GRPO's clipped term by `M(k)` with `k = π_train(θ_old)/π_infer`; one
    update per batch makes θ_old = θ, so the PPO ratio is 1 (its clip inactive) and the term
    is the masked, ratio-weighted policy gradient (TRL's `vllm_importance_sampling_mode`
    `token_mask`/`sequence_mask`). `level="token"`: `k = π_t/μ_t` per token; `"sequence"`:
    `k = Π_t π_t/μ_t` per record (TRL's product), masking or keeping the whole record.
    Defaults α = 0.5, β = 5 are the paper's.
    """
    check_choice("level", level, ("token", "sequence"))
    check_choice("aggregation", aggregation, ("token-mean", "seq-mean-token-mean"))
    check_interval(alpha, beta)
    m, rm, adv, ell = _prepare(logp, logmu, mask, rewards, group_ids, advantages, record_mask,
                               std_ddof)
    log_k = ell if level == "token" else jnp.sum(ell * m, axis=-1, keepdims=True)
    k = jnp.exp(jnp.minimum(log_k, log_ratio_cap)) * jnp.ones_like(ell)
    keep = (k >= alpha) & (k <= beta)  # closed interval: a ratio on a bound is kept
    lp = masked(logp, m)
    # value M·k·Â, gradient M·k·Â·∇log π: k is a coefficient, as in TRL's detached is_ratio
    per_token = -jnp.where(keep, sg(k), 0.0) * adv[:, None] * jnp.exp(lp - sg(lp))
    total, weight = aggregate(per_token, m, aggregation, record_mask=rm)
    w = m * rm[:, None]
    metrics = _ratio_metrics(ell, w, adv, rm)
    metrics.update(
        masked_frac=wmean((~keep).astype(jnp.float32), w),
        masked_frac_low=wmean((k < alpha).astype(jnp.float32), w),
        masked_frac_high=wmean((k > beta).astype(jnp.float32), w),
        is_weight_mean=wmean(k, w * keep),
    )
    return LossOutput(total, weight, metrics)


# ------------------------------------------------------------------------------------ M2PO


def m2po_keep_mask(log_ratio: Array, valid: Array, tau: Scalar) -> Array:
    """M2PO's drop loop over the tokens where `valid` (arXiv:2510.01161 Algorithm 1): while
    the mean of `(log r)²` over them is > τ, drop the one with the largest `(log r)²`.

    The smallest such number k of dropped tokens is taken; when no k leaves a token (every
    suffix mean > τ) all of them are dropped. Ties break by position (a stable sort, the
    first of equal values dropped first). Returns the boolean keep mask, shape of
    `log_ratio`; tokens outside `valid` are False (`m2po_loss` decides which tokens enter).
    """
    shape = jnp.shape(log_ratio)
    v = jnp.reshape(valid, (-1,))
    m2 = jnp.where(v, jnp.square(jnp.reshape(log_ratio, (-1,)).astype(jnp.float32)), 0.0)
    order = jnp.argsort(jnp.where(v, -m2, 1.0), stable=True)  # largest first, invalid last
    s = m2[order]
    n = jnp.sum(v)
    idx = jnp.arange(s.shape[0])
    suffix = jnp.cumsum(s[::-1])[::-1]  # Σ of the kept after dropping the first idx
    ok = (idx < n) & (suffix <= jnp.asarray(tau, jnp.float32) * (n - idx))
    drop = jnp.where(jnp.any(ok), jnp.argmax(ok), n)
    rank = jnp.zeros_like(order).at[order].set(idx)
    return jnp.reshape(v & (rank >= drop), shape)


def m2po_trust_region(log_ratio: Array, advantages: Array, valid: Array) -> Array:
    """The tokens the paper's M2PO constrains (arXiv:2510.01161 Algorithm 1; §5.2 "only
    constrain trust-region tokens"): those an ascent step on `r·Â` pushes further from
    r = 1, `(Â > 0 and r > 1) or (Â < 0 and r < 1)`. `log_ratio` [B, T] (log r, r = π/μ),
    `advantages` [B]; a token with Â = 0 or r = 1 is outside."""
    a = jnp.asarray(advantages)[:, None]
    return valid & (((a > 0) & (log_ratio > 0)) | ((a < 0) & (log_ratio < 0)))


def m2po_mask(log_ratio: Array, advantages: Array, valid: Array, tau: Scalar,
              tokens: M2POTokens = "trust_region") -> Array:
    """M2PO's keep mask `M` [B, T]: the drop loop (`m2po_keep_mask`) over the
    `m2po_trust_region` tokens, every other valid token kept (`tokens="trust_region"`, the
    paper's), or over every valid token (`"all_tokens"`, AReaL's)."""
    check_choice("mask_tokens", tokens, ("trust_region", "all_tokens"))
    region = valid if tokens == "all_tokens" else m2po_trust_region(log_ratio, advantages, valid)
    return (valid & ~region) | m2po_keep_mask(log_ratio, region, tau)


def m2po_loss(
    logp: Array, logmu: Array, mask: Array, rewards: Array, group_ids: Array, *,
    tau: Scalar = 0.04,
    mask_tokens: M2POTokens = "trust_region",
    std_ddof: int = 0,
    advantages: Array | None = None,
    record_mask: Array | None = None,
    log_ratio_cap: float = LOG_RATIO_CAP,
) -> LossOutput:
    """M2PO (arXiv:2510.01161): per token `−M_t·r_t·Â`, `r_t = π_t/μ_t` unclipped, averaged
    over all completion tokens `1/Σ_i|o_i|` (AReaL's docs/en/algorithms/m2po.md objective),
    τ_M2 = 0.04 (paper). `M` runs `m2po_keep_mask` on `sg(log r_t)`, r at the step (π_θ/μ):

    - `mask_tokens="trust_region"` (default, the paper's Algorithm 1): the second moment and
      the drop loop cover only the `m2po_trust_region` tokens; every other token is kept;
    - `"all_tokens"` (AReaL's `_get_m2po_loss_mask`, Oct 2025): every completion token.

    `metrics`: `m2` (all tokens), `m2_kept` (kept tokens), `masked_frac`, `region_frac` (the
    share of tokens the mask covers: 1 with `all_tokens`).

    The mask couples every token of the batch, so the registry marks m2po `full_batch`.
    """
    t = _concrete(tau)
    if t is not None and not t > 0:
        raise ValueError(f"tau must be > 0 (the second-moment budget τ_M2), got {t}")
    m, rm, adv, ell = _prepare(logp, logmu, mask, rewards, group_ids, advantages, record_mask,
                               std_ddof)
    valid, log_r = m > 0, sg(ell)  # the mask reads r at the step under stop-gradient
    keep = m2po_mask(log_r, adv, valid, tau, mask_tokens)
    region = valid if mask_tokens == "all_tokens" else m2po_trust_region(log_r, adv, valid)
    r = jnp.exp(jnp.minimum(ell, log_ratio_cap))
    per_token = -jnp.where(keep, r, 0.0) * adv[:, None]
    total, weight = aggregate(per_token, m, "token-mean", record_mask=rm)
    w = m * rm[:, None]
    sq = jnp.square(log_r)
    metrics = _ratio_metrics(ell, w, adv, rm)
    metrics.update(
        m2=wmean(sq, w),
        m2_kept=wmean(sq, w * keep),
        masked_frac=wmean((valid & ~keep).astype(jnp.float32), w),
        region_frac=wmean(region.astype(jnp.float32), w),
    )
    return LossOutput(total, weight, metrics)


# ----------------------------------------------------------------------------------- VESPO


def vespo_loss(
    logp: Array, logmu: Array, mask: Array, rewards: Array, group_ids: Array, *,
    k_pos: Scalar = 2.0,
    lambda_pos: Scalar = 3.0,
    k_neg: Scalar = 3.0,
    lambda_neg: Scalar = 2.0,
    std_ddof: int = 0,
    advantages: Array | None = None,
    record_mask: Array | None = None,
) -> LossOutput:
    """VESPO (arXiv:2602.10693): per token `−sg(φ(W))·Â·log π_t`, averaged over all tokens,
    with the sequence ratio `W = Π_t π_t/μ_t` and `φ(W) = W^k·e^{λ(1−W)}` (φ(1) = 1), shapes
    (k, λ) by the sign of Â: (k_pos, λ_pos) for Â ≥ 0, else (k_neg, λ_neg).

    Transcribed from the reference `compute_policy_loss_vespo` (github.com/FloyedShen/VESPO,
    recipe/vespo/code/core_algos.py): per-token log-ratios clamped to ±20, their sum clamped
    to ±20, `log W` floored at log 1e-8, λ floored at 1e-4, non-finite φ set to 0; defaults
    (2, 3, 3, 2) and `token-mean` are its code and run scripts'.
    """
    m, rm, adv, ell = _prepare(logp, logmu, mask, rewards, group_ids, advantages, record_mask,
                               std_ddof)
    seq_log_w = jnp.clip(jnp.sum(jnp.clip(ell, -20.0, 20.0) * m, axis=-1), -20.0, 20.0)
    big_w = jnp.exp(sg(seq_log_w))
    pos = adv >= 0
    k = jnp.where(pos, k_pos, k_neg)
    lam = jnp.maximum(jnp.where(pos, lambda_pos, lambda_neg), 1e-4)
    log_phi = lam + k * jnp.log(jnp.maximum(big_w, 1e-8)) - lam * big_w
    phi = sg(jnp.nan_to_num(jnp.exp(log_phi), nan=0.0, posinf=0.0, neginf=0.0))
    per_token = -phi[:, None] * adv[:, None] * masked(logp, m)
    total, weight = aggregate(per_token, m, "token-mean", record_mask=rm)
    metrics = _ratio_metrics(ell, m * rm[:, None], adv, rm)
    metrics.update(
        seq_log_ratio_mean=wmean(seq_log_w, rm),
        phi_mean=wmean(phi, rm),
        phi_max=wmax(phi, rm),
    )
    return LossOutput(total, weight, metrics)
