"""Shared pieces of the async-RL objectives' oracle tests (DPPO, TRM, OAPL, VCPO, AsymRE):
random batches with masked tokens holding garbage, and the kernel's loss and gradient with
respect to log π_t. Nothing here computes an expected value: each test file transcribes its
paper's equations itself."""

from __future__ import annotations

import jax
import numpy as np

from jaxrl_llm.losses.registry import LOSS_SPECS

GROUPS = np.array([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2])


def batch(seed: int, b: int = 12, t: int = 9, spread: float = 0.5, low: float = 0.05,
          high: float = 0.95):
    """(log π, log μ, mask, rewards): token probabilities of μ uniform in [low, high] (so the
    Binary divergences range widely), log π = log μ + N(0, spread) (kept < 0), a quarter of
    the tokens masked (token 0 never), 0/1 rewards plus noise."""
    rng = np.random.default_rng(seed)
    logmu = np.log(rng.uniform(low, high, (b, t)))
    logp = np.minimum(logmu + rng.normal(0.0, spread, (b, t)), -1e-3)
    mask = (rng.random((b, t)) > 0.25).astype(np.float64)
    mask[:, 0] = 1.0
    rewards = rng.integers(0, 2, b).astype(np.float64) + rng.normal(0, 0.1, b)
    return logp, logmu, mask, rewards


def with_garbage(logp, logmu, mask, value=np.nan):
    """The same batch with `value` at every masked token of log π and log μ."""
    off = mask == 0
    return np.where(off, value, logp), np.where(off, value, logmu)


def run(name: str, logp, logmu, mask, rewards, groups=GROUPS, **kw):
    """`(LossOutput, loss, d loss / d log π_t)` of loss `name` (float32 inputs, as the trainer
    gives them). `logmu=None` for a loss that reads no μ (AsymRE)."""
    kernel = LOSS_SPECS[name].kernel
    rest = [np.asarray(x, np.float32) for x in (mask, rewards)]
    mu = () if logmu is None else (np.asarray(logmu, np.float32),)
    lp = np.asarray(logp, np.float32)

    def f(x):
        return kernel(x, *mu, *rest, groups, **kw).loss

    out = kernel(lp, *mu, *rest, groups, **kw)
    return out, float(out.loss), np.asarray(jax.grad(f)(lp), np.float64)


def centred(rewards, groups):
    """R − mean_g R, by loops."""
    out = np.zeros_like(rewards)
    for g in np.unique(groups):
        sel = groups == g
        out[sel] = rewards[sel] - rewards[sel].mean()
    return out


def normalised(rewards, groups):
    """(R − mean_g R)/(std_g R + 1e-6), population std (FPA arXiv:2509.19893 eq. 34)."""
    out = np.zeros_like(rewards)
    for g in np.unique(groups):
        sel = groups == g
        out[sel] = (rewards[sel] - rewards[sel].mean()) / (rewards[sel].std() + 1e-6)
    return out
