"""`train.grad_norm_by_sign`: the step's `grad_norm_positive` / `grad_norm_negative` are the
norms of the gradients of the positive / negative records' share of the loss (each over the
full batch's weight), checked against gradients of a naive full-logits loss computed here
with the other side's rewards zeroed; the two sum to the full gradient; a batch of positives
only has no negative gradient. Runs sharded (2×2×2 mesh) with 2 micro-batches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm.config import ConfigError
from jaxrl_llm.eval.window import is_count_metric
from jaxrl_llm.parallel.distributed import global_batch
from jaxrl_llm.parallel.mesh import make_mesh
from jaxrl_llm.train.loss_fn import batch_advantages
from jaxrl_llm.train.state import create_train_state
from jaxrl_llm.train.step import check_sign_split, make_train_step, positive_records

from .helpers import B, make_batch, make_config, naive_token_logprobs, naive_topr_loss, to_numpy
from .toy_model import ToyLM

MESH = (2, 2, 2)


def toy() -> ToyLM:
    with nnx.use_eager_sharding(False):
        return ToyLM(rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def split_step():
    """TOPR step with the split on, 2 micro-batches of 4 rows on 8 devices, compiled once."""
    config = make_config("topr", MESH, train={"micro_batch_size": 4, "grad_norm_by_sign": True})
    mesh = make_mesh(config.mesh, jax.devices()[:8])
    step = make_train_step(config, mesh, create_train_state(config, mesh, toy()))

    def run(batch):
        state = create_train_state(config, mesh, toy())
        before = to_numpy(state.params)
        new_state, metrics = step(state, global_batch(batch, mesh))
        # SGD with lr 1 and no clipping: the update is exactly −gradient.
        grads = jax.tree.map(lambda b, a: b - a, before, to_numpy(new_state.params))
        return grads, to_numpy(metrics)

    return run


def naive_grads(batch, keep: np.ndarray) -> list[np.ndarray]:
    """Gradient leaves of the naive TOPR loss (mean over all B records) where only the `keep`
    records contribute: the others get reward 0, hence advantage 0 and no loss term."""
    masked = batch.replace(rewards=np.where(keep, batch.rewards, 0.0).astype(np.float32))
    masked = jax.tree.map(jnp.asarray, masked)

    def loss_of(m):
        hidden = m(masked.inputs, positions=masked.positions)
        return naive_topr_loss(naive_token_logprobs(hidden, m.unembedding(), masked.targets),
                               masked)

    grads = nnx.grad(loss_of)(toy())
    return [np.asarray(g, np.float64) for g in jax.tree.leaves(nnx.state(grads, nnx.Param))]


def norm(leaves) -> float:
    return float(np.sqrt(sum(np.sum(np.square(x)) for x in leaves)))


def test_positive_and_negative_gradients_sum_to_the_full_gradient(split_step):
    batch = make_batch()
    positive = batch.rewards >= 0
    assert 0 < positive.sum() < B  # both sides present
    step_grads, metrics = split_step(batch)
    g_pos, g_neg = naive_grads(batch, positive), naive_grads(batch, ~positive)
    np.testing.assert_allclose(metrics["grad_norm_positive"], norm(g_pos), rtol=1e-5)
    np.testing.assert_allclose(metrics["grad_norm_negative"], norm(g_neg), rtol=1e-5)
    assert norm(g_pos) > 0 and norm(g_neg) > 0
    total = [p + n for p, n in zip(g_pos, g_neg)]
    np.testing.assert_allclose(metrics["grad_norm"], norm(total), rtol=1e-5)
    for got, want in zip(jax.tree.leaves(step_grads), total):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-5)


def test_positives_only_batch_has_no_negative_gradient(split_step):
    batch = make_batch(seed=1)
    rewards = np.abs(batch.rewards).astype(np.float32)
    batch = batch.replace(rewards=rewards, correct=rewards > 0)
    _, metrics = split_step(batch)
    assert metrics["grad_norm_negative"] == 0.0
    assert metrics["grad_norm"] > 0
    np.testing.assert_allclose(metrics["grad_norm_positive"], metrics["grad_norm"], rtol=1e-6)


def test_sign_definitions_per_loss_family():
    batch = make_batch()
    rewards = np.array([1.0, 0.5, 0.2, -1.0, 0.0, 2.0, 0.6, 0.4], np.float32)
    correct = np.array([1, 0, 0, 1, 0, 1, 1, 0], bool)
    batch = batch.replace(rewards=rewards, correct=correct)
    # TOPR/PPO: A = R − baseline ≥ 0.
    topr = make_config("topr")
    topr.loss.baseline = 0.5
    np.testing.assert_array_equal(positive_records(topr, batch, None), rewards >= 0.5)
    # FPA / Off-RL: the correct flag, whatever the reward.
    for name in ("fpa", "off_rl"):
        got = positive_records(make_config(name), batch, None)
        np.testing.assert_array_equal(got, correct)
    # GRPO: group advantage; groups are rows 0–3 and 4–7 (means 0.175 and 0.75).
    grpo = make_config("grpo")
    adv = batch_advantages(grpo, jax.tree.map(jnp.asarray, batch))
    expected = np.array([1, 1, 1, 0, 0, 1, 0, 0], bool)
    np.testing.assert_array_equal(positive_records(grpo, batch, adv), expected)


def test_pair_losses_reject_the_split_and_window_averages_it():
    with pytest.raises(ConfigError, match="train.grad_norm_by_sign"):
        check_sign_split(make_config("dpo", train={"grad_norm_by_sign": True}))
    check_sign_split(make_config("dpo"))  # off: fine
    # The logging window averages the norms over its steps rather than summing them.
    assert not any(map(is_count_metric, ("grad_norm_positive", "grad_norm_negative")))
