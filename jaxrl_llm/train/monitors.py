"""What a TRL user reads every step, computed beside the loss (never part of its gradient).

Per token of the completions, under the loss's own mask and record weights (docs/glossary.md):

- `entropy`: the policy's entropy −Σ_v π_v log π_v at the loss's temperature (the chunked
  kernel computes it in the pass that gives log π: no extra matmul);
- `kl/mu_k3`: KL(μ‖π_θ) from the records' tokens, which μ sampled: k3 = (r − 1) − log r with
  r = π_θ/μ (Schulman's k3 estimator, unbiased for y ~ μ, never negative); only for losses
  that read μ;
- `kl/ref_k3`: KL(π_θ‖π_ref) as TRL's GRPO logs it, exp(Δ) − Δ − 1 with Δ = log π_ref − log π_θ
  on the same tokens; only for losses that read π_ref.

And per record of the whole batch (`batch_monitors`): `reward/mean`, `reward/std` (the rewards
the loss sees, after any group transform) and `completion_length` (tokens per record).

Token means must be exact over micro-batches, whose metrics the step averages weighted by
each micro-batch's loss weight: each one is carried as two metrics, its sum and its token
count divided by that weight (`as_metrics`), whose ratio after averaging is Σ sum / Σ count
(`finish`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

SUM, COUNT = "@sum", "@count"
MONITORS = ("entropy", "kl/mu_k3", "kl/ref_k3")  # logged under their own names, not loss/
_CAP = 20.0  # log-ratios above e^20 would overflow exp in float32; k3 is huge there anyway


def k3(log_ratio: jax.Array) -> jax.Array:
    """exp(x) − 1 − x ≥ 0: Schulman's k3 KL term for the log-ratio x."""
    x = jnp.minimum(log_ratio, _CAP)
    return jnp.expm1(x) - x


def token_monitors(logp: jax.Array, entropy: jax.Array, mask: jax.Array,
                   record_mask: jax.Array, *, logmu: jax.Array | None = None,
                   logref: jax.Array | None = None) -> dict[str, tuple[jax.Array, jax.Array]]:
    """name -> (Σ over weighted tokens, Σ weights); arrays are [R, T] per record, `record_mask`
    [R]; gradients stopped. A token of weight 0 (prompt, padding, an episode's environment
    tokens) is never read, not even an inf or NaN held there (`where`, not a product)."""
    sg = jax.lax.stop_gradient
    weights = mask * record_mask[:, None]
    count = jnp.sum(weights)
    logp = sg(logp)

    def total(values: jax.Array) -> jax.Array:
        return jnp.sum(jnp.where(weights > 0, values, 0.0) * weights)

    out = {"entropy": (total(sg(entropy)), count)}
    if logmu is not None:
        out["kl/mu_k3"] = (total(k3(logp - logmu)), count)
    if logref is not None:
        out["kl/ref_k3"] = (total(k3(logref - logp)), count)
    return out


def as_metrics(sums: dict[str, tuple[jax.Array, jax.Array]], weight: jax.Array) -> dict[str, jax.Array]:
    """The (sum, count) pairs as metrics divided by the micro-batch's loss `weight`."""
    w = jnp.maximum(weight, 1e-12)
    out = {}
    for name, (total, count) in sums.items():
        out[name + SUM] = total / w
        out[name + COUNT] = count / w
    return out


def finish(metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """`metrics` with each sum/count pair replaced by their ratio (the exact token mean)."""
    out = {k: v for k, v in metrics.items() if not k.endswith((SUM, COUNT))}
    for key in metrics:
        if key.endswith(SUM):
            name = key[: -len(SUM)]
            out[name] = metrics[key] / jnp.maximum(metrics[name + COUNT], 1e-12)
    return out


def batch_monitors(rewards: jax.Array, record_mask: jax.Array,
                   completion_tokens: jax.Array) -> dict[str, jax.Array]:
    """Reward mean and (population) std over the batch's records, and their mean length."""
    n = jnp.maximum(jnp.sum(record_mask), 1e-12)
    mean = jnp.sum(rewards * record_mask) / n
    var = jnp.sum(jnp.square(rewards - mean) * record_mask) / n
    return {"reward/mean": mean, "reward/std": jnp.sqrt(var),
            "completion_length": completion_tokens / n}
