"""Proposition 3.2 of 000, executable: naive REINFORCE's off-policy objective is unbounded,
TOPR's (a⁻ = 0) is bounded.

A tabular softmax policy over four trajectories (the logits are the parameters), a fixed
behaviour policy μ and rewards ±1 with mostly negatives. The expected objective over μ is
evaluated exactly by enumerating the trajectories, using the loss kernels themselves: each
trajectory is one single-token record and `record_mask = μ` weights it, so
`total = Σ_τ μ(τ) L(τ)` and the objective is `−total` (000 eq. 11 with N = 1).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.losses.registry import LOSS_SPECS

MU = np.array([0.1, 0.3, 0.3, 0.3], np.float32)
REWARDS = np.array([1.0, -1.0, -1.0, -1.0], np.float32)  # one positive, three negatives
MASK = np.ones((4, 1), np.float32)
STEPS, LR = 2000, 0.1


def _objective(theta, preset):
    logp = jax.nn.log_softmax(theta)[:, None]
    out = LOSS_SPECS[preset].kernel(logp=logp, logmu=np.log(MU)[:, None], mask=MASK, rewards=REWARDS,
                            record_mask=MU)
    return -out.total


def _ascend(preset):
    grad = jax.grad(_objective)

    def step(theta, _):
        theta = theta + LR * grad(theta, preset)
        return theta, (_objective(theta, preset), theta)

    theta0 = jnp.log(jnp.asarray(MU))  # start on-policy: π = μ
    _, (objectives, thetas) = jax.lax.scan(step, theta0, None, length=STEPS)
    thetas = np.asarray(thetas, np.float64)
    log_probs = thetas - np.log(np.exp(thetas - thetas.max(-1, keepdims=True)).sum(-1,
                                keepdims=True)) - thetas.max(-1, keepdims=True)
    return np.asarray(objectives), log_probs


@pytest.fixture(scope="module")
def runs():
    return {preset: _ascend(preset) for preset in ("reinforce", "topr")}


def test_naive_reinforce_objective_grows_without_bound(runs):
    objectives, log_probs = runs["reinforce"]
    probs = np.exp(log_probs)
    # any policy's true expected reward Σ π R is at most 1 (all mass on the positive) ...
    best_true = float(REWARDS.max())
    true_final = float(probs[-1] @ REWARDS)
    assert true_final <= best_true + 1e-6
    # ... yet the surrogate objective passes it by orders of magnitude and keeps climbing
    assert objectives[-1] > 50 * best_true
    quarters = objectives[[STEPS // 4 - 1, STEPS // 2 - 1, 3 * STEPS // 4 - 1, STEPS - 1]]
    assert np.all(np.diff(quarters) > 10.0), quarters
    # it does so by driving the negative trajectories' probabilities to ~0 (log π → −∞)
    assert probs[-1, 1:].max() < 1e-6
    # the objective is Σ μ R (1 + log π/μ): check the kernel's value against it directly
    expected = float(np.sum(MU * REWARDS * (1 + log_probs[-1] - np.log(MU))))
    np.testing.assert_allclose(objectives[-1], expected, rtol=1e-3)


def test_topr_objective_is_bounded_and_learns_the_positive(runs):
    objectives, log_probs = runs["topr"]
    probs = np.exp(log_probs)
    # Prop. 3.2 bound: negatives contribute −μ ρ(r, 0, 1) ≤ 0 and the positive
    # μ ρ(π/μ, 1, 1) = μ (1 + log π/μ) ≤ μ (1 + log 1/μ) since π ≤ 1
    bound = sum(MU[i] * (1 + math.log(1 / MU[i])) for i in range(4) if REWARDS[i] > 0)
    assert objectives.max() <= bound + 1e-5
    # it converges: the last quarter moves by less than 1% of the bound
    tail = objectives[3 * STEPS // 4:]
    assert tail.max() - tail.min() < 0.01 * bound
    # and the positive trajectory's probability rises from μ = 0.1 towards 1
    assert probs[-1, 0] > 0.95 > MU[0]
    assert np.all(np.diff(probs[:, 0]) > -1e-6)


def test_topr_weights_vanish_on_unlearnt_negatives(runs):
    # with a⁻ = 0 a negative's gradient weight is its ratio π/μ: once unlikely it stops pushing
    _, log_probs = runs["topr"]
    probs = np.exp(log_probs)
    logp = jnp.asarray(log_probs[-1], jnp.float32)[:, None]
    g = jax.grad(lambda lp: LOSS_SPECS["topr"].kernel(logp=lp, logmu=np.log(MU)[:, None], mask=MASK,
                                             rewards=REWARDS, record_mask=MU).total)(logp)
    ratio = probs[-1] / MU
    # ∂total/∂logπ(τ) = −μ(τ) · α(τ) · R(τ), α = 1 for the positive, min(r, 1) for negatives
    expected = -MU * np.where(REWARDS > 0, 1.0, np.minimum(ratio, 1.0)) * REWARDS
    np.testing.assert_allclose(np.asarray(g)[:, 0], expected, rtol=1e-4, atol=1e-9)
