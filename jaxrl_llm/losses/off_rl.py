"""Off-RL and Future Policy Approximation (FPA arXiv:2509.19893), and the KL terms.

Same contract as every kernel (`losses.common`): `LossOutput(total, weight, metrics)` with
loss = `total / weight`.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from jaxrl_llm.losses.common import (
    LOG_RATIO_CAP,
    Aggregation,
    Array,
    Scalar,
    aggregate,
    check_choice,
    check_records,
    check_tokens,
    masked,
    safe_len,
    sequence_logprob,
    token_record_weights,
    token_weights,
    wmax,
    wmean,
)
from jaxrl_llm.losses.types import LossOutput

# δ clamp of the KL estimators.
KL_DELTA_CLAMP = 20.0



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
    """FPA Fig. 2/3 quantities: π^{1/|y|}, π̂^{1/|y|}, log π − log π_ref per correctness."""
    wc = rm * correct
    wi = rm * (~correct)
    pi_norm = jnp.exp(jnp.minimum(norm_logp, 0.0))
    out = {
        "num_correct": jnp.sum(wc),
        "num_incorrect": jnp.sum(wi),
        "pi_norm_mean_correct": wmean(pi_norm, wc),
        "pi_norm_mean_incorrect": wmean(pi_norm, wi),
        "count_pi_below_0.2_incorrect": jnp.sum(wi * (pi_norm < 0.2)),
    }
    if norm_logp_hat is not None:
        hat_norm = jnp.exp(jnp.minimum(norm_logp_hat, LOG_RATIO_CAP))
        out |= {
            "pi_hat_norm_mean_correct": wmean(hat_norm, wc),
            "pi_hat_norm_mean_incorrect": wmean(hat_norm, wi),
            "count_pi_hat_below_0.2_incorrect": jnp.sum(wi * (hat_norm < 0.2)),
        }
    if seq_ref_diff is not None:
        out |= {
            "logp_minus_ref_mean_correct": wmean(seq_ref_diff, wc),
            "logp_minus_ref_mean_incorrect": wmean(seq_ref_diff, wi),
        }
    return out


def _ref_diff(logp: Array, ref_logp: Array, m: Array) -> Array:
    """`log π(y|x) − log π_ref(y|x)` per record (FPA Fig. 2's quantity)."""
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
    """Off-RL (FPA eq. 1): `L = − R · π(y|x)^{1/|y|} = − R · exp(log π(y|x)/|y|)`.

    `correct [B]` (default `R > 0`) and `ref_logp [B, T]` only feed the metrics.
    """
    b, _ = check_tokens(logp=logp, mask=mask, ref_logp=ref_logp)
    check_records(b, rewards=rewards, correct=correct, record_mask=record_mask)
    m, rm = token_record_weights(mask, record_mask, b)
    r = jnp.where(rm > 0, jnp.asarray(rewards, jnp.float32), 0.0)
    norm_logp = sequence_logprob(logp, m) / safe_len(m)
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
    """Future Policy Approximation (FPA eq. 3).

    `w = sg(exp(Σ_t mask_t logπ̂_t / |y|))` with `logπ̂` the extrapolated log-probs of
    docs/kernels.md § Token log-probs (`losses.logprobs.extrapolated_logprobs`), `L = − R · w · log π(y|x) / |y|`.
    `fpa_on` restricts the extrapolation to incorrect (`negatives`) or correct
    (`positives`) records; elsewhere `w = sg(π(y|x)^{1/|y|})`, so those records get exactly
    Off-RL's gradient (as does every record when `logp_hat == logp`, i.e. λ = 0).
    Correctness is `correct [B]` when given, else `R > 0`.
    """
    check_choice("fpa_on", fpa_on, ("both", "negatives", "positives"))
    b, _ = check_tokens(logp=logp, logp_hat=logp_hat, mask=mask, ref_logp=ref_logp)
    check_records(b, rewards=rewards, correct=correct, record_mask=record_mask)
    m, rm = token_record_weights(mask, record_mask, b)
    r = jnp.where(rm > 0, jnp.asarray(rewards, jnp.float32), 0.0)
    is_correct = _correct_flags(correct, rewards)
    length = safe_len(m)
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
    metrics["fpa_weight_mean"] = wmean(w, rm)
    return LossOutput(jnp.sum(rm * per_record), jnp.sum(rm), metrics)


# ----------------------------------------------------------------------------- KL terms


def kl_token_values(
    logp: Array, ref_logp: Array, kind: Literal["k1", "k2", "k3"] = "k3"
) -> Array:
    """Per-token KL estimators with `δ = [log π_ref − log π_θ]_{−20}^{20}` (docs/kernels.md § TOPR family, PPO, GRPO, Off-RL, FPA, KL).

    k1 `−δ`, k2 `δ²/2`, k3 `exp(δ) − 1 − δ`. Unmasked: combine with a mask yourself or use
    `kl_penalty` / `kl_per_record`.
    """
    check_choice("kind", kind, ("k1", "k2", "k3"))
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
    check_tokens(logp=logp, ref_logp=ref_logp, mask=mask)
    m = token_weights(mask)
    k = kl_token_values(masked(logp, m), masked(ref_logp, m), kind)
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
    """KL(π_θ‖π_ref) estimator as a loss term (docs/kernels.md § TOPR family, PPO, GRPO, Off-RL, FPA, KL): per-token `k(δ)` reduced by
    `aggregation` (add `coef · total/weight` to a policy loss)."""
    b, _ = check_tokens(logp=logp, ref_logp=ref_logp, mask=mask)
    check_records(b, record_mask=record_mask)
    m, rm = token_record_weights(mask, record_mask, b)
    per_token = kl_token_values(masked(logp, m), masked(ref_logp, m), kind)
    total, weight = aggregate(per_token, m, aggregation, max_len, rm)
    w = m * rm[:, None]
    metrics = {f"kl_{kind}_token_mean": wmean(per_token, w), "kl_token_max": wmax(per_token, w)}
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
    """Forward-KL-regularised Off-RL (FPA eq. 33): `L = L_Off-RL + τ · KL(π_ref‖π_θ)`.

    The data are samples of π_ref, so per record `KL ≈ Σ_t mask_t (logπ_ref,t − logπ_t)`
    (eq. 31's sample estimate). With `token_kl [B, T]` (the exact per-token forward KL over
    the vocabulary, e.g. `token_forward_kl` applied chunk-wise) that exact value is used
    instead. **(choice)** `kl_length_norm=True` divides the per-record KL by |y| (a per-token
    mean), matching Off-RL's length-normalised scale; `False` keeps the sequence KL.
    """
    b, _ = check_tokens(logp=logp, ref_logp=ref_logp, mask=mask, token_kl=token_kl)
    check_records(b, rewards=rewards, correct=correct, record_mask=record_mask)
    base = off_rl_loss(logp, mask, rewards, correct=correct, ref_logp=ref_logp,
                       record_mask=record_mask)
    m, rm = token_record_weights(mask, record_mask, b)
    if token_kl is None:
        kl = sequence_logprob(ref_logp, m) - sequence_logprob(logp, m)
    else:
        kl = jnp.sum(masked(token_kl, m) * m, axis=-1)
    if kl_length_norm:
        kl = kl / safe_len(m)
    kl_total = jnp.sum(rm * kl)
    tau = jnp.asarray(tau, jnp.float32)
    metrics = dict(base.metrics)
    metrics["kl_forward_mean"] = wmean(kl, rm)
    metrics["off_rl_loss"] = base.total / jnp.maximum(base.weight, 1e-12)
    return LossOutput(base.total + tau * kl_total, base.weight, metrics)
