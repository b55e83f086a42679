"""Mixed precision in the chunked log-prob kernel: bf16 hidden states and unembedding, fp32
matmul accumulation and log-softmax. The bf16 gradient stays within a bound of the fp32 one,
and the only error left is the rounding of the bf16 inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.losses.logprobs import token_logprobs

B, T, D, V = 4, 32, 128, 1000


def _inputs():
    kh, kw, ky, ka = jax.random.split(jax.random.key(0), 4)
    hidden = jax.random.normal(kh, (B, T, D), jnp.float32)
    table = jax.random.normal(kw, (V, D), jnp.float32) * 0.25  # logits with std ≈ 2.8
    targets = jax.random.randint(ky, (B, T), 0, V)
    adv = jax.random.normal(ka, (B, T), jnp.float32)
    return hidden, table, targets, adv


def _grads(hidden, table, targets, adv):
    def loss(h, w):  # a policy-gradient surrogate Σ A·logπ
        return jnp.sum(adv * token_logprobs(h, w.T, targets, chunk_size=256))
    logp = token_logprobs(hidden, table.T, targets, chunk_size=256)
    return logp, jax.grad(loss, argnums=(0, 1))(hidden, table)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_bf16_kernel_gradient_error_is_bounded_against_fp32() -> None:
    hidden, table, targets, adv = _inputs()
    logp32, (dh32, dw32) = _grads(hidden, table, targets, adv)
    hb, wb = hidden.astype(jnp.bfloat16), table.astype(jnp.bfloat16)
    logp16, (dh16, dw16) = _grads(hb, wb, targets, adv)
    assert logp16.dtype == jnp.float32  # log-softmax in fp32 whatever the input dtype
    assert dh16.dtype == jnp.bfloat16 and dw16.dtype == jnp.bfloat16
    # bf16 keeps 8 significant bits (unit roundoff 2⁻⁹ ≈ 0.002): gradients within 1%.
    assert _rel(dh16, dh32) < 1e-2 and _rel(dw16, dw32) < 1e-2
    assert np.max(np.abs(logp16 - logp32)) < 0.05

    # The error is the inputs' rounding only: the fp32 kernel on the bf16-rounded inputs
    # gives the same log-probs to fp32 accuracy and gradients to bf16 output rounding.
    logp_r, (dh_r, dw_r) = _grads(hb.astype(jnp.float32), wb.astype(jnp.float32), targets, adv)
    np.testing.assert_allclose(logp16, logp_r, atol=2e-5, rtol=1e-5)
    assert _rel(dh16, dh_r) < 4e-3 and _rel(dw16, dw_r) < 4e-3


def test_fp32_log_softmax_matters_all_bf16_is_worse() -> None:
    """Control: log-softmax computed in bf16 (what a naive bf16 model would do) is several
    times further from fp32 than the kernel's bf16 inputs with fp32 softmax."""
    hidden, table, targets, _ = _inputs()
    logp32 = token_logprobs(hidden, table.T, targets, chunk_size=256)
    hb, wb = hidden.astype(jnp.bfloat16), table.astype(jnp.bfloat16)
    kernel = token_logprobs(hb, wb.T, targets, chunk_size=256)
    logits = jnp.einsum("btd,vd->btv", hb, wb)  # bf16 out
    naive = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets[..., None], -1)[..., 0]
    err_kernel = float(jnp.mean(jnp.abs(kernel - logp32)))
    err_naive = float(jnp.mean(jnp.abs(naive.astype(jnp.float32) - logp32)))
    assert err_naive > 3 * err_kernel
