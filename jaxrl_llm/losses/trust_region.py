"""Trust regions on the sampled token's probability and on the whole sequence: DPPO and TRM.

**DPPO** (Qi et al., *Rethinking the Trust Region in LLM Reinforcement Learning*,
arXiv:2602.04879) replaces PPO's ratio clip with a mask on a divergence between the sampling
policy μ and π at each token (eq. 11–12), estimated from the sampled token alone by the
Binary approximation: `D_TV = |μ(a_t) − π(a_t)|` (eq. 13) or the KL of the two Bernoulli
distributions (sampled token, everything else) (eq. 14).

**TRM** (Li et al., *Trust Region Masking for Long-Horizon LLM Reinforcement Learning*,
arXiv:2512.23075, equation numbers of its v3 source) masks a whole sequence when its largest
per-token divergence exceeds δ (eq. 22 and Algorithm 1), with the sample estimates of its
appendix "Sample-based approximation": `k2 = ½ (log ρ)²` for the max, `k3 = ρ − 1 − log ρ`
for the optional average.

Both read per-token log-probs of π (`logp`) and μ (`logmu`), the completion `mask`, rewards
and `group_ids`; every ratio is π_θ/μ (the trainer takes one step per batch, so a paper's
"old" policy is μ itself: both papers anchor the trust region to the rollout policy μ).
docs/kernels.md § Async-RL objectives gives each formula, its options and its sources.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from jaxrl_llm.losses.advantages import check_ddof, grpo_advantages
from jaxrl_llm.losses.common import (
    AGGREGATIONS,
    LOG_RATIO_CAP,
    Aggregation,
    Array,
    Scalar,
    aggregate,
    check_choice,
    group_batch,
    masked,
    wmax,
    wmean,
)
from jaxrl_llm.losses.types import LossOutput

Divergence = Literal["tv", "kl"]
sg = jax.lax.stop_gradient

# DPPO's thresholds in its experiments (App. "More Details for Stability Analysis": δ = 0.15
# for TV, 0.05 for KL; the authors' verl script run_qwen30b_dppo.sh uses the same).
DPPO_DELTA = {"tv": 0.15, "kl": 0.05}
# The aggregation both papers' objectives have: a sum over each sequence's tokens, averaged
# over the sequences (DPPO eq. 11 `E_y[Σ_t …]`; TRM eq. 22 normalised by the batch size N).
PAPER_AGGREGATION = "seq-mean-token-sum"


def _concrete(value: object) -> float | None:
    """The float of a concrete scalar; None for a traced one (schedules pass unchecked)."""
    return None if isinstance(value, jax.core.Tracer) else float(value)  # type: ignore[arg-type]


def _positive(name: str, value: Scalar | None) -> None:
    v = None if value is None else _concrete(value)
    if v is not None and not v > 0:
        raise ValueError(f"{name} must be > 0, got {v}")


def group_advantages(
    rewards: Array, group_ids: Array, record_mask: Array | None = None, *,
    scale_by_std: bool, std_ddof: int = 0,
) -> Array:
    """`R − mean_g R`, divided by `std_g R + 1e-6` when `scale_by_std` (FPA arXiv:2509.19893
    eq. 34; `advantages.grpo_advantages`), on whole groups."""
    check_ddof(std_ddof)
    return grpo_advantages(jnp.asarray(rewards, jnp.float32), group_ids, record_mask,
                           scale_by_std=scale_by_std, ddof=std_ddof)


def _prepare(
    logp: Array, logmu: Array, mask: Array, rewards: Array, group_ids: Array,
    advantages: Array | None, record_mask: Array | None, *, scale_by_std: bool, std_ddof: int,
) -> tuple[Array, Array, Array, Array]:
    """Checked inputs as `(m, rm, Â, log r)`: token and record weights, advantages [B] and the
    token log-ratio `log π_t − log μ_t` (0 off the mask: garbage there never enters)."""
    check_ddof(std_ddof)
    _, _, m, rm, adv = group_batch(
        dict(logp=logp, logmu=logmu, mask=mask), rewards, group_ids, advantages, record_mask,
        lambda rm: group_advantages(rewards, group_ids, rm, scale_by_std=scale_by_std,
                                    std_ddof=std_ddof))
    return m, rm, adv, masked(logp, m) - masked(logmu, m)


def _mode(aggregation: Aggregation | None) -> str:
    mode = PAPER_AGGREGATION if aggregation is None else aggregation
    check_choice("aggregation", mode, AGGREGATIONS)
    return mode


def capped_ratio_value(log_ratio: Array, cap: Scalar | None, log_ratio_cap: float) -> Array:
    """A value whose derivative in `log π` is `min(r, C)` (`r = exp(log_ratio)`): `r` up to C,
    `C (1 + log(r/C))` above it (the taper of TOPR arXiv:2503.14286 eq. 11 with a = 0, b = C).
    `cap=None` is `r` itself (C = ∞; the log-ratio is capped at `log_ratio_cap` before exp)."""
    ell = jnp.minimum(log_ratio, log_ratio_cap)
    if cap is None:
        return jnp.exp(ell)
    log_c = jnp.log(jnp.asarray(cap, jnp.float32))
    ell_c = jnp.minimum(ell, log_c)
    return jnp.exp(ell_c) * (1.0 + ell - ell_c)


# ------------------------------------------------------------------------------------ DPPO


def binary_tv(logp: Array, logmu: Array) -> Array:
    """DPPO eq. 13: `|μ(a_t) − π(a_t)|`, the TV distance of the two Bernoulli distributions
    (the sampled token, all the others)."""
    return jnp.abs(jnp.exp(logmu) - jnp.exp(logp))


def _log1mexp(x: Array) -> Array:
    """`log(1 − e^x)` for x ≤ 0, accurate at both ends (−inf at x = 0)."""
    x = jnp.minimum(x, 0.0)
    return jnp.where(x > -0.6931472, jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def binary_kl(logp: Array, logmu: Array) -> Array:
    """DPPO eq. 14: `μ log(μ/π) + (1 − μ) log((1 − μ)/(1 − π))` of the sampled token's
    probabilities, in log space (no `+1e-8` as in the authors' code: +inf when π(a_t) = 1 > μ(a_t))."""
    q = jnp.exp(logmu)
    first = q * (logmu - logp)
    rest = 1.0 - q
    second = jnp.where(rest > 0, rest * (_log1mexp(logmu) - _log1mexp(logp)), 0.0)
    return first + second


def dppo_mask(log_ratio: Array, divergence_t: Array, advantages: Array, valid: Array,
              delta_high: Scalar, delta_low: Scalar) -> Array:
    """DPPO eq. 12: keep a token unless the update pushes it further out of the trust region,
    `(Â > 0 and r > 1 and D > δ_high)` or `(Â < 0 and r < 1 and D > δ_low)`; r = π/μ, D the
    per-token divergence, Â the record's advantage [B]. Boolean [B, T], False off `valid`."""
    a = jnp.asarray(advantages)[:, None]
    out = ((a > 0) & (log_ratio > 0) & (divergence_t > delta_high)) | (
        (a < 0) & (log_ratio < 0) & (divergence_t > delta_low))
    return valid & ~out


def dppo_advantages(rewards: Array, group_ids: Array, record_mask: Array | None = None, *,
                    scale_by_std: bool = False, std_ddof: int = 0, **_: object) -> Array:
    """DPPO's advantages on the full batch (before micro-batching): `R − mean_g R` (§4.1
    after eq. 9, and its experiments: GRPO's without the std), `scale_by_std` divides by it."""
    return group_advantages(rewards, group_ids, record_mask, scale_by_std=scale_by_std,
                            std_ddof=std_ddof)


def dppo_loss(
    logp: Array, logmu: Array, mask: Array, rewards: Array, group_ids: Array, *,
    divergence: Divergence = "tv",
    delta: Scalar | None = None,
    delta_low: Scalar | None = None,
    ratio_cap: Scalar | None = None,
    kl_tau: Scalar = 0.0,
    aggregation: Aggregation | None = None,
    scale_by_std: bool = False,
    std_ddof: int = 0,
    advantages: Array | None = None,
    record_mask: Array | None = None,
    max_len: int | None = None,
    log_ratio_cap: float = LOG_RATIO_CAP,
) -> LossOutput:
    """DPPO (arXiv:2602.04879 eq. 11–14): per token `−M_t·r_t·Â` with the mask `M_t` of eq. 12
    on the Binary divergence `D` (eq. 13 `"tv"`, eq. 14 `"kl"`) between μ and π at the token,
    summed over each sequence and averaged over sequences (eq. 11; `aggregation` changes it).

    - `delta`: δ (for Â > 0, and for Â < 0 unless `delta_low`); None: 0.15 for tv, 0.05 for
      kl (the paper's experiments). `delta_low`: a separate δ for Â < 0 (the authors' verl
      code and prime-rl take two thresholds, `clip_ratio_low/high`, `dppo_mask_low/high`).
    - `ratio_cap` C: the gradient weight `min(r, C)` of the appendix's unified gradient (its
      scaling runs: C = 5); None = ∞ (eq. 11, and the stability runs).
    - `kl_tau`: prime-rl's default loss adds `kl_tau·(log π/μ)²` per token (its 1e-3); 0
      (the paper's objective) by default.

    The gradient is `−M_t·min(r_t, C)·Â·∇log π_t` (+ `2 kl_tau log r_t ∇log π_t`); the mask is
    computed under stop-gradient. Advantages: `dppo_advantages` unless given.
    """
    check_choice("divergence", divergence, ("tv", "kl"))
    mode = _mode(aggregation)
    d_high = DPPO_DELTA[divergence] if delta is None else delta
    d_low = d_high if delta_low is None else delta_low
    for name, value in (("delta", d_high), ("delta_low", d_low), ("ratio_cap", ratio_cap)):
        _positive(name, value)
    tau = _concrete(kl_tau)
    if tau is not None and not tau >= 0:
        raise ValueError(f"kl_tau must be ≥ 0, got {tau}")
    m, rm, adv, ell = _prepare(logp, logmu, mask, rewards, group_ids, advantages, record_mask,
                               scale_by_std=scale_by_std, std_ddof=std_ddof)
    valid = m > 0
    lp, lmu = sg(masked(logp, m)), sg(masked(logmu, m))
    div = binary_tv(lp, lmu) if divergence == "tv" else binary_kl(lp, lmu)
    keep = dppo_mask(sg(ell), div, adv, valid, d_high, d_low)
    value = capped_ratio_value(ell, ratio_cap, log_ratio_cap)
    per_token = -jnp.where(keep, value, 0.0) * adv[:, None] + kl_tau * jnp.square(ell)
    total, weight = aggregate(per_token, m, mode, max_len=max_len, record_mask=rm)
    w = m * rm[:, None]
    a = adv[:, None]
    dropped = (valid & ~keep).astype(jnp.float32)
    metrics = {
        "log_ratio_mean": wmean(ell, w), "log_ratio_max": wmax(ell, w),
        "advantage_mean": wmean(adv, rm),
        "masked_frac": wmean(dropped, w),
        "masked_frac_pos": wmean(dropped, w * (a > 0)),
        "masked_frac_neg": wmean(dropped, w * (a < 0)),
        "divergence_mean": wmean(div, w), "divergence_max": wmax(div, w),
        "log_ratio_sq_mean": wmean(jnp.square(ell), w),
    }
    return LossOutput(total, weight, metrics)


# ------------------------------------------------------------------------------------- TRM


def trm_sequence_mask(log_ratio: Array, valid: Array, delta: Scalar,
                      delta_avg: Scalar | None = None) -> tuple[Array, Array, Array]:
    """TRM's sequence mask (arXiv:2512.23075 Algorithm 1 with the sample estimates of its
    appendix): `M_i = 1[max_t k2 ≤ δ]`, `k2 = ½ (log ρ_t)²`, and with `delta_avg` also
    `1[mean_t k3 ≤ δ_avg]`, `k3 = ρ_t − 1 − log ρ_t` (the "combined criterion").

    `log_ratio` [B, T] (log ρ, under stop-gradient), `valid` [B, T] bool. Returns (M [B] bool,
    max k2 [B], mean k3 [B]); a record with no valid token has max 0 and mean 0 (kept, and it
    adds nothing to the loss)."""
    k2 = jnp.where(valid, 0.5 * jnp.square(log_ratio), 0.0)
    k3 = jnp.where(valid, jnp.expm1(jnp.minimum(log_ratio, LOG_RATIO_CAP)) - log_ratio, 0.0)
    max_k2 = jnp.max(k2, axis=-1)
    mean_k3 = jnp.sum(k3, axis=-1) / jnp.maximum(jnp.sum(valid, axis=-1), 1)
    keep = max_k2 <= delta
    if delta_avg is not None:
        keep = keep & (mean_k3 <= delta_avg)
    return keep, max_k2, mean_k3


def trm_advantages(rewards: Array, group_ids: Array, record_mask: Array | None = None, *,
                   std_ddof: int = 0, **_: object) -> Array:
    """TRM's advantages on the full batch: GRPO's group-normalised `Â` (its experiments:
    GRPO, group size 16; eq. 2 takes any baseline)."""
    return group_advantages(rewards, group_ids, record_mask, scale_by_std=True,
                            std_ddof=std_ddof)


def trm_loss(
    logp: Array, logmu: Array, mask: Array, rewards: Array, group_ids: Array, *,
    delta: Scalar = 0.05,
    delta_avg: Scalar | None = None,
    aggregation: Aggregation | None = None,
    std_ddof: int = 0,
    advantages: Array | None = None,
    record_mask: Array | None = None,
    max_len: int | None = None,
    log_ratio_cap: float = LOG_RATIO_CAP,
) -> LossOutput:
    """TRM (arXiv:2512.23075 eq. 22, Algorithm 1): the masked surrogate
    `−M_i·Â_i·Σ_t ρ_t`, `ρ_t = π_t/μ_t`, with the sequence mask `trm_sequence_mask`, normalised
    by the whole batch (rejected records count in N: "rejection sampling"). Gradient
    `−M_i·Â_i·Σ_t ρ_t ∇log π_t`.

    `delta` = 0.05 is the paper's TRM-Max run; `delta_avg` adds its average criterion (TRM-Avg:
    0.001; combined: 0.1 with 0.002). The paper's criterion is the exact per-token KL from μ's
    full logits, which the records do not hold: this kernel uses the sample estimates its
    appendix recommends for that case (k2 for the max, k3 for the average), under which the
    paper states its guarantee does not hold rigorously. Advantages: `trm_advantages`."""
    mode = _mode(aggregation)
    _positive("delta", delta)
    _positive("delta_avg", delta_avg)
    m, rm, adv, ell = _prepare(logp, logmu, mask, rewards, group_ids, advantages, record_mask,
                               scale_by_std=True, std_ddof=std_ddof)
    valid = m > 0
    keep, max_k2, mean_k3 = trm_sequence_mask(sg(ell), valid, delta, delta_avg)
    rho = jnp.exp(jnp.minimum(ell, log_ratio_cap))
    per_token = -jnp.where(keep[:, None], rho, 0.0) * adv[:, None]
    total, weight = aggregate(per_token, m, mode, max_len=max_len, record_mask=rm)
    has_tokens = rm * (jnp.sum(m, axis=-1) > 0)
    w = m * rm[:, None]
    metrics = {
        "log_ratio_mean": wmean(ell, w), "log_ratio_max": wmax(ell, w),
        "advantage_mean": wmean(adv, rm),
        "masked_frac": wmean((~keep).astype(jnp.float32), has_tokens),  # rejected records
        "k2_max_mean": wmean(max_k2, has_tokens), "k2_max_max": wmax(max_k2, has_tokens),
        "k3_mean": wmean(mean_k3, has_tokens),
    }
    return LossOutput(total, weight, metrics)
