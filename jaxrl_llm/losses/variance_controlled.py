"""VCPO: importance-weighted REINFORCE/GRPO with an ESS-scaled step and the off-policy
minimum-variance baseline.

Huang et al., *Stable Asynchrony: Variance-Controlled Off-Policy RL for LLMs*,
arXiv:2602.17616. Its two controls, as the authors state them (README of
github.com/mit-han-lab/vcpo; the paper body could not be read here):

1. ESS-guided step scaling, `η_eff ∝ √ρ_ess`, `ρ_ess = ESS/B = (Σ_i w_i)² / (B Σ_i w_i²)`,
   w_i = π(y_i)/μ(y_i) the sequence importance weight;
2. the closed-form off-policy optimal baseline (OPOB)
   `b* = Σ_i w_i² ‖∇log π(y_i)‖² R_i / Σ_i w_i² ‖∇log π(y_i)‖²`, which minimises the variance
   of `Σ_i w_i (R_i − b) ∇log π(y_i)` over constant b.

The authors' code (`recipe/fully_async_policy/staleness_utils.py`, `megatron_actor.py`, and
the run scripts `shell/vcpo/*`) fixes the rest, taken here as defaults: b per prompt group, the
advantage `(R − b)/std_g R`, a gradient weight truncated at 8 (`rollout_is_threshold`), the
ESS from the untruncated weights, and `lr · √min(1, ρ_ess/ρ_base)` with ρ_base = 1.

The per-record squared score norms `‖∇_θ log π(y_i)‖²` need a backward pass per record: the
train step computes them (train/score_norms.py) and calls `vcpo_batch` on the full batch; a
kernel call without `advantages` must be given them. The step size is not a loss: the kernel
(and `vcpo_batch`) report it as the metric `update_scale`, which the train step multiplies
into the optimizer's update (exactly a learning-rate factor, whatever the optimizer).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from jaxrl_llm.losses.advantages import check_ddof, group_segments
from jaxrl_llm.losses.common import (
    AGGREGATIONS,
    LOG_RATIO_CAP,
    Aggregation,
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
from jaxrl_llm.losses.types import LossOutput

Baseline = Literal["opob", "group_mean"]
EssRule = Literal["sqrt", "linear", "off"]
sg = jax.lax.stop_gradient

# The metric the train step reads as the factor of the optimizer's update (train/step.py).
UPDATE_SCALE = "update_scale"
VCPO_IS_CAP = 8.0  # the authors' run scripts: rollout_is=sequence, rollout_is_threshold=8.0
# The README's estimator: Σ_i w_i (R_i − b) ∇log π(y_i), the sequence score, averaged over records.
VCPO_AGGREGATION = "seq-mean-token-sum"


def _group_sum(values: Array, seg: Array) -> Array:
    """Σ over each record's group (dense segment ids `seg`), broadcast back to the records."""
    return jax.ops.segment_sum(values, seg, num_segments=seg.shape[0])[seg]


def log_ess_ratio(log_w: Array, valid: Array) -> Array:
    """`log ρ_ess = log((Σ w)² / (N Σ w²))` over the `valid` records (log space: any ℓ);
    −inf when no record is valid."""
    lw = jnp.where(valid, log_w, -jnp.inf)
    n = jnp.sum(valid)
    s1 = jax.nn.logsumexp(lw)
    s2 = jax.nn.logsumexp(2.0 * lw)
    out = 2.0 * s1 - s2 - jnp.log(jnp.maximum(n, 1).astype(jnp.float32))
    return jnp.where(n > 0, out, -jnp.inf)


def step_scale(log_ratio_ess: Array, rule: EssRule, base: Scalar) -> Array:
    """`min(1, ρ/ρ_base)` under the rule: its square root (`"sqrt"`, AdamW-style, the
    README's), itself (`"linear"`) or 1 (`"off"`). 0 when ρ is undefined (no valid record)."""
    check_choice("ess_rule", rule, ("sqrt", "linear", "off"))
    if rule == "off":
        return jnp.where(jnp.isfinite(log_ratio_ess), 1.0, 0.0)
    rel = jnp.exp(jnp.minimum(log_ratio_ess - jnp.log(jnp.asarray(base, jnp.float32)), 0.0))
    return jnp.sqrt(rel) if rule == "sqrt" else rel


def opob_baselines(rewards: Array, group_ids: Array, log_w: Array, score_sq_norms: Array,
                   valid: Array) -> Array:
    """OPOB per record [B]: `b_g = Σ_{j∈g} W_j R_j / Σ_{j∈g} W_j`, `W_j = w_j² ‖∇log π(y_j)‖²`
    over the valid records of the group (softmax of `2ℓ_j + log‖s_j‖²`: no overflow). A group
    whose weights are all 0 (no valid record, or zero score norms) falls back to its mean."""
    seg = group_segments(group_ids)
    s = jnp.maximum(jnp.asarray(score_sq_norms, jnp.float32), 0.0)
    use = valid & (s > 0)
    logit = jnp.where(use, 2.0 * log_w + jnp.log(jnp.where(use, s, 1.0)), -jnp.inf)
    top = jax.ops.segment_max(logit, seg, num_segments=seg.shape[0])[seg]
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weight = jnp.where(use, jnp.exp(logit - top), 0.0)
    r = jnp.asarray(rewards, jnp.float32)
    num, den = _group_sum(weight * r, seg), _group_sum(weight, seg)
    vf = valid.astype(jnp.float32)
    mean = _group_sum(vf * r, seg) / jnp.maximum(_group_sum(vf, seg), 1.0)
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), mean)


def vcpo_batch(
    rewards: Array, group_ids: Array, record_mask: Array | None, log_w: Array,
    score_sq_norms: Array | None, lengths: Array, *,
    baseline: Baseline = "opob", scale_by_std: bool = True, std_ddof: int = 0,
    ess_rule: EssRule = "sqrt", ess_base: Scalar = 1.0, **_: object,
) -> tuple[Array, Array, dict[str, Array]]:
    """What VCPO computes on the whole batch: `(advantages [B], update scale, metrics)`.

    `log_w` [B] the sequence log-ratios ℓ_i = log π(y_i)/μ(y_i), `lengths` [B] the completion
    token counts (a record with none has no ratio: it enters neither the ESS nor a baseline),
    `score_sq_norms` [B] the `‖∇log π(y_i)‖²` (needed by `baseline="opob"`). Advantages
    `A_i = (R_i − b_g)/(std_g R + 1e-6)` (`scale_by_std`; std over the group's records) with
    b the OPOB (or the group mean); the scale is `step_scale(ρ_ess)`.

    A batch with no completion token at all has no ESS: scale 0 (a zero update, counted by
    the metric `empty_batch` = 1), never NaN."""
    check_ddof(std_ddof)
    check_choice("baseline", baseline, ("opob", "group_mean"))
    r = jnp.asarray(rewards, jnp.float32)
    b = r.shape[0]
    rm = jnp.ones((b,), jnp.float32) if record_mask is None else jnp.asarray(record_mask,
                                                                              jnp.float32)
    valid = (rm > 0) & (jnp.asarray(lengths) > 0)
    log_w = jnp.asarray(log_w, jnp.float32)
    seg = group_segments(jnp.asarray(group_ids))
    if baseline == "opob":
        if score_sq_norms is None:
            raise ValueError("baseline='opob' needs score_sq_norms [B] (‖∇log π(y_i)‖², from the "
                             "train step's per-record backward pass, train/score_norms.py)")
        base = opob_baselines(r, group_ids, log_w, score_sq_norms, valid)
    else:
        vf = valid.astype(jnp.float32)
        base = _group_sum(vf * r, seg) / jnp.maximum(_group_sum(vf, seg), 1.0)
    adv = r - base
    if scale_by_std:
        rmf = (rm > 0).astype(jnp.float32)
        count = _group_sum(rmf, seg)
        mean = _group_sum(rmf * r, seg) / jnp.maximum(count, 1.0)
        var = _group_sum(rmf * jnp.square(r - mean), seg) / jnp.maximum(count - std_ddof, 1.0)
        adv = adv / (jnp.sqrt(var) + 1e-6)
    adv = jnp.where(valid, adv, 0.0)
    log_rho = log_ess_ratio(log_w, valid)
    scale = step_scale(log_rho, ess_rule, ess_base)
    metrics = {
        "ess_ratio": jnp.where(jnp.isfinite(log_rho), jnp.exp(log_rho), 0.0),
        UPDATE_SCALE: scale,
        "empty_batch": (~jnp.any(valid)).astype(jnp.float32),
        "baseline_mean": wmean(base, valid.astype(jnp.float32)),
    }
    return adv, scale, metrics


def vcpo_loss(
    logp: Array, logmu: Array, mask: Array, rewards: Array, group_ids: Array, *,
    is_cap: Scalar | None = VCPO_IS_CAP,
    baseline: Baseline = "opob",
    scale_by_std: bool = True,
    ess_rule: EssRule = "sqrt",
    ess_base: Scalar = 1.0,
    aggregation: Aggregation | None = None,
    std_ddof: int = 0,
    score_sq_norms: Array | None = None,
    advantages: Array | None = None,
    record_mask: Array | None = None,
    max_len: int | None = None,
    log_ratio_cap: float = LOG_RATIO_CAP,
) -> LossOutput:
    """VCPO's policy-gradient term: per token `−sg(w̄_i)·A_i·log π_t`, `w̄_i = min(w_i, is_cap)`
    the truncated sequence weight (`is_cap=None`: untruncated), summed over each sequence
    and averaged over records (`aggregation` changes it). Gradient `−w̄_i A_i ∇log π(y_i)`.

    `advantages` [B] (the train step's, from `vcpo_batch` on the full batch) or, when absent,
    `vcpo_batch` on this call's records (then `score_sq_norms` is needed for the OPOB, and the
    metrics include `ess_ratio` and `update_scale`: the step size is applied by the caller)."""
    mode = VCPO_AGGREGATION if aggregation is None else aggregation
    check_choice("aggregation", mode, AGGREGATIONS)
    cap = None if is_cap is None else (
        None if isinstance(is_cap, jax.core.Tracer) else float(is_cap))
    if cap is not None and not cap > 0:
        raise ValueError(f"is_cap must be > 0 (or None: no truncation), got {cap}")
    b, _ = check_tokens(logp=logp, logmu=logmu, mask=mask)
    check_records(b, rewards=rewards, group_ids=group_ids, advantages=advantages,
                  score_sq_norms=score_sq_norms, record_mask=record_mask)
    m, rm = token_record_weights(mask, record_mask, b)
    ell_t = masked(logp, m) - masked(logmu, m)
    ell = jnp.sum(ell_t * m, axis=-1)
    lengths = jnp.sum(m, axis=-1)
    extra: dict[str, Array] = {}
    if advantages is None:
        adv, _, extra = vcpo_batch(rewards, group_ids, rm, sg(ell), score_sq_norms, lengths,
                                   baseline=baseline, scale_by_std=scale_by_std,
                                   std_ddof=std_ddof, ess_rule=ess_rule, ess_base=ess_base)
    else:
        adv = jnp.where(rm > 0, jnp.asarray(advantages, jnp.float32), 0.0)
    log_w = jnp.minimum(sg(ell), log_ratio_cap)
    if is_cap is not None:
        log_w = jnp.minimum(log_w, jnp.log(jnp.asarray(is_cap, jnp.float32)))
    w_bar = jnp.exp(log_w)
    per_token = -(w_bar * adv)[:, None] * masked(logp, m)
    total, weight = aggregate(per_token, m, mode, max_len=max_len, record_mask=rm)
    has_tokens = rm * (lengths > 0)
    w = m * rm[:, None]
    metrics = {
        "log_ratio_mean": wmean(ell_t, w), "log_ratio_max": wmax(ell_t, w),
        "seq_log_ratio_mean": wmean(ell, has_tokens),
        "is_weight_mean": wmean(w_bar, has_tokens),
        "is_truncated_frac": wmean((sg(ell) > log_w).astype(jnp.float32), has_tokens),
        "advantage_mean": wmean(adv, rm), "advantage_abs_mean": wmean(jnp.abs(adv), rm),
        **extra,
    }
    return LossOutput(total, weight, metrics)
