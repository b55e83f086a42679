"""PPO, GRPO and Dr.GRPO: the clipped surrogate with the options users of verl/DAPO expect.

`L = −min(r A, [r]_{1−ε_low}^{1+ε_high} A)`, optionally dual-clipped for `A < 0`
(`max(·, c A)` in objective form). Same contract as every kernel (`losses.common`):
`LossOutput(total, weight, metrics)` with loss = `total / weight`.

Options (each as its peer defines it):
- `clip_eps_low`, `clip_eps_high`: asymmetric bounds, DAPO's clip-higher (arXiv:2503.14476
  §3.1 and its objective; ε_low = 0.2, ε_high = 0.28 there); `None` means `clip_eps` (verl's
  `clip_ratio_low/high`).
- `dual_clip_c`: dual-clip PPO (arXiv:1912.09729, verl's `clip_ratio_c`): for `A < 0`
  the objective is `max(min(r A, [r] A), c A)`, i.e. the loss is at most `−c A`; `c > 1`.
- `std_ddof` (GRPO): the degrees of freedom of the group std (`advantages.grpo_advantages`).
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
    check_records,
    check_tokens,
    masked,
    token_record_weights,
    wmax,
    wmean,
)
from jaxrl_llm.losses.types import LossOutput

PpoRatioLevel = Literal["sequence", "token"]


def clip_bounds(
    clip_eps: Scalar, clip_eps_low: Scalar | None = None, clip_eps_high: Scalar | None = None
) -> tuple[Array, Array]:
    """`(ε_low, ε_high)`: each given bound, else the symmetric `clip_eps`; concrete values
    are checked (`0 ≤ ε_low ≤ 1`, `ε_high ≥ 0`; traced schedule values pass through)."""
    low = clip_eps if clip_eps_low is None else clip_eps_low
    high = clip_eps if clip_eps_high is None else clip_eps_high
    for name, value, upper in (("clip_eps_low", low, 1.0), ("clip_eps_high", high, None)):
        if jnp.ndim(value) != 0:
            raise ValueError(f"{name} must be a scalar, got shape {jnp.shape(value)}")
        if isinstance(value, jax.core.Tracer):
            continue
        if not float(value) >= 0 or (upper is not None and float(value) > upper):
            bound = "0 ≤ ε ≤ 1 (the lower clip is 1 − ε)" if upper else "ε ≥ 0"
            raise ValueError(f"{name} must satisfy {bound}, got {float(value)}")
    return jnp.asarray(low, jnp.float32), jnp.asarray(high, jnp.float32)


def check_dual_clip(dual_clip_c: Scalar | None) -> None:
    """Dual clip needs `c > 1` (arXiv:1912.09729): `c ≤ 1` would cap negative-advantage
    losses below the unclipped surrogate at r = 1, i.e. stop learning from them."""
    if dual_clip_c is None or isinstance(dual_clip_c, jax.core.Tracer):
        return
    if jnp.ndim(dual_clip_c) != 0 or not float(dual_clip_c) > 1.0:
        raise ValueError(f"dual_clip_c must be a scalar > 1 (dual-clip PPO), got {dual_clip_c!r}")


def clipped_surrogate(
    ell: Array, adv: Array, eps_low: Array, eps_high: Array, dual_clip_c: Scalar | None,
    cap: float,
) -> tuple[Array, Array, Array]:
    """Per-unit loss `−min(r A, [r]_{1−ε_low}^{1+ε_high} A)`, with dual clip for `A < 0`
    `min(that, −c A)`; and the indicators of zero-gradient (clipped) and dual-clipped units."""
    r = jnp.exp(jnp.minimum(ell, cap))
    r_clip = jnp.clip(r, 1.0 - eps_low, 1.0 + eps_high)
    loss = -jnp.minimum(r * adv, r_clip * adv)
    clipped = ((adv > 0) & (r > 1.0 + eps_high)) | ((adv < 0) & (r < 1.0 - eps_low))
    dual = jnp.zeros(jnp.shape(loss), bool)
    if dual_clip_c is not None:
        c_loss = -jnp.asarray(dual_clip_c, jnp.float32) * adv
        dual = (adv < 0) & (c_loss < loss)
        loss = jnp.where(dual, c_loss, loss)
    return loss, clipped | dual, dual


def _surrogate_metrics(ell, eps_low, eps_high, clipped, dual, w, adv_w,
                       dual_on: bool) -> dict[str, Array]:
    out = {
        "log_ratio_mean": wmean(ell, w),
        "log_ratio_max": wmax(ell, w),
        "clip_frac": wmean(clipped.astype(jnp.float32), w),
        "clip_frac_low": wmean((ell < jnp.log1p(-eps_low)).astype(jnp.float32), w),
        "clip_frac_high": wmean((ell > jnp.log1p(eps_high)).astype(jnp.float32), w),
        "advantage_mean": adv_w,
    }
    if dual_on:
        out["clip_frac_dual"] = wmean(dual.astype(jnp.float32), w)
    return out


def ppo_loss(
    logp: Array,
    logmu: Array,
    mask: Array,
    rewards: Array,
    *,
    clip_eps: Scalar = 0.2,
    clip_eps_low: Scalar | None = None,
    clip_eps_high: Scalar | None = None,
    dual_clip_c: Scalar | None = None,
    baseline: Scalar = 0.0,
    ratio_level: PpoRatioLevel = "sequence",
    aggregation: Aggregation = "token-mean",
    max_len: int | None = None,
    record_mask: Array | None = None,
    log_ratio_cap: float = LOG_RATIO_CAP,
) -> LossOutput:
    """PPO's clipped objective (TOPR arXiv:2503.14286 eq. 6): `L = −min(r A, [r]_{1−ε}^{1+ε} A)`.

    Sequence ratio `r = π(y|x)/μ(y|x)` by default (one term per record, weight = records);
    `ratio_level="token"` uses per-token ratios reduced with `aggregation`. `A = R − baseline`.
    `clip_eps_low/high` (DAPO clip-higher) and `dual_clip_c` as in the module docstring.
    """
    check_choice("ratio_level", ratio_level, ("sequence", "token"))
    b, _ = check_tokens(logp=logp, logmu=logmu, mask=mask)
    check_records(b, rewards=rewards, record_mask=record_mask)
    eps_low, eps_high = clip_bounds(clip_eps, clip_eps_low, clip_eps_high)
    check_dual_clip(dual_clip_c)
    m, rm = token_record_weights(mask, record_mask, b)
    adv = jnp.asarray(rewards, jnp.float32) - jnp.asarray(baseline, jnp.float32)
    adv = jnp.where(rm > 0, adv, 0.0)
    token_log_ratio = masked(logp, m) - masked(logmu, m)
    if ratio_level == "sequence":
        ell = jnp.sum(token_log_ratio * m, axis=-1)
        per_record, clipped, dual = clipped_surrogate(
            ell, adv, eps_low, eps_high, dual_clip_c, log_ratio_cap)
        total, weight = jnp.sum(rm * per_record), jnp.sum(rm)
        w = rm
    else:
        check_choice("aggregation", aggregation, AGGREGATIONS)
        ell = token_log_ratio
        per_token, clipped, dual = clipped_surrogate(
            ell, adv[:, None], eps_low, eps_high, dual_clip_c, log_ratio_cap)
        total, weight = aggregate(per_token, m, aggregation, max_len, rm)
        w = m * rm[:, None]
    metrics = _surrogate_metrics(ell, eps_low, eps_high, clipped, dual, w, wmean(adv, rm),
                                 dual_clip_c is not None)
    return LossOutput(total, weight, metrics)


def grpo_loss(
    logp: Array,
    logmu: Array,
    mask: Array,
    rewards: Array,
    group_ids: Array,
    *,
    clip_eps: Scalar = 0.2,
    clip_eps_low: Scalar | None = None,
    clip_eps_high: Scalar | None = None,
    dual_clip_c: Scalar | None = None,
    aggregation: Aggregation = "token-mean",
    scale_by_std: bool = True,
    std_ddof: int = 0,
    max_len: int | None = None,
    advantages: Array | None = None,
    record_mask: Array | None = None,
    log_ratio_cap: float = LOG_RATIO_CAP,
) -> LossOutput:
    """GRPO (FPA arXiv:2509.19893 eq. 34–35) with per-token ratios `r_t = exp(logπ_t − logμ_t)`.

    `Â = (R − mean_g R)/(std_g R + 1e-6)` over the records sharing a group id, with
    `std_ddof` degrees of freedom (`advantages.grpo_advantages`), or the given
    `advantages [B]` (pass them when the batch is split into micro-batches that cut groups).
    Per-token loss `−min(r_t Â, [r_t]_{1−ε_low}^{1+ε_high} Â)` (dual-clipped for Â < 0 when
    `dual_clip_c` is set) reduced by `aggregation`. Dr.GRPO = `scale_by_std=False,
    aggregation="seq-mean-token-sum-norm"` with a constant `max_len` (`dr_grpo_loss`).
    """
    check_choice("aggregation", aggregation, AGGREGATIONS)
    check_ddof(std_ddof)
    b, _ = check_tokens(logp=logp, logmu=logmu, mask=mask)
    check_records(b, rewards=rewards, group_ids=group_ids, advantages=advantages,
                   record_mask=record_mask)
    eps_low, eps_high = clip_bounds(clip_eps, clip_eps_low, clip_eps_high)
    check_dual_clip(dual_clip_c)
    m, rm = token_record_weights(mask, record_mask, b)
    if advantages is None:
        adv = grpo_advantages(jnp.asarray(rewards, jnp.float32), group_ids, rm,
                              scale_by_std=scale_by_std, ddof=std_ddof)
    else:
        adv = jnp.where(rm > 0, jnp.asarray(advantages, jnp.float32), 0.0)
    ell = masked(logp, m) - masked(logmu, m)
    per_token, clipped, dual = clipped_surrogate(
        ell, adv[:, None], eps_low, eps_high, dual_clip_c, log_ratio_cap)
    total, weight = aggregate(per_token, m, aggregation, max_len, rm)
    w = m * rm[:, None]
    metrics = _surrogate_metrics(ell, eps_low, eps_high, clipped, dual, w, wmean(adv, rm),
                                 dual_clip_c is not None)
    metrics["advantage_abs_mean"] = wmean(jnp.abs(adv), rm)
    return LossOutput(total, weight, metrics)


def dr_grpo_loss(
    logp: Array,
    logmu: Array,
    mask: Array,
    rewards: Array,
    group_ids: Array,
    *,
    max_len: int | None = None,
    **kwargs,
) -> LossOutput:
    """Dr.GRPO: no std division, `seq-mean-token-sum-norm` over constant `max_len`."""
    kwargs.setdefault("aggregation", "seq-mean-token-sum-norm")
    kwargs.setdefault("scale_by_std", False)
    return grpo_loss(logp, logmu, mask, rewards, group_ids, max_len=max_len, **kwargs)
