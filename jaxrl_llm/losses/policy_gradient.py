"""Policy-gradient loss kernels: TOPR family + presets, PPO, GRPO, Off-RL, FPA, KL terms.

Every loss has the DESIGN contract

    fn(per-token arrays [B, T], mask [B, T], per-record arrays [B], *, static options)
        -> LossOutput(total, weight, metrics)

with loss = `total / weight`, so summing `total` and `weight` over micro-batches and devices
gives the exact full-batch loss. Inputs are per-token log-probs (computed elsewhere, e.g.
`losses.logprobs.token_logprobs`); nothing here sees a model.

Conventions shared by all kernels:
- `mask [B, T]` is 1 on completion tokens (SPEC §0); values at masked positions are ignored,
  even when they are NaN/inf (padding may hold anything).
- `record_mask [B]` (optional) is a per-record weight: 0 for padding rows, usually 1
  otherwise. Per-record losses are summed with this weight and `weight = Σ record_mask`.
- Ratios are sequence-level by default (SPEC §0); `ratio_level="token"` is the named
  alternative. Ratios are formed in log space and the log-ratio is capped at
  `LOG_RATIO_CAP` before any `exp`, so nothing overflows for any sequence length.
- `metrics` are scalars of this batch, reduced with the record weights.
"""

from __future__ import annotations

from typing import Literal

import chex
import jax
import jax.numpy as jnp

from jaxrl_llm.losses.advantages import grpo_advantages
from jaxrl_llm.losses.types import LossOutput

Array = jax.Array
Scalar = float | Array

# Largest log-ratio ever exponentiated: e^30 ≈ 1.1e13. Beyond it an upper truncation bound
# acts as if b = e^30 (the taper continues log-linearly), so even full importance sampling
# (`b = inf`) keeps float32 gradients and their squared norms finite.
LOG_RATIO_CAP = 30.0
# δ clamp of the KL estimators (SPEC §3).
KL_DELTA_CLAMP = 20.0

RatioLevel = Literal["sequence", "token"]
Aggregation = Literal[
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]
AGGREGATIONS: tuple[str, ...] = (
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm",
)

# 000 Table 1 (SPEC §2): truncation limits of each named member of the TOPR family.
TOPR_PRESETS: dict[str, dict[str, float]] = {
    "sft": {"a_pos": 1.0, "b_pos": 1.0, "a_neg": 0.0, "b_neg": 0.0},
    "reinforce": {"a_pos": 1.0, "b_pos": 1.0, "a_neg": 1.0, "b_neg": 1.0},
    "opr": {"a_pos": 0.0, "b_pos": float("inf"), "a_neg": 0.0, "b_neg": float("inf")},
    "tis": {"a_pos": 0.0, "b_pos": 1.0, "a_neg": 0.0, "b_neg": 1.0},
    "topr": {"a_pos": 1.0, "b_pos": 1.0, "a_neg": 0.0, "b_neg": 1.0},
}


def topr_preset(name: str) -> dict[str, float]:
    """Truncation limits `{a_pos, b_pos, a_neg, b_neg}` of a 000 Table 1 preset."""
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


# ----------------------------------------------------------------------------- input checks


def _check_tokens(**arrays: Array | None) -> tuple[int, int]:
    """All given per-token arrays are [B, T] of one shape; log-probs are floating point."""
    named = {k: v for k, v in arrays.items() if v is not None}
    first_name, first = next(iter(named.items()))
    if jnp.ndim(first) != 2:
        raise ValueError(f"{first_name} must have shape [B, T], got {jnp.shape(first)}")
    shape = tuple(jnp.shape(first))
    for name, value in named.items():
        chex.assert_shape(
            value, shape, custom_message=f"argument {name!r} must match {first_name} {shape}"
        )
        if name != "mask" and not jnp.issubdtype(jnp.asarray(value).dtype, jnp.floating):
            raise ValueError(f"{name} must be floating point, got dtype {jnp.asarray(value).dtype}")
    return shape  # type: ignore[return-value]


def _check_records(batch: int, **arrays: Array | None) -> None:
    for name, value in arrays.items():
        if value is None:
            continue
        if jnp.ndim(value) != 1 or jnp.shape(value)[0] != batch:
            raise ValueError(
                f"{name} must have shape [B] = ({batch},) to match the per-token arrays, "
                f"got {jnp.shape(value)}"
            )


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
                raise ValueError(f"{lo} = {float(a)} must be ≤ {hi} = {float(b)} (SPEC §2)")


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def _record_weights(record_mask: Array | None, batch: int) -> Array:
    if record_mask is None:
        return jnp.ones((batch,), jnp.float32)
    return jnp.asarray(record_mask).astype(jnp.float32)


def _weights(mask: Array, record_mask: Array | None, batch: int) -> tuple[Array, Array]:
    """Token weights (zeroed on padding rows, so their garbage never enters) and record weights."""
    rm = _record_weights(record_mask, batch)
    m = jnp.asarray(mask).astype(jnp.float32) * (rm > 0)[:, None]
    return m, rm


# ----------------------------------------------------------------------------- shared maths


def _token_weights(mask: Array) -> Array:
    return jnp.asarray(mask).astype(jnp.float32)


def _masked(x: Array, m: Array) -> Array:
    """`x` on tokens with m > 0 and 0 elsewhere (garbage in padding cannot leak, not even NaN)."""
    return jnp.where(m > 0, jnp.asarray(x, jnp.float32), 0.0)


def sequence_logprob(logp: Array, mask: Array) -> Array:
    """`log π(y|x) = Σ_t mask_t logπ_t` per record [B] (SPEC §0)."""
    m = _token_weights(mask)
    return jnp.sum(_masked(logp, m) * m, axis=-1)


def completion_lengths(mask: Array) -> Array:
    """`|y| = Σ_t mask_t` per record [B]."""
    return jnp.sum(_token_weights(mask), axis=-1)


def _safe_len(m: Array) -> Array:
    return jnp.maximum(jnp.sum(m, axis=-1), 1.0)


def _wmean(x: Array, w: Array) -> Array:
    """Weighted mean; 0 when the weights sum to 0."""
    x = jnp.where(w > 0, x, 0.0)
    return jnp.sum(w * x) / jnp.maximum(jnp.sum(w), 1e-12)


def _wmax(x: Array, w: Array) -> Array:
    """Max over entries with w > 0; 0 when there are none."""
    any_valid = jnp.any(w > 0)
    return jnp.where(any_valid, jnp.max(jnp.where(w > 0, x, -jnp.inf)), 0.0)


def _log_bounds(a: Scalar, b: Scalar, cap: float) -> tuple[Array, Array]:
    """`log a`, `min(log b, cap)` with log 0 = −inf (and b = inf → cap), no NaN anywhere."""
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    lo = jnp.where(a > 0, jnp.log(jnp.where(a > 0, a, 1.0)), -jnp.inf)
    hi = jnp.where(b > 0, jnp.minimum(jnp.log(jnp.where(b > 0, b, 1.0)), cap), -jnp.inf)
    return lo, hi


def taper(log_ratio: Array, log_a: Array, log_b: Array) -> tuple[Array, Array]:
    """The taper function of 000 eq. 11 evaluated from `ℓ = log x`, and its weight.

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


def aggregate(
    per_token_loss: Array,
    mask: Array,
    mode: Aggregation = "token-mean",
    max_len: int | None = None,
    record_mask: Array | None = None,
) -> tuple[Array, Array]:
    """Reduce a per-token loss [B, T] to `(total, weight)` (SPEC §3 aggregation names, as verl).

    - `token-mean`: Σ_b Σ_t m ℓ / Σ_b Σ_t m (every token of the batch weighs the same);
    - `seq-mean-token-sum`: Σ_b (Σ_t m ℓ) / #records;
    - `seq-mean-token-mean`: Σ_b (Σ_t m ℓ / |y_b|) / #records;
    - `seq-mean-token-sum-norm`: Σ_b (Σ_t m ℓ / max_len) / #records (Dr.GRPO), with a
      constant `max_len` (default: the static padded length T).

    `#records` is Σ record_mask. Summing both outputs over micro-batches gives the exact
    full-batch value of every mode (for the seq-mean modes, because `max_len` is a constant).
    """
    _choice("mode", mode, AGGREGATIONS)
    b, t = _check_tokens(per_token_loss=per_token_loss, mask=mask)
    _check_records(b, record_mask=record_mask)
    m, rm = _weights(mask, record_mask, b)
    tok = _masked(per_token_loss, m) * m * rm[:, None]
    if mode == "token-mean":
        return jnp.sum(tok), jnp.sum(m * rm[:, None])
    per_record = jnp.sum(tok, axis=-1)
    if mode == "seq-mean-token-mean":
        per_record = per_record / _safe_len(m)
    elif mode == "seq-mean-token-sum-norm":
        denom = t if max_len is None else max_len
        if not isinstance(denom, jax.core.Tracer) and float(denom) <= 0:
            raise ValueError(f"max_len must be > 0, got {denom}")
        per_record = per_record / denom
    return jnp.sum(per_record), jnp.sum(rm)


def _sign_split_metrics(
    log_ratio: Array, w: Array, positive: Array, lo: Array, hi: Array
) -> dict[str, Array]:
    """Clip fractions at each bound among positive / negative units, and their log-ratios."""
    wp = w * positive
    wn = w * (1.0 - positive)
    below = (log_ratio < lo).astype(jnp.float32)
    above = (log_ratio > hi).astype(jnp.float32)
    return {
        "clip_frac_pos_low": _wmean(below, wp),
        "clip_frac_pos_high": _wmean(above, wp),
        "clip_frac_neg_low": _wmean(below, wn),
        "clip_frac_neg_high": _wmean(above, wn),
        "log_ratio_mean_pos": _wmean(log_ratio, wp),
        "log_ratio_mean_neg": _wmean(log_ratio, wn),
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
    record_mask: Array | None = None,
    log_ratio_cap: float = LOG_RATIO_CAP,
) -> LossOutput:
    """Tapered off-policy REINFORCE (000 §3, eq. 7 and 11, Table 1; SPEC §2).

    `A = R − baseline` (scalar or [B]); a record is positive when `A ≥ 0`. With
    `ℓ = log π(y|x) − log μ(y|x)` (sequence level) the per-record loss is the taper form

        L = − A · ρ(exp ℓ, a, b) / N(y)        N = |y| if length_norm else 1

    whose value is the (negated, length-normalised) TOPR objective of eq. 11 and whose
    gradient is exactly `− [r]_a^b · A · ∇log π(y|x) / N` (eq. 7). `ratio_level="token"`
    applies the taper to each token's ratio and sums over the tokens. Bounds may be traced
    scalars (schedules, e.g. 001's annealed `τ`); `a = 0` and `b = inf` are exact.
    Presets: `TOPR_PRESETS` / `topr_preset(name)`.

    Returns `total = Σ_b record_mask_b L_b`, `weight = Σ_b record_mask_b`.
    """
    _choice("ratio_level", ratio_level, ("sequence", "token"))
    b, _ = _check_tokens(logp=logp, logmu=logmu, mask=mask)
    _check_records(b, rewards=rewards, record_mask=record_mask)
    if jnp.shape(baseline) not in ((), (b,)):
        raise ValueError(f"baseline must be a scalar or shape ({b},), got {jnp.shape(baseline)}")
    _check_bounds(a_pos=a_pos, b_pos=b_pos, a_neg=a_neg, b_neg=b_neg)

    m, rm = _weights(mask, record_mask, b)
    adv = jnp.asarray(rewards, jnp.float32) - jnp.asarray(baseline, jnp.float32)
    adv = jnp.where(rm > 0, adv, 0.0)
    positive = adv >= 0
    lo_p, hi_p = _log_bounds(a_pos, b_pos, log_ratio_cap)
    lo_n, hi_n = _log_bounds(a_neg, b_neg, log_ratio_cap)
    norm = _safe_len(m) if length_norm else jnp.ones((b,), jnp.float32)
    token_log_ratio = _masked(logp, m) - _masked(logmu, m)

    if ratio_level == "sequence":
        ell = jnp.sum(token_log_ratio * m, axis=-1)
        lo = jnp.where(positive, lo_p, lo_n)
        hi = jnp.where(positive, hi_p, hi_n)
        rho, _ = taper(ell, lo, hi)
        unit_w, unit_pos = rm, positive.astype(jnp.float32)
        unit_ell = ell
    else:
        ell = token_log_ratio
        lo = jnp.where(positive, lo_p, lo_n)[:, None]
        hi = jnp.where(positive, hi_p, hi_n)[:, None]
        rho_t, _ = taper(ell, lo, hi)
        rho = jnp.sum(rho_t * m, axis=-1)
        unit_w = m * rm[:, None]
        unit_pos = jnp.broadcast_to(positive[:, None], ell.shape).astype(jnp.float32)
        unit_ell = ell
        lo, hi = jnp.broadcast_to(lo, ell.shape), jnp.broadcast_to(hi, ell.shape)

    per_record = -adv * rho / norm
    total = jnp.sum(rm * per_record)
    weight = jnp.sum(rm)

    abs_adv = jnp.abs(adv) * rm
    log_alpha = jnp.minimum(jnp.maximum(unit_ell, lo), hi)
    metrics = {
        "objective": -total / jnp.maximum(weight, 1e-12),
        "log_ratio_mean": _wmean(unit_ell, unit_w),
        "log_ratio_max": _wmax(unit_ell, unit_w),
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


# ----------------------------------------------------------------------------- PPO / GRPO


def _clipped_surrogate(ell: Array, adv: Array, clip_eps: Scalar, cap: float) -> tuple[Array, Array]:
    """`−min(r A, [r]_{1−ε}^{1+ε} A)` and the clipped indicator (zero-gradient units)."""
    r = jnp.exp(jnp.minimum(ell, cap))
    eps = jnp.asarray(clip_eps, jnp.float32)
    r_clip = jnp.clip(r, 1.0 - eps, 1.0 + eps)
    loss = -jnp.minimum(r * adv, r_clip * adv)
    clipped = ((adv > 0) & (r > 1.0 + eps)) | ((adv < 0) & (r < 1.0 - eps))
    return loss, clipped


def _surrogate_metrics(ell, r_low, r_high, clipped, w, adv_w) -> dict[str, Array]:
    return {
        "log_ratio_mean": _wmean(ell, w),
        "log_ratio_max": _wmax(ell, w),
        "clip_frac": _wmean(clipped.astype(jnp.float32), w),
        "clip_frac_low": _wmean(r_low.astype(jnp.float32), w),
        "clip_frac_high": _wmean(r_high.astype(jnp.float32), w),
        "advantage_mean": adv_w,
    }


def ppo_loss(
    logp: Array,
    logmu: Array,
    mask: Array,
    rewards: Array,
    *,
    clip_eps: Scalar = 0.2,
    baseline: Scalar = 0.0,
    ratio_level: RatioLevel = "sequence",
    aggregation: Aggregation = "token-mean",
    max_len: int | None = None,
    record_mask: Array | None = None,
    log_ratio_cap: float = LOG_RATIO_CAP,
) -> LossOutput:
    """PPO's clipped objective (000 eq. 6; SPEC §3): `L = −min(r A, [r]_{1−ε}^{1+ε} A)`.

    Sequence ratio `r = π(y|x)/μ(y|x)` by default (one term per record, weight = records);
    `ratio_level="token"` uses per-token ratios reduced with `aggregation`. `A = R − baseline`.
    """
    _choice("ratio_level", ratio_level, ("sequence", "token"))
    b, _ = _check_tokens(logp=logp, logmu=logmu, mask=mask)
    _check_records(b, rewards=rewards, record_mask=record_mask)
    m, rm = _weights(mask, record_mask, b)
    adv = jnp.asarray(rewards, jnp.float32) - jnp.asarray(baseline, jnp.float32)
    adv = jnp.where(rm > 0, adv, 0.0)
    token_log_ratio = _masked(logp, m) - _masked(logmu, m)
    eps = jnp.asarray(clip_eps, jnp.float32)
    if ratio_level == "sequence":
        ell = jnp.sum(token_log_ratio * m, axis=-1)
        per_record, clipped = _clipped_surrogate(ell, adv, eps, log_ratio_cap)
        total, weight = jnp.sum(rm * per_record), jnp.sum(rm)
        w = rm
    else:
        ell = token_log_ratio
        per_token, clipped = _clipped_surrogate(ell, adv[:, None], eps, log_ratio_cap)
        total, weight = aggregate(per_token, m, aggregation, max_len, rm)
        w = m * rm[:, None]
    r_low = ell < jnp.log1p(-eps)
    r_high = ell > jnp.log1p(eps)
    metrics = _surrogate_metrics(ell, r_low, r_high, clipped, w, _wmean(adv, rm))
    return LossOutput(total, weight, metrics)


def grpo_loss(
    logp: Array,
    logmu: Array,
    mask: Array,
    rewards: Array,
    group_ids: Array,
    *,
    clip_eps: Scalar = 0.2,
    aggregation: Aggregation = "token-mean",
    scale_by_std: bool = True,
    max_len: int | None = None,
    advantages: Array | None = None,
    record_mask: Array | None = None,
    log_ratio_cap: float = LOG_RATIO_CAP,
) -> LossOutput:
    """GRPO (002 eq. 34–35; SPEC §3) with per-token ratios `r_t = exp(logπ_t − logμ_t)`.

    `Â = (R − mean_g R)/(std_g R + 1e-6)` over the records sharing a group id
    (`advantages.grpo_advantages`), or the given `advantages [B]` (pass them when the batch
    is split into micro-batches that cut groups). Per-token loss
    `−min(r_t Â, [r_t]_{1−ε}^{1+ε} Â)` reduced by `aggregation`.
    Dr.GRPO = `scale_by_std=False, aggregation="seq-mean-token-sum-norm"` with a constant
    `max_len` (`dr_grpo_loss`).
    """
    _choice("aggregation", aggregation, AGGREGATIONS)
    b, _ = _check_tokens(logp=logp, logmu=logmu, mask=mask)
    _check_records(b, rewards=rewards, group_ids=group_ids, advantages=advantages,
                   record_mask=record_mask)
    m, rm = _weights(mask, record_mask, b)
    if advantages is None:
        adv = grpo_advantages(jnp.asarray(rewards, jnp.float32), group_ids, rm,
                              scale_by_std=scale_by_std)
    else:
        adv = jnp.where(rm > 0, jnp.asarray(advantages, jnp.float32), 0.0)
    ell = _masked(logp, m) - _masked(logmu, m)
    eps = jnp.asarray(clip_eps, jnp.float32)
    per_token, clipped = _clipped_surrogate(ell, adv[:, None], eps, log_ratio_cap)
    total, weight = aggregate(per_token, m, aggregation, max_len, rm)
    w = m * rm[:, None]
    metrics = _surrogate_metrics(
        ell, ell < jnp.log1p(-eps), ell > jnp.log1p(eps), clipped, w, _wmean(adv, rm)
    )
    metrics["advantage_abs_mean"] = _wmean(jnp.abs(adv), rm)
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
    """Dr.GRPO (SPEC §3): no std division, `seq-mean-token-sum-norm` over constant `max_len`."""
    kwargs.setdefault("aggregation", "seq-mean-token-sum-norm")
    kwargs.setdefault("scale_by_std", False)
    return grpo_loss(logp, logmu, mask, rewards, group_ids, max_len=max_len, **kwargs)


# ----------------------------------------------------------------------------- Off-RL / FPA


def _correct_flags(correct: Array | None, rewards: Array) -> Array:
    if correct is None:
        return jnp.asarray(rewards) > 0
    return jnp.asarray(correct).astype(bool)


def _off_rl_metrics(
    norm_logp: Array,
    norm_logp_hat: Array | None,
    seq_ref_diff: Array | None,
    correct: Array,
    rm: Array,
) -> dict[str, Array]:
    """002 Fig. 2/3 quantities: π^{1/|y|}, π̂^{1/|y|}, log π − log π_ref per correctness."""
    wc = rm * correct
    wi = rm * (~correct)
    pi_norm = jnp.exp(jnp.minimum(norm_logp, 0.0))
    out = {
        "num_correct": jnp.sum(wc),
        "num_incorrect": jnp.sum(wi),
        "pi_norm_mean_correct": _wmean(pi_norm, wc),
        "pi_norm_mean_incorrect": _wmean(pi_norm, wi),
        "count_pi_below_0.2_incorrect": jnp.sum(wi * (pi_norm < 0.2)),
    }
    if norm_logp_hat is not None:
        hat_norm = jnp.exp(jnp.minimum(norm_logp_hat, LOG_RATIO_CAP))
        out |= {
            "pi_hat_norm_mean_correct": _wmean(hat_norm, wc),
            "pi_hat_norm_mean_incorrect": _wmean(hat_norm, wi),
            "count_pi_hat_below_0.2_incorrect": jnp.sum(wi * (hat_norm < 0.2)),
        }
    if seq_ref_diff is not None:
        out |= {
            "logp_minus_ref_mean_correct": _wmean(seq_ref_diff, wc),
            "logp_minus_ref_mean_incorrect": _wmean(seq_ref_diff, wi),
        }
    return out


def _ref_diff(logp: Array, ref_logp: Array, m: Array) -> Array:
    """`log π(y|x) − log π_ref(y|x)` per record (002 Fig. 2's quantity)."""
    return sequence_logprob(logp, m) - sequence_logprob(ref_logp, m)


def off_rl_loss(
    logp: Array,
    mask: Array,
    rewards: Array,
    *,
    correct: Array | None = None,
    ref_logp: Array | None = None,
    record_mask: Array | None = None,
) -> LossOutput:
    """Off-RL (002 eq. 1; SPEC §3): `L = − R · π(y|x)^{1/|y|} = − R · exp(log π(y|x)/|y|)`.

    `correct [B]` (default `R > 0`) and `ref_logp [B, T]` only feed the metrics.
    """
    b, _ = _check_tokens(logp=logp, mask=mask, ref_logp=ref_logp)
    _check_records(b, rewards=rewards, correct=correct, record_mask=record_mask)
    m, rm = _weights(mask, record_mask, b)
    r = jnp.where(rm > 0, jnp.asarray(rewards, jnp.float32), 0.0)
    norm_logp = sequence_logprob(logp, m) / _safe_len(m)
    per_record = -r * jnp.exp(jnp.minimum(norm_logp, LOG_RATIO_CAP))
    ref_diff = None if ref_logp is None else _ref_diff(logp, ref_logp, m)
    metrics = _off_rl_metrics(norm_logp, None, ref_diff, _correct_flags(correct, rewards), rm)
    return LossOutput(jnp.sum(rm * per_record), jnp.sum(rm), metrics)


def fpa_loss(
    logp: Array,
    logp_hat: Array,
    mask: Array,
    rewards: Array,
    *,
    fpa_on: Literal["both", "negatives", "positives"] = "both",
    correct: Array | None = None,
    ref_logp: Array | None = None,
    record_mask: Array | None = None,
) -> LossOutput:
    """Future Policy Approximation (002 eq. 3; SPEC §3).

    `w = sg(exp(Σ_t mask_t logπ̂_t / |y|))` with `logπ̂` the extrapolated log-probs of
    SPEC §1 (`losses.logprobs.extrapolated_logprobs`), `L = − R · w · log π(y|x) / |y|`.
    `fpa_on` restricts the extrapolation to incorrect (`negatives`) or correct
    (`positives`) records; elsewhere `w = sg(π(y|x)^{1/|y|})`, so those records get exactly
    Off-RL's gradient (as does every record when `logp_hat == logp`, i.e. λ = 0).
    Correctness is `correct [B]` when given, else `R > 0`.
    """
    _choice("fpa_on", fpa_on, ("both", "negatives", "positives"))
    b, _ = _check_tokens(logp=logp, logp_hat=logp_hat, mask=mask, ref_logp=ref_logp)
    _check_records(b, rewards=rewards, correct=correct, record_mask=record_mask)
    m, rm = _weights(mask, record_mask, b)
    r = jnp.where(rm > 0, jnp.asarray(rewards, jnp.float32), 0.0)
    is_correct = _correct_flags(correct, rewards)
    length = _safe_len(m)
    norm_logp = sequence_logprob(logp, m) / length
    norm_hat = sequence_logprob(logp_hat, m) / length
    if fpa_on == "both":
        use_hat = jnp.ones((b,), bool)
    elif fpa_on == "negatives":
        use_hat = ~is_correct
    else:
        use_hat = is_correct
    log_w = jnp.where(use_hat, norm_hat, norm_logp)
    w = jax.lax.stop_gradient(jnp.exp(jnp.minimum(log_w, LOG_RATIO_CAP)))
    per_record = -r * w * norm_logp
    ref_diff = None if ref_logp is None else _ref_diff(logp, ref_logp, m)
    metrics = _off_rl_metrics(norm_logp, norm_hat, ref_diff, is_correct, rm)
    metrics["fpa_weight_mean"] = _wmean(w, rm)
    return LossOutput(jnp.sum(rm * per_record), jnp.sum(rm), metrics)


# ----------------------------------------------------------------------------- KL terms


def kl_token_values(
    logp: Array, ref_logp: Array, kind: Literal["k1", "k2", "k3"] = "k3"
) -> Array:
    """Per-token KL estimators with `δ = [log π_ref − log π_θ]_{−20}^{20}` (SPEC §3).

    k1 `−δ`, k2 `δ²/2`, k3 `exp(δ) − 1 − δ`. Unmasked: combine with a mask yourself or use
    `kl_penalty` / `kl_per_record`.
    """
    _choice("kind", kind, ("k1", "k2", "k3"))
    delta = jnp.clip(
        jnp.asarray(ref_logp, jnp.float32) - jnp.asarray(logp, jnp.float32),
        -KL_DELTA_CLAMP, KL_DELTA_CLAMP,
    )
    if kind == "k1":
        return -delta
    if kind == "k2":
        return 0.5 * delta**2
    return jnp.expm1(delta) - delta


def kl_per_record(
    logp: Array, ref_logp: Array, mask: Array, *, kind: Literal["k1", "k2", "k3"] = "k1"
) -> Array:
    """Σ_t mask_t k(δ_t) per record [B], e.g. for a reward penalty `R − β · KL`.

    The penalty is data for the reward, so take `stop_gradient` of it if you compute it
    inside a differentiated function.
    """
    _check_tokens(logp=logp, ref_logp=ref_logp, mask=mask)
    m = _token_weights(mask)
    k = kl_token_values(_masked(logp, m), _masked(ref_logp, m), kind)
    return jnp.sum(k * m, axis=-1)


def kl_penalty(
    logp: Array,
    ref_logp: Array,
    mask: Array,
    *,
    kind: Literal["k1", "k2", "k3"] = "k3",
    aggregation: Aggregation = "token-mean",
    max_len: int | None = None,
    record_mask: Array | None = None,
) -> LossOutput:
    """KL(π_θ‖π_ref) estimator as a loss term (SPEC §3): per-token `k(δ)` reduced by
    `aggregation` (add `coef · total/weight` to a policy loss)."""
    b, _ = _check_tokens(logp=logp, ref_logp=ref_logp, mask=mask)
    _check_records(b, record_mask=record_mask)
    m, rm = _weights(mask, record_mask, b)
    per_token = kl_token_values(_masked(logp, m), _masked(ref_logp, m), kind)
    total, weight = aggregate(per_token, m, aggregation, max_len, rm)
    w = m * rm[:, None]
    metrics = {f"kl_{kind}_token_mean": _wmean(per_token, w), "kl_token_max": _wmax(per_token, w)}
    return LossOutput(total, weight, metrics)


def token_forward_kl(ref_logits: Array, logits: Array) -> Array:
    """Exact per-token forward KL `Σ_v π_ref(v) (log π_ref(v) − log π_θ(v))` over the last axis.

    Works on any leading shape, so a caller can apply it chunk by chunk over tokens (e.g.
    [B, T_chunk, V]) and feed the resulting [B, T] values to `off_rl_kl_loss(token_kl=…)`
    without ever holding all B×T×V logits.
    """
    ref_logits = jnp.asarray(ref_logits, jnp.float32)
    logits = jnp.asarray(logits, jnp.float32)
    if ref_logits.shape != logits.shape:
        raise ValueError(
            f"ref_logits {ref_logits.shape} and logits {logits.shape} must have one shape"
        )
    ref_lp = jax.nn.log_softmax(ref_logits, axis=-1)
    lp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.sum(jnp.exp(ref_lp) * (ref_lp - lp), axis=-1)


def off_rl_kl_loss(
    logp: Array,
    ref_logp: Array,
    mask: Array,
    rewards: Array,
    *,
    tau: Scalar = 0.04,
    token_kl: Array | None = None,
    kl_length_norm: bool = True,
    correct: Array | None = None,
    record_mask: Array | None = None,
) -> LossOutput:
    """Forward-KL-regularised Off-RL (002 eq. 33; SPEC §3): `L = L_Off-RL + τ · KL(π_ref‖π_θ)`.

    The data are samples of π_ref, so per record `KL ≈ Σ_t mask_t (logπ_ref,t − logπ_t)`
    (eq. 31's sample estimate). With `token_kl [B, T]` (the exact per-token forward KL over
    the vocabulary, e.g. `token_forward_kl` applied chunk-wise) that exact value is used
    instead. **(choice)** `kl_length_norm=True` divides the per-record KL by |y| (a per-token
    mean), matching Off-RL's length-normalised scale; `False` keeps the sequence KL.
    """
    b, _ = _check_tokens(logp=logp, ref_logp=ref_logp, mask=mask, token_kl=token_kl)
    _check_records(b, rewards=rewards, correct=correct, record_mask=record_mask)
    base = off_rl_loss(logp, mask, rewards, correct=correct, ref_logp=ref_logp,
                       record_mask=record_mask)
    m, rm = _weights(mask, record_mask, b)
    if token_kl is None:
        kl = sequence_logprob(ref_logp, m) - sequence_logprob(logp, m)
    else:
        kl = jnp.sum(_masked(token_kl, m) * m, axis=-1)
    if kl_length_norm:
        kl = kl / _safe_len(m)
    kl_total = jnp.sum(rm * kl)
    tau = jnp.asarray(tau, jnp.float32)
    metrics = dict(base.metrics)
    metrics["kl_forward_mean"] = _wmean(kl, rm)
    metrics["off_rl_loss"] = base.total / jnp.maximum(base.weight, 1e-12)
    return LossOutput(base.total + tau * kl_total, base.weight, metrics)
