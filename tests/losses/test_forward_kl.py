"""Exact per-token forward KL over vocabulary chunks (SPEC §3 "Forward-KL Off-RL", 002 eq. 33).

Every expected value comes from the naive full-softmax formula written here, independently of
the kernel: full logits `H @ W` at highest matmul precision, `jax.nn.log_softmax`, and
`Σ_v q_v (log q_v − log p_v)`; gradients of that naive form come from `jax.grad`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.losses.logprobs import token_forward_kl_chunked
from jaxrl_llm.losses.policy_gradient import off_rl_kl_loss

HIGHEST = jax.lax.Precision.HIGHEST
B, T, D, D_REF = 2, 5, 16, 12
TOL = {"rtol": 1e-5, "atol": 1e-5}


def naive_log_softmax(hidden, unembed, *, temperature=1.0, softcap=None):
    z = jnp.einsum("btd,dv->btv", hidden, unembed, precision=HIGHEST)
    if softcap is not None:
        z = softcap * jnp.tanh(z / softcap)
    return jax.nn.log_softmax(z / temperature, axis=-1)


def naive_forward_kl(hidden, unembed, ref_hidden, ref_unembed, *, temperature=1.0, softcap=None):
    log_q = jax.lax.stop_gradient(
        naive_log_softmax(ref_hidden, ref_unembed, temperature=temperature, softcap=softcap)
    )
    log_p = naive_log_softmax(hidden, unembed, temperature=temperature, softcap=softcap)
    return jnp.sum(jnp.exp(log_q) * (log_q - log_p), axis=-1)


def make_inputs(vocab, seed=0, d_ref=D_REF):
    keys = jax.random.split(jax.random.key(seed), 5)
    hidden = jax.random.normal(keys[0], (B, T, D))
    unembed = jax.random.normal(keys[1], (D, vocab)) / np.sqrt(D) * 2.0
    ref_hidden = jax.random.normal(keys[2], (B, T, d_ref))
    ref_unembed = jax.random.normal(keys[3], (d_ref, vocab)) / np.sqrt(d_ref) * 2.0
    g = jax.random.normal(keys[4], (B, T))
    return hidden, unembed, ref_hidden, ref_unembed, g


# (vocab, chunk, softcap, temperature): a remainder chunk (37 = 4·8 + 5), an exact multiple,
# a chunk wider than V with soft-capping and a temperature.
CASES = [(37, 8, None, 1.0), (40, 8, None, 0.7), (37, 64, 2.5, 1.6)]


@pytest.mark.parametrize(("vocab", "chunk", "softcap", "temperature"), CASES)
def test_value_and_gradient_match_naive(vocab, chunk, softcap, temperature):
    hidden, unembed, ref_hidden, ref_unembed, g = make_inputs(vocab)
    opts = {"temperature": temperature, "softcap": softcap}

    def chunked(h, w, rh, rw):
        return token_forward_kl_chunked(h, w, rh, rw, chunk_size=chunk, **opts)

    def naive(h, w, rh, rw):
        return naive_forward_kl(h, w, rh, rw, **opts)

    kl = chunked(hidden, unembed, ref_hidden, ref_unembed)
    expected = naive(hidden, unembed, ref_hidden, ref_unembed)
    assert kl.shape == (B, T) and kl.dtype == jnp.float32
    np.testing.assert_allclose(kl, expected, **TOL)
    assert float(jnp.min(expected)) > 1e-3  # distinct models: a non-trivial KL is being checked

    # Cotangent-weighted sum so that every token's gradient is exercised with its own weight.
    grads = jax.grad(lambda *a: jnp.sum(g * chunked(*a)), argnums=(0, 1, 2, 3))(
        hidden, unembed, ref_hidden, ref_unembed)
    want = jax.grad(lambda *a: jnp.sum(g * naive(*a)), argnums=(0, 1, 2, 3))(
        hidden, unembed, ref_hidden, ref_unembed)
    for got, exp in zip(grads, want, strict=True):
        np.testing.assert_allclose(got, exp, **TOL)
    # The reference is a constant of the regulariser.
    assert not np.any(grads[2]) and not np.any(grads[3])


def test_gradient_is_policy_minus_reference_softmax():
    """∂KL_t/∂z_t = p_t − q_t, checked through W: dW = Hᵀ (p − q) summed over tokens."""
    hidden, unembed, ref_hidden, ref_unembed, _ = make_inputs(29, seed=3)
    grad_w = jax.grad(
        lambda w: jnp.sum(token_forward_kl_chunked(hidden, w, ref_hidden, ref_unembed,
                                                   chunk_size=8))
    )(unembed)
    p = jnp.exp(naive_log_softmax(hidden, unembed))
    q = jnp.exp(naive_log_softmax(ref_hidden, ref_unembed))
    expected = jnp.einsum("btd,btv->dv", hidden, p - q, precision=HIGHEST)
    np.testing.assert_allclose(grad_w, expected, **TOL)


def test_identical_models_give_zero_kl_and_zero_gradient():
    hidden, unembed, _, _, _ = make_inputs(37, seed=1)

    def kl_sum(h):
        return jnp.sum(token_forward_kl_chunked(h, unembed, hidden, unembed, chunk_size=8,
                                                softcap=2.5, temperature=1.6))

    kl = token_forward_kl_chunked(hidden, unembed, hidden, unembed, chunk_size=8, softcap=2.5,
                                  temperature=1.6)
    np.testing.assert_allclose(kl, np.zeros((B, T)), atol=1e-6)
    np.testing.assert_allclose(jax.grad(kl_sum)(hidden), np.zeros((B, T, D)), atol=1e-6)


def test_off_rl_kl_loss_with_chunked_kl_equals_naive_exact_form():
    """SPEC §3: L = Σ_b rm_b [−R_b exp(Σ_t m logπ / |y_b|) + τ Σ_t m KL_t / |y_b|]."""
    vocab, tau = 37, 0.04
    hidden, unembed, ref_hidden, ref_unembed, _ = make_inputs(vocab, seed=2)
    targets = jax.random.randint(jax.random.key(7), (B, T), 0, vocab)
    mask = jnp.array([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]], jnp.float32)
    rewards = jnp.array([1.0, -0.5])

    def gather(log_p):
        return jnp.take_along_axis(log_p, targets[..., None], axis=-1)[..., 0]

    ref_logp = gather(naive_log_softmax(ref_hidden, ref_unembed))

    def loss(h):
        logp = gather(naive_log_softmax(h, unembed))
        kl = token_forward_kl_chunked(h, unembed, ref_hidden, ref_unembed, chunk_size=8)
        return off_rl_kl_loss(logp, ref_logp, mask, rewards, tau=tau, token_kl=kl).total

    def naive_loss(h):
        logp = gather(naive_log_softmax(h, unembed))
        kl = naive_forward_kl(h, unembed, ref_hidden, ref_unembed)
        length = jnp.sum(mask, axis=-1)
        off_rl = -rewards * jnp.exp(jnp.sum(mask * logp, axis=-1) / length)
        return jnp.sum(off_rl + tau * jnp.sum(mask * kl, axis=-1) / length)

    np.testing.assert_allclose(loss(hidden), naive_loss(hidden), **TOL)
    np.testing.assert_allclose(jax.grad(loss)(hidden), jax.grad(naive_loss)(hidden), **TOL)
    # The exact KL differs from the sample estimate (a check that token_kl was really used).
    logp = gather(naive_log_softmax(hidden, unembed))
    sample = off_rl_kl_loss(logp, ref_logp, mask, rewards, tau=tau).total
    assert abs(float(sample) - float(loss(hidden))) > 1e-4


def test_bad_arguments_name_the_argument():
    hidden, unembed, ref_hidden, ref_unembed, _ = make_inputs(37)
    with pytest.raises(ValueError, match="ref_unembed has V=36"):
        token_forward_kl_chunked(hidden, unembed, ref_hidden, ref_unembed[:, :36])
    with pytest.raises(ValueError, match=r"ref_hidden \[B, T\]"):
        token_forward_kl_chunked(hidden, unembed, ref_hidden[:, :3], ref_unembed)
    with pytest.raises(ValueError, match="chunk_size must be > 0"):
        token_forward_kl_chunked(hidden, unembed, ref_hidden, ref_unembed, chunk_size=0)
    with pytest.raises(ValueError, match="temperature"):
        token_forward_kl_chunked(hidden, unembed, ref_hidden, ref_unembed, temperature=0.0)


def _batch_for(targets, mask, rewards):
    from jaxrl_llm.data.batch import Batch

    b, t = targets.shape
    zeros = jnp.zeros((b, t), jnp.float32)
    return Batch(
        inputs=targets, targets=targets,
        positions=jnp.tile(jnp.arange(t, dtype=jnp.int32), (b, 1)),
        segment_ids=jnp.ones((b, t), jnp.int32), loss_mask=mask,
        behavior_logprobs=zeros, mu_logprobs=zeros, ref_logprobs=zeros,
        rewards=rewards, correct=rewards > 0, group_ids=jnp.arange(b, dtype=jnp.int32),
        record_mask=jnp.ones((b,), jnp.float32), pair_index=jnp.zeros((0, 2), jnp.int32),
    )


def test_train_loss_uses_exact_kl_when_configured():
    """`loss.kl_exact: true` with `train.ref_logprobs: model` gives the exact-KL loss (FPA §3)
    at T = 1 whatever the sampling temperature (π and π_ref of one distribution family);
    without reference hidden states it is a config error."""
    from jaxrl_llm.config import ConfigError, config_from_dict
    from jaxrl_llm.train.loss_fn import compute_loss

    vocab, tau_kl, temp = 37, 0.5, 0.8
    hidden, unembed, ref_hidden, ref_unembed, _ = make_inputs(vocab, seed=4)
    targets = jax.random.randint(jax.random.key(8), (B, T), 0, vocab).astype(jnp.int32)
    mask = jnp.array([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]], jnp.float32)
    rewards = jnp.array([1.0, -0.5])
    batch = _batch_for(targets, mask, rewards)
    config = config_from_dict({
        "loss": {"name": "off_rl_kl", "kl_exact": True, "kl_tau": tau_kl,
                 "logprob_chunk_size": 8},
        "train": {"ref_logprobs": "model", "batch_size": B},
        "generate": {"temperature": temp},
    })

    def gather(log_p):
        return jnp.take_along_axis(log_p, targets[..., None], axis=-1)[..., 0]

    logp = gather(naive_log_softmax(hidden, unembed, temperature=1.0))
    kl = naive_forward_kl(hidden, unembed, ref_hidden, ref_unembed, temperature=1.0)
    length = jnp.sum(mask, axis=-1)
    expected = jnp.sum(-rewards * jnp.exp(jnp.sum(mask * logp, axis=-1) / length)
                       + tau_kl * jnp.sum(mask * kl, axis=-1) / length)
    out = compute_loss(config, batch, hidden, unembed, ref_hidden=ref_hidden,
                       ref_unembed=ref_unembed)
    np.testing.assert_allclose(out.total, expected, **TOL)
    with pytest.raises(ConfigError, match="loss.kl_exact"):
        compute_loss(config, batch, hidden, unembed)
