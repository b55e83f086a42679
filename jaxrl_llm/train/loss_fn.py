"""From the `loss:` config to a kernel call on one (micro-)batch.

The model gives hidden states and its unembedding; this module turns them into per-token
log-probs with the chunked kernel (SPEC §1, `losses.logprobs`) and calls the loss selected by
`LossConfig.name` (`losses.policy_gradient.LOSSES`, `losses.preference.PREFERENCE_LOSSES`)
with the `Batch` fields it needs. It returns the kernel's `LossOutput(total, weight,
metrics)`; the train step sums `total` and `weight` over micro-batches and divides once.

Packed rows (`Batch.records_per_row` k > 1, `data.pack`): the log-probs are computed on the
packed rows [B, T] as usual, then every per-token array the kernel reads (π, μ, behaviour
and reference log-probs, FPA's extrapolated log-probs, the exact KL, `loss_mask`) goes through
`data.batch.records_view` into a per-record view [B·k, T], matching the [B·k] per-record
arrays, and the unchanged kernels see one record per view row. Pair losses (`PAIRED_LOSSES`:
`pair_index` holds row numbers) refuse packing.

Temperature: μ's log-probs are scored with the sampling temperature (SPEC §0), so π's are too
(`generate.temperature`; 0 = greedy is treated as 1).
"""

from __future__ import annotations

from typing import Any

import jax

from jaxrl_llm.config import PAIRED_LOSSES, ConfigError, ExperimentConfig
from jaxrl_llm.data.batch import Batch, records_view
from jaxrl_llm.losses import policy_gradient as pg
from jaxrl_llm.losses.advantages import grpo_advantages
from jaxrl_llm.losses.logprobs import (
    extrapolated_logprobs,
    token_forward_kl_chunked,
    token_logprobs,
)
from jaxrl_llm.losses.types import LossOutput

TOPR_FAMILY = ("topr", "sft", "reinforce", "opr", "tis")
GROUP_LOSSES = ("grpo", "dr_grpo")
PREFERENCE_NAMES = ("dpo", "rpo", "kto", "apo")


def temperature(config: ExperimentConfig) -> float:
    t = config.generate.temperature
    return float(t) if t > 0 else 1.0


def needs_full_batch(config: ExperimentConfig) -> bool:
    """Losses whose value couples rows across the batch in ways micro-batching would cut:
    preference pairs (`pair_index` holds global row numbers) and KTO's batch-mean z0."""
    return config.loss.name in PREFERENCE_NAMES


def batch_advantages(config: ExperimentConfig, batch: Batch) -> jax.Array | None:
    """Per-record advantages that need whole groups (GRPO family), computed on the full batch
    before it is split into micro-batches; None for the other losses."""
    if config.loss.name not in GROUP_LOSSES:
        return None
    return grpo_advantages(
        batch.rewards, batch.group_ids, batch.record_mask,
        scale_by_std=config.loss.name == "grpo",
    )


def _topr_bounds(config: ExperimentConfig) -> dict[str, float]:
    """Preset bounds of `loss.name` (000 Table 1), overridden by any bound set in the config."""
    bounds = dict(pg.topr_preset(config.loss.name))
    for key in ("a_pos", "b_pos", "a_neg", "b_neg"):
        value = getattr(config.loss, key)
        if value is not None:
            bounds[key] = value
    return bounds


def compute_loss(
    config: ExperimentConfig,
    batch: Batch,
    hidden: jax.Array,
    unembed: jax.Array,
    *,
    ref_hidden: jax.Array | None = None,
    ref_unembed: jax.Array | None = None,
    softcap: float | None = None,
    advantages: jax.Array | None = None,
) -> LossOutput:
    """The configured loss of `batch` given the policy's `hidden [B,T,d]` and `unembed [d,V]`.

    `ref_hidden`/`ref_unembed` come from the frozen reference model (already under
    `stop_gradient`): required for FPA, and for the reference-log-prob losses when
    `train.ref_logprobs: model`; otherwise those losses read `batch.ref_logprobs`.
    """
    lc = config.loss
    name = lc.name
    tau = temperature(config)
    chunk = lc.logprob_chunk_size
    k = batch.records_per_row
    if k > 1 and name in PAIRED_LOSSES:
        raise ConfigError(
            f"loss.name={name} cannot train on packed rows ({k} records per row, data.pack): "
            "pair_index holds row numbers; set data.pack=false"
        )

    def per_record(x: jax.Array) -> jax.Array:
        """[B, T] → the kernels' per-record token layout ([B·k, T] when packed)."""
        return x if k == 1 else records_view(x, batch.segment_ids, k)

    logp = per_record(token_logprobs(
        hidden, unembed, batch.targets, chunk_size=chunk, temperature=tau, softcap=softcap
    ))
    logmu = per_record(
        batch.mu_logprobs if lc.mu_source == "trainer" else batch.behavior_logprobs
    )
    mask = per_record(batch.loss_mask)
    rm = batch.record_mask

    def ref_logp() -> jax.Array:
        if config.train.ref_logprobs == "batch" or ref_hidden is None:
            return per_record(batch.ref_logprobs)
        return per_record(jax.lax.stop_gradient(
            token_logprobs(ref_hidden, ref_unembed, batch.targets, chunk_size=chunk,
                           temperature=tau, softcap=softcap)
        ))

    if name in TOPR_FAMILY:
        return pg.topr_loss(
            logp, logmu, mask, batch.rewards, **_topr_bounds(config), baseline=lc.baseline,
            length_norm=lc.length_norm, ratio_level=lc.ratio_level, record_mask=rm,
        )
    if name == "ppo":
        return pg.ppo_loss(
            logp, logmu, mask, batch.rewards, clip_eps=lc.clip_eps, baseline=lc.baseline,
            ratio_level=lc.ratio_level, aggregation=lc.aggregation, max_len=batch.seq_len,
            record_mask=rm,
        )
    if name in GROUP_LOSSES:
        if advantages is None:
            advantages = batch_advantages(config, batch)
        options: dict[str, Any] = {"max_len": batch.seq_len, "advantages": advantages,
                                   "record_mask": rm, "clip_eps": lc.clip_eps}
        if name == "grpo":
            options["aggregation"] = lc.aggregation
        return pg.LOSSES[name](logp, logmu, mask, batch.rewards, batch.group_ids, **options)
    if name == "off_rl":
        return pg.off_rl_loss(logp, mask, batch.rewards, correct=batch.correct, record_mask=rm)
    if name == "off_rl_kl":
        token_kl = None
        if lc.kl_exact:
            if ref_hidden is None or ref_unembed is None:
                raise ConfigError(
                    "loss.kl_exact=true needs the reference model's hidden states: set "
                    "train.ref_logprobs: model"
                )
            token_kl = per_record(token_forward_kl_chunked(
                hidden, unembed, ref_hidden, ref_unembed, chunk_size=chunk, temperature=tau,
                softcap=softcap,
            ))
        return pg.off_rl_kl_loss(
            logp, ref_logp(), mask, batch.rewards, tau=lc.kl_tau, token_kl=token_kl,
            correct=batch.correct, record_mask=rm,
        )
    if name == "fpa":
        if ref_hidden is None or ref_unembed is None:
            raise ConfigError("loss.name=fpa needs the reference model's hidden states")
        # w = sg(π̂^{1/|y|}) (002 eq. 3): no gradient through π̂, so build no backward for it.
        logp_hat = extrapolated_logprobs(
            jax.lax.stop_gradient(hidden), jax.lax.stop_gradient(unembed),
            ref_hidden, ref_unembed, batch.targets, lam=lc.fpa_lambda, chunk_size=chunk,
            temperature=tau, softcap=softcap,
        )
        return pg.fpa_loss(
            logp, per_record(jax.lax.stop_gradient(logp_hat)), mask, batch.rewards, fpa_on=lc.fpa_on,
            correct=batch.correct, record_mask=rm,
        )
    if name in PREFERENCE_NAMES:
        return _preference_loss(config, batch, logp, ref_logp(), mask)
    raise ConfigError(f"loss.name={name!r} has no train-step binding")


def _preference_loss(
    config: ExperimentConfig, batch: Batch, logp: jax.Array, ref_logp: jax.Array,
    mask: jax.Array,
) -> LossOutput:
    from jaxrl_llm.losses.preference import PREFERENCE_LOSSES

    lc = config.loss
    options: dict[str, Any] = {
        "dpo": {"beta": lc.beta},
        "rpo": {"beta": lc.beta, "alpha": lc.rpo_alpha},
        "kto": {"beta": lc.beta},
        "apo": {"beta1": lc.apo_beta1, "beta2": lc.apo_beta2},
    }[lc.name]
    return PREFERENCE_LOSSES[lc.name](
        logp=logp, ref_logp=ref_logp, mask=mask, rewards=batch.rewards,
        correct=batch.correct, group_ids=batch.group_ids, pair_index=batch.pair_index,
        record_mask=batch.record_mask, **options,
    )
