"""OAPL: optimal-advantage regression on a lagged inference policy, without importance sampling.

Ritter et al., *LLMs Can Learn to Reason Via Off-Policy RL*, arXiv:2602.19362. The
KL-regularised objective `max_π E[r] − β KL(π ‖ π_lag)` has the closed form
`π* ∝ π_lag · exp(r/β)`, so `β log(π*/π_lag) = r − V*` with `V* = β log E_{π_lag} exp(r/β)`;
OAPL regresses the current policy's sequence log-ratio onto the group estimate of that
advantage:

    L = Σ_x Σ_i ( β₂ log(π(y_i|x) / π_lag(y_i|x)) − (r_i − V̂*(x)) )²,
    V̂*(x) = β₁ log (1/G) Σ_j exp(r_j / β₁)                    (the group of prompt x)

π_lag is the inference policy that sampled the records: the records' μ (`logmu`: the
sampler's log-probs, or the trainer's re-score of the weights that sampled them). The paper
body could not be read here; the formula is the one two implementations of it agree on
(docs/kernels.md § Async-RL objectives names them), A*-PO's (arXiv:2505.20686) with π_ref
replaced by π_lag.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.losses.common import (
    Array,
    Scalar,
    group_batch,
    masked,
    wmax,
    wmean,
)
from jaxrl_llm.losses.preference import soft_group_values
from jaxrl_llm.losses.types import LossOutput

# β₂ of the regression and β₁ of V̂*: the values of the implementations read (NeMo-RL's OAPL
# config: policy_beta 1e-3, vstar_beta 1.0); A*-PO uses β₂ = 1e-3 too (β₁ = 1/2).
OAPL_BETA = 1e-3
OAPL_VALUE_BETA = 1.0


def _check_beta(name: str, value: Scalar) -> None:
    if not isinstance(value, jax.core.Tracer) and not float(value) > 0:
        raise ValueError(f"{name} must be > 0, got {float(value)}")


def oapl_advantages(rewards: Array, group_ids: Array, record_mask: Array | None = None, *,
                    value_beta: Scalar = OAPL_VALUE_BETA, **_: object) -> Array:
    """`Â* = r − V̂*(x)` per record [B], `V̂*` the group's soft value at temperature β₁
    (`preference.soft_group_values`, a max-shifted log-mean-exp). Needs whole groups: the
    train step calls it on the full batch before micro-batching. Padding rows get 0."""
    _check_beta("value_beta", value_beta)
    rewards = jnp.asarray(rewards, jnp.float32)
    b = rewards.shape[0]
    rm = jnp.ones((b,), jnp.float32) if record_mask is None else jnp.asarray(record_mask,
                                                                              jnp.float32)
    values = soft_group_values(rewards, group_ids, beta1=value_beta, record_mask=rm)
    return jnp.where(rm > 0, rewards - values, 0.0)


def oapl_loss(
    logp: Array, logmu: Array, mask: Array, rewards: Array, group_ids: Array, *,
    beta: Scalar = OAPL_BETA,
    value_beta: Scalar = OAPL_VALUE_BETA,
    advantages: Array | None = None,
    record_mask: Array | None = None,
    max_len: int | None = None,  # accepted for the binding's one signature; records, not tokens
) -> LossOutput:
    """OAPL's squared regression per record `(β₂·ℓ_i − Â*_i)²`, averaged over records, with
    `ℓ_i = Σ_t mask_t (log π_t − log π_lag,t)` (`logmu` = π_lag) and `Â* = r − V̂*`
    (`oapl_advantages`, or the given `advantages`). No ratio, no clip: the gradient is
    `2β₂ (β₂ℓ_i − Â*_i) Σ_t ∇log π_t`, zero where π/π_lag already equals `exp(Â*/β₂)`."""
    del max_len
    _check_beta("beta", beta)
    _, _, m, rm, adv = group_batch(
        dict(logp=logp, logmu=logmu, mask=mask), rewards, group_ids, advantages, record_mask,
        lambda rm: oapl_advantages(rewards, group_ids, rm, value_beta=value_beta))
    ell_t = masked(logp, m) - masked(logmu, m)
    ell = jnp.sum(ell_t * m, axis=-1)
    residual = beta * ell - adv
    per_record = jnp.square(residual)
    total, weight = jnp.sum(rm * per_record), jnp.sum(rm)
    w = m * rm[:, None]
    metrics = {
        "log_ratio_mean": wmean(ell_t, w), "log_ratio_max": wmax(ell_t, w),
        "seq_log_ratio_mean": wmean(ell, rm),
        "advantage_mean": wmean(adv, rm), "advantage_abs_mean": wmean(jnp.abs(adv), rm),
        "value_mean": wmean(jnp.asarray(rewards, jnp.float32) - adv, rm),
        "residual_mean": wmean(residual, rm), "residual_abs_mean": wmean(jnp.abs(residual), rm),
    }
    return LossOutput(total, weight, metrics)
