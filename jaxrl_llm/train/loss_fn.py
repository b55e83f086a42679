"""From the `loss:` config to a kernel call on one (micro-)batch.

The model gives hidden states and its unembedding; this module turns them into per-token
log-probs with the chunked kernel (`losses.logprobs`) and calls the loss selected by
`LossConfig.name` (`losses.registry.LOSS_SPECS`: kernel, family and required inputs)
with the `Batch` fields it needs. It returns the kernel's `LossOutput(total, weight,
metrics)`; the train step sums `total` and `weight` over micro-batches and divides once.

Packed rows (`Batch.records_per_row` k > 1, `data.pack`): the log-probs are computed on the
packed rows [B, T] as usual, then every per-token array the kernel reads (π, μ, behaviour
and reference log-probs, FPA's extrapolated log-probs, the exact KL, `loss_mask`) goes through
`data.batch.records_view` into a per-record view [B·k, T], matching the [B·k] per-record
arrays, and the unchanged kernels see one record per view row. Pair losses (`LossSpec.needs_pairs`:
`pair_index` holds row numbers) refuse packing.

Temperature: μ's log-probs are scored with the sampling temperature, so π's are too
(`generate.temperature`; 0 = greedy is treated as 1) — except for the losses that compare π
with π_ref (`LossSpec.needs_ref`), where both are at T = 1 (see `temperature`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from jaxrl_llm.config import ConfigError, ExperimentConfig
from jaxrl_llm.data.batch import Batch, records_view
from jaxrl_llm.losses.advantages import grpo_advantages
from jaxrl_llm.losses.logprobs import (
    extrapolated_logprobs,
    token_forward_kl_chunked,
    token_logprobs,
)
from jaxrl_llm.losses.registry import LossSpec
from jaxrl_llm.losses.types import LossOutput
from jaxrl_llm.losses.vocab_chunks import RowSharding
from jaxrl_llm.train.monitors import as_metrics, token_monitors


def temperature(config: ExperimentConfig) -> float:
    """The temperature π's log-probs are computed at: the sampling temperature for losses
    whose ratio compares π with μ (scored at it); T = 1 for losses that compare π with π_ref,
    which the score pass writes at T = 1 — both sides must be one distribution family."""
    if config.loss.spec.needs_ref:
        return 1.0
    t = config.generate.temperature
    return float(t) if t > 0 else 1.0


def needs_full_batch(config: ExperimentConfig) -> bool:
    """Losses whose value couples rows across the batch in ways micro-batching would cut
    (`LossSpec.full_batch`: preference pairs, KTO's batch-mean z0, A*-PO's group values)."""
    return config.loss.spec.full_batch


def batch_advantages(config: ExperimentConfig, batch: Batch) -> jax.Array | None:
    """Per-record advantages that need whole groups (GRPO family and the stale-sample losses,
    all std-scaled but Dr.GRPO; a loss whose entry names its own, `LossSpec.advantages`),
    computed on the full batch before it is split into micro-batches; None for the others."""
    spec = config.loss.spec
    if spec.advantages is not None:
        return spec.advantages()(batch.rewards, batch.group_ids, batch.record_mask,
                                 **spec.kernel_options(dict(config.loss)))
    if spec.family not in ("group", "stale_is"):
        return None
    return grpo_advantages(
        batch.rewards, batch.group_ids, batch.record_mask,
        scale_by_std=config.loss.name != "dr_grpo", ddof=config.loss.std_ddof,
    )


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """What a family binding reads: the config, the loss's options as its kernel's keywords
    (`LossSpec.kernel_options`), batch, per-record token arrays and the (lazily computed)
    reference log-probs and extra kernel inputs."""

    config: ExperimentConfig
    options: dict[str, Any]
    batch: Batch
    logp: jax.Array
    logmu: jax.Array
    mask: jax.Array
    ref_logp: Callable[[], jax.Array]
    per_record: Callable[[jax.Array], jax.Array]
    hidden: jax.Array
    unembed: jax.Array
    ref_hidden: jax.Array | None
    ref_unembed: jax.Array | None
    softcap: float | None
    advantages: jax.Array | None
    row_sharding: RowSharding | None = None


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
    row_sharding: RowSharding | None = None,
) -> LossOutput:
    """The configured loss of `batch` given the policy's `hidden [B,T,d]` and `unembed [d,V]`.

    `ref_hidden`/`ref_unembed` come from the frozen reference model (already under
    `stop_gradient`): required for FPA, and for the reference-log-prob losses when
    `train.ref_logprobs: model`; otherwise those losses read `batch.ref_logprobs`.
    The loss's family (`losses.registry`) selects the binding of batch fields to its kernel.
    `row_sharding` (on a mesh): the unembeddings stay FSDP-split and are gathered one
    vocabulary chunk at a time (`losses.vocab_chunks.RowSharding`).
    """
    lc = config.loss
    spec = lc.spec
    tau = temperature(config)
    chunk = lc.logprob_chunk_size
    k = batch.records_per_row
    if k > 1 and spec.needs_pairs:
        raise ConfigError(
            f"loss.name={lc.name} cannot train on packed rows ({k} records per row, data.pack): "
            "pair_index holds row numbers; set data.pack=false"
        )

    def per_record(x: jax.Array) -> jax.Array:
        """[B, T] → the kernels' per-record token layout ([B·k, T] when packed)."""
        return x if k == 1 else records_view(x, batch.segment_ids, k)

    def ref_logp() -> jax.Array:
        if config.train.ref_logprobs == "batch" or ref_hidden is None:
            return per_record(batch.ref_logprobs)
        return per_record(jax.lax.stop_gradient(
            token_logprobs(ref_hidden, ref_unembed, batch.targets, chunk_size=chunk,
                           temperature=tau, softcap=softcap, row_sharding=row_sharding)
        ))

    logp, entropy = token_logprobs(
        hidden, unembed, batch.targets, chunk_size=chunk, temperature=tau, softcap=softcap,
        row_sharding=row_sharding, return_entropy=True,  # same pass: entropy costs no matmul
    )
    logp, entropy = per_record(logp), per_record(entropy)
    logmu = per_record(
        batch.mu_logprobs if lc.mu_source == "trainer" else batch.behavior_logprobs
    )
    inputs = _Inputs(config, spec.kernel_options(dict(lc)), batch, logp, logmu, per_record(batch.loss_mask), ref_logp,
                     per_record, hidden, unembed, ref_hidden, ref_unembed, softcap, advantages,
                     row_sharding)
    out = _BINDINGS[spec.family](spec, inputs)
    # Entropy and k3 KL to μ / π_ref beside the loss (train/monitors.py).
    sums = token_monitors(logp, entropy, inputs.mask, batch.record_mask,
                          logmu=logmu if spec.needs_mu else None,
                          logref=ref_logp() if spec.needs_ref else None)
    return out._replace(metrics={**out.metrics, **as_metrics(sums, out.weight)})


def _topr_family(spec: LossSpec, x: _Inputs) -> LossOutput:
    b = x.batch
    return spec.kernel(x.logp, x.logmu, x.mask, b.rewards, baseline=x.config.loss.baseline,
                       max_len=b.seq_len, record_mask=b.record_mask, **x.options)


def _group(spec: LossSpec, x: _Inputs) -> LossOutput:
    """GRPO family and the stale-sample losses: the step passes the group advantages computed
    on the full batch before its micro-batch split; a direct call computes them here."""
    b = x.batch
    advantages = x.advantages
    if advantages is None:
        advantages = batch_advantages(x.config, b)
    extra = {"max_len": b.seq_len} if spec.family == "group" else {}
    return spec.kernel(x.logp, x.logmu, x.mask, b.rewards, b.group_ids, advantages=advantages,
                       record_mask=b.record_mask, **extra, **x.options)


def _async(spec: LossSpec, x: _Inputs) -> LossOutput:
    """DPPO, TRM, OAPL, VCPO (μ, groups) and AsymRE (no μ): the step's full-batch advantages
    (`batch_advantages`; VCPO's from its per-record pre-pass, train/score_norms.py), or the
    kernel's own on this batch for a direct call."""
    b = x.batch
    mu = () if spec.family == "asymre" else (x.logmu,)
    return spec.kernel(x.logp, *mu, x.mask, b.rewards, b.group_ids, advantages=x.advantages,
                       record_mask=b.record_mask, max_len=b.seq_len, **x.options)


def _off_rl(spec: LossSpec, x: _Inputs) -> LossOutput:
    lc, b = x.config.loss, x.batch
    if not spec.needs_ref:
        return spec.kernel(x.logp, x.mask, b.rewards, correct=b.correct,
                           record_mask=b.record_mask)
    token_kl = None
    if lc.kl_exact:
        if x.ref_hidden is None or x.ref_unembed is None:
            raise ConfigError(
                "loss.kl_exact=true needs the reference model's hidden states: set "
                "train.ref_logprobs: model"
            )
        token_kl = x.per_record(token_forward_kl_chunked(
            x.hidden, x.unembed, x.ref_hidden, x.ref_unembed, chunk_size=lc.logprob_chunk_size,
            temperature=temperature(x.config), softcap=x.softcap, row_sharding=x.row_sharding,
        ))
    return spec.kernel(
        x.logp, x.ref_logp(), x.mask, b.rewards, token_kl=token_kl, correct=b.correct,
        record_mask=b.record_mask, **x.options,
    )


def _fpa(spec: LossSpec, x: _Inputs) -> LossOutput:
    lc, b = x.config.loss, x.batch
    if x.ref_hidden is None or x.ref_unembed is None:
        raise ConfigError("loss.name=fpa needs the reference model's hidden states")
    # w = sg(π̂^{1/|y|}) (FPA eq. 3): no gradient through π̂, so build no backward for it.
    logp_hat = extrapolated_logprobs(
        jax.lax.stop_gradient(x.hidden), jax.lax.stop_gradient(x.unembed),
        x.ref_hidden, x.ref_unembed, b.targets, lam=lc.fpa_lambda,
        chunk_size=lc.logprob_chunk_size, temperature=temperature(x.config), softcap=x.softcap,
        row_sharding=x.row_sharding,
    )
    return spec.kernel(
        x.logp, x.per_record(jax.lax.stop_gradient(logp_hat)), x.mask, b.rewards,
        correct=b.correct, record_mask=b.record_mask, **x.options,
    )


def _preference(spec: LossSpec, x: _Inputs) -> LossOutput:
    b = x.batch
    return spec.kernel(
        logp=x.logp, ref_logp=x.ref_logp(), mask=x.mask, rewards=b.rewards,
        correct=b.correct, group_ids=b.group_ids, pair_index=b.pair_index,
        record_mask=b.record_mask, **x.options,
    )


# `LossSpec.family` → how the batch's fields are bound to the family's kernel.
_BINDINGS: dict[str, Callable[[LossSpec, _Inputs], LossOutput]] = {
    # ppo binds the TOPR family's arrays and baseline; its options are its entry's
    "topr": _topr_family, "ppo": _topr_family, "group": _group, "stale_is": _group,
    "async": _async, "asymre": _async,
    "off_rl": _off_rl, "fpa": _fpa, "preference": _preference,
}
