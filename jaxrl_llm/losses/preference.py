"""Preference and supervised losses: DPO, RPO, KTO, offline A*-PO, SFT (docs/kernels.md § Preference losses).

Same contract as every kernel (docs/kernels.md, top): per-token arrays `[B, T]` and a
completion mask in, `LossOutput(total, weight, metrics)` out, with loss = `total / weight`.

Inputs shared by all kernels:
- `logp [B, T]` per-token log-probs of the trained policy, `ref_logp [B, T]` of the frozen
  reference, `mask [B, T]` 1 on completion tokens (docs/kernels.md notation). Values where `mask = 0` are
  ignored even if NaN/inf. `log π(y|x) = Σ_t mask_t logp_t`.
- `record_mask [B]` (optional): 0 for padding rows; padding rows never enter a loss.
- Pairwise losses take `pair_index [P, 2]` of (chosen row, rejected row) into the batch rows,
  the layout of `jaxrl_llm.data.batch.Batch.pair_index` (built on the host by
  `jaxrl_llm.data.pairs.make_pairs`). A pair
  holding a negative index (`-1`, as `make_pairs(..., pad_to=P)` pads) is padding, and so is
  a pair touching a row with `record_mask = 0`. `weight` = the number of real pairs.

Metrics follow TRL's names where they exist: the implicit reward of a completion is
`β (log π(y) − log π_ref(y))`; `reward_margin` is its chosen − rejected mean and
`reward_accuracy` the fraction of pairs with Δ > 0.

The FPA substitution (FPA arXiv:2509.19893 eq. 8: DPO on π̂ equals DPO with β(1+λ) on π) holds only in the
contextual-bandit setting, where one softmax covers whole completions; with autoregressive
per-token normalisers it is approximate (tests/losses/test_preference.py shows both).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping

import chex
import jax
import jax.numpy as jnp

from jaxrl_llm.losses.advantages import group_segments
from jaxrl_llm.losses.common import record_weights, wmean
from jaxrl_llm.losses.preference_inputs import (
    _check_records,
    _check_tokens,
    _lengths,
    _pair_logratios,
    _pair_metrics,
    _sequence_logprob,
)
from jaxrl_llm.losses.types import LossOutput

__all__ = [
    "PREFERENCE_LOSSES",
    "apo_loss",
    "dpo_loss",
    "kto_loss",
    "rpo_loss",
    "sft_loss",
    "soft_group_values",
]

Array = jax.Array

# Defaults of docs/kernels.md § Preference losses (FPA App. B.2; TOPR arXiv:2503.14286 §2.3 and §4.3).
DPO_BETA = 0.1
RPO_ALPHA = 1.0
KTO_BETA = 0.1
KTO_LAMBDA_W = 1.0
KTO_LAMBDA_L = 1.0
APO_BETA1 = 0.5
APO_BETA2 = 1e-3
MAX_PAIRS_PER_PROMPT = 16


# ---------------------------------------------------------------- pairwise losses


def dpo_loss(
    logp: Array,
    ref_logp: Array,
    mask: Array,
    pair_index: Array,
    *,
    beta: float | Array = DPO_BETA,
    record_mask: Array | None = None,
) -> LossOutput:
    """DPO: `L = − log σ(β Δ)` per pair (docs/kernels.md § Preference losses; FPA App. B.2).

    `Δ = [log π(y_w) − log π_ref(y_w)] − [log π(y_l) − log π_ref(y_l)]`, β = 0.1.
    Returns `total = Σ_pairs L`, `weight = #pairs` (padding pairs excluded).
    """
    chosen_lr, rejected_lr, pw, _ = _pair_logratios(
        "dpo_loss", logp, ref_logp, mask, pair_index, record_mask
    )
    per_pair = jax.nn.softplus(-beta * (chosen_lr - rejected_lr))  # −log σ(x) = softplus(−x)
    metrics = _pair_metrics(beta, chosen_lr, rejected_lr, pw)
    return LossOutput(jnp.sum(pw * per_pair), jnp.sum(pw), metrics)


def rpo_loss(
    logp: Array,
    ref_logp: Array,
    mask: Array,
    pair_index: Array,
    *,
    beta: float | Array = DPO_BETA,
    alpha: float | Array = RPO_ALPHA,
    record_mask: Array | None = None,
) -> LossOutput:
    """RPO: `L = L_DPO − α · log π(y_w)/|y_w|` per pair (docs/kernels.md § Preference losses; TOPR §2.3), α = 1.

    The length-normalised NLL of the chosen completion counts once per pair it appears in.
    """
    chosen_lr, rejected_lr, pw, chosen = _pair_logratios(
        "rpo_loss", logp, ref_logp, mask, pair_index, record_mask
    )
    chosen_nll = -_sequence_logprob(logp, mask)[chosen] / jnp.maximum(_lengths(mask)[chosen], 1.0)
    per_pair = jax.nn.softplus(-beta * (chosen_lr - rejected_lr)) + alpha * chosen_nll
    metrics = dict(_pair_metrics(beta, chosen_lr, rejected_lr, pw))
    metrics["chosen_nll_per_token"] = wmean(chosen_nll, pw)
    return LossOutput(jnp.sum(pw * per_pair), jnp.sum(pw), metrics)


# ---------------------------------------------------------------- per-record losses


def kto_loss(
    logp: Array,
    ref_logp: Array,
    mask: Array,
    correct: Array,
    *,
    beta: float | Array = KTO_BETA,
    lambda_w: float | Array = KTO_LAMBDA_W,
    lambda_l: float | Array = KTO_LAMBDA_L,
    record_mask: Array | None = None,
    z0: Array | None = None,
) -> LossOutput:
    """KTO (docs/kernels.md § Preference losses; TOPR §2.3): `L = λ_y − v` per record.

    `r_θ = log π(y) − log π_ref(y)`; `z0 = max(0, mean_batch r_θ)`, detached;
    `v = λ_w σ(β(r_θ − z0))` if correct, `λ_l σ(β(z0 − r_θ))` if not. β = 0.1, λ_w = λ_l = 1.
    `z0` is the mean over *this call's* records; pass `z0` (e.g. from the full batch) to use
    one reference point across micro-batches. Returns `total = Σ L`, `weight = #records`.
    """
    batch = _check_tokens("kto_loss", mask, logp=logp, ref_logp=ref_logp)
    _check_records("kto_loss", batch, correct=correct, record_mask=record_mask)
    rw = record_weights(record_mask, batch)
    good = jnp.asarray(correct).astype(bool)
    logratio = _sequence_logprob(logp, mask) - _sequence_logprob(ref_logp, mask)
    if z0 is None:
        z0 = jnp.maximum(0.0, wmean(logratio, rw))
    z0 = jax.lax.stop_gradient(jnp.asarray(z0, logratio.dtype))
    value = jnp.where(
        good, lambda_w * jax.nn.sigmoid(beta * (logratio - z0)),
        lambda_l * jax.nn.sigmoid(beta * (z0 - logratio)),
    )
    per_record = jnp.where(good, lambda_w, lambda_l) - value
    w_good, w_bad = rw * good, rw * (~good)
    chosen_lr, rejected_lr = wmean(logratio, w_good), wmean(logratio, w_bad)
    metrics = {
        "z0": z0,
        "chosen_logratio": chosen_lr,
        "rejected_logratio": rejected_lr,
        "reward_margin": beta * (chosen_lr - rejected_lr),
        "num_correct": jnp.sum(w_good),
        "num_incorrect": jnp.sum(w_bad),
    }
    return LossOutput(jnp.sum(rw * per_record), jnp.sum(rw), metrics)


def soft_group_values(
    rewards: Array,
    group_ids: Array,
    *,
    beta1: float | Array = APO_BETA1,
    record_mask: Array | None = None,
) -> Array:
    """A*-PO's per-prompt value `V̂ = β₁ log mean_{i∈group} exp(R_i/β₁)` (docs/kernels.md § Preference losses), per row [B].

    Padding rows (record_mask 0) neither enter a group's value nor get a meaningful one
    (their value is 0). Groups need all their records in this call.
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    group_ids = jnp.asarray(group_ids)
    batch = rewards.shape[0]
    chex.assert_shape(group_ids, (batch,))
    rw = record_weights(record_mask, batch) > 0
    seg = group_segments(group_ids)
    scaled = jnp.where(rw, rewards / beta1, -jnp.inf)
    top = jax.ops.segment_max(scaled, seg, num_segments=batch)[seg]
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    # log-mean-exp with the group max factored out: no overflow for any β₁
    sums = jax.ops.segment_sum(jnp.where(rw, jnp.exp(scaled - top), 0.0), seg, num_segments=batch)
    counts = jax.ops.segment_sum(rw.astype(jnp.float32), seg, num_segments=batch)
    log_mean = jnp.log(jnp.maximum(sums[seg], 1e-30)) - jnp.log(jnp.maximum(counts[seg], 1.0))
    return jnp.where(rw, beta1 * (top + log_mean), 0.0)


def apo_loss(
    logp: Array,
    ref_logp: Array,
    mask: Array,
    rewards: Array,
    group_ids: Array,
    *,
    beta1: float | Array = APO_BETA1,
    beta2: float | Array = APO_BETA2,
    record_mask: Array | None = None,
    values: Array | None = None,
) -> LossOutput:
    """Offline A*-PO (docs/kernels.md § Preference losses; FPA App. B.2): `L = (β₂ (log π(y) − log π_ref(y)) − (R − V̂))²`.

    `V̂` per prompt from `soft_group_values` (β₁ = 0.5) over the records of this call; pass
    `values [B]` to use values estimated elsewhere (e.g. over the whole offline dataset).
    β₂ = 1e-3. Returns `total = Σ L`, `weight = #records`.
    """
    batch = _check_tokens("apo_loss", mask, logp=logp, ref_logp=ref_logp)
    _check_records(
        "apo_loss", batch, rewards=rewards, group_ids=group_ids, record_mask=record_mask,
        values=values,
    )
    rw = record_weights(record_mask, batch)
    rewards = jnp.asarray(rewards, jnp.float32)
    if values is None:
        values = soft_group_values(rewards, group_ids, beta1=beta1, record_mask=record_mask)
    advantage = jax.lax.stop_gradient(rewards - jnp.asarray(values, jnp.float32))
    logratio = _sequence_logprob(logp, mask) - _sequence_logprob(ref_logp, mask)
    per_record = jnp.square(beta2 * logratio - advantage)
    metrics = {
        "logratio": wmean(logratio, rw),
        "value": wmean(jnp.asarray(values, jnp.float32), rw),
        "advantage": wmean(advantage, rw),
        "advantage_abs": wmean(jnp.abs(advantage), rw),
    }
    return LossOutput(jnp.sum(rw * per_record), jnp.sum(rw), metrics)


def sft_loss(
    logp: Array,
    mask: Array,
    *,
    length_norm: bool = False,
    record_mask: Array | None = None,
) -> LossOutput:
    """SFT on gold or positive completions: `L = − log π(y|x)`, or `/|y|` (docs/kernels.md § Preference losses).

    Select the records with `record_mask` (e.g. `correct` for positives only).
    Returns `total = Σ L`, `weight = #records`.
    """
    batch = _check_tokens("sft_loss", mask, logp=logp)
    _check_records("sft_loss", batch, record_mask=record_mask)
    rw = record_weights(record_mask, batch)
    nll = -_sequence_logprob(logp, mask)
    lengths = _lengths(mask)
    per_record = nll / jnp.maximum(lengths, 1.0) if length_norm else nll
    metrics = {
        "nll_per_token": jnp.sum(rw * nll) / jnp.maximum(jnp.sum(rw * lengths), 1.0),
        "num_records": jnp.sum(rw),
    }
    return LossOutput(jnp.sum(rw * per_record), jnp.sum(rw), metrics)


# ---------------------------------------------------------------- registry for the train step

PreferenceLossFn = Callable[..., LossOutput]


def _dpo_entry(logp, ref_logp, mask, *, pair_index, record_mask=None, **options) -> LossOutput:
    return dpo_loss(logp, ref_logp, mask, pair_index, record_mask=record_mask, **options)


def _rpo_entry(logp, ref_logp, mask, *, pair_index, record_mask=None, **options) -> LossOutput:
    return rpo_loss(logp, ref_logp, mask, pair_index, record_mask=record_mask, **options)


def _kto_entry(logp, ref_logp, mask, *, correct, record_mask=None, **options) -> LossOutput:
    return kto_loss(logp, ref_logp, mask, correct, record_mask=record_mask, **options)


def _apo_entry(
    logp, ref_logp, mask, *, rewards, group_ids, record_mask=None, **options
) -> LossOutput:
    return apo_loss(logp, ref_logp, mask, rewards, group_ids, record_mask=record_mask, **options)


def _sft_entry(
    logp, ref_logp, mask, *, correct=None, record_mask=None, positives_only: bool = True,
    **options,
) -> LossOutput:
    del ref_logp  # SFT needs no reference; the uniform signature passes it anyway
    weights = record_weights(record_mask, int(jnp.shape(mask)[0]))
    if positives_only and correct is not None:
        weights = weights * jnp.asarray(correct).astype(jnp.float32)
    return sft_loss(logp, mask, record_mask=weights, **options)


def _uniform(entry: PreferenceLossFn) -> PreferenceLossFn:
    """Accept every Batch field by keyword and pass on only what the loss needs."""
    names = set(inspect.signature(entry).parameters)

    def call(logp, ref_logp, mask, *, pair_index=None, rewards=None, correct=None,
             group_ids=None, record_mask=None, **options) -> LossOutput:
        fields = {"pair_index": pair_index, "rewards": rewards, "correct": correct,
                  "group_ids": group_ids, "record_mask": record_mask}
        needed = {k: v for k, v in fields.items() if k in names}
        return entry(logp, ref_logp, mask, **needed, **options)

    call.__doc__ = entry.__doc__
    call.__name__ = entry.__name__.strip("_").replace("_entry", "")
    return call


# `PREFERENCE_LOSSES[name](logp, ref_logp, mask, *, pair_index=, rewards=, correct=,
# group_ids=, record_mask=, **options)`: one signature for the train step; each loss reads the
# Batch fields it needs and takes its own options (beta, alpha, ..., `positives_only` for sft).
PREFERENCE_LOSSES: Mapping[str, PreferenceLossFn] = {
    "dpo": _uniform(_dpo_entry),
    "rpo": _uniform(_rpo_entry),
    "kto": _uniform(_kto_entry),
    "apo": _uniform(_apo_entry),
    "sft": _uniform(_sft_entry),
}
