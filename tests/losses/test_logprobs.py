"""Chunked token log-probs / entropy / FPA extrapolated log-probs (SPEC §1, 002 eq. 4).

Every expected value comes from the naive formula computed here, independently of the
kernel: full logits `H @ W` at highest matmul precision, `jax.nn.log_softmax`, gather.
"""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_llm.losses.logprobs import extrapolated_logprobs, token_logprobs

HIGHEST = jax.lax.Precision.HIGHEST
B, T, D, D_REF = 2, 6, 16, 12
TOL = {"rtol": 1e-5, "atol": 1e-5}


def naive_logits(hidden, unembed, *, temperature=1.0, softcap=None):
    z = jnp.einsum("btd,dv->btv", hidden.astype(jnp.float32), unembed.astype(jnp.float32),
                   precision=HIGHEST)
    if softcap is not None:
        z = softcap * jnp.tanh(z / softcap)
    return z / temperature


def naive_gather_and_entropy(z, targets):
    log_p = jax.nn.log_softmax(z, axis=-1)
    logp = jnp.take_along_axis(log_p, targets[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)
    return logp, entropy


def make_inputs(vocab, seed=0, d=D, dtype=jnp.float32, scale=1.0):
    k_h, k_w, k_y, k_g1, k_g2 = jax.random.split(jax.random.key(seed), 5)
    hidden = (scale * jax.random.normal(k_h, (B, T, d))).astype(dtype)
    unembed = (jax.random.normal(k_w, (d, vocab)) / np.sqrt(d) * 2.0).astype(dtype)
    targets = jax.random.randint(k_y, (B, T), 0, vocab)
    g_logp = jax.random.normal(k_g1, (B, T))
    g_ent = jax.random.normal(k_g2, (B, T))
    return hidden, unembed, targets, g_logp, g_ent


# (vocab, chunk, softcap, temperature): a remainder chunk (37 = 4·8 + 5), an exact multiple,
# chunk 1, a chunk wider than V; each with and without soft-capping and temperature.
VALUE_CASES = [
    (37, 8, None, 1.0), (37, 8, None, 0.7), (37, 8, 3.0, 1.0), (37, 8, 2.5, 1.6),
    (40, 8, None, 0.7), (7, 1, 3.0, 1.0), (37, 64, 2.5, 1.6),
]
GRAD_CASES = [(37, 8, None, 1.0), (37, 8, 3.0, 1.0), (37, 8, 2.5, 1.6), (40, 8, None, 0.7),
              (7, 1, 2.5, 1.6)]
CASE_NAMES = ("vocab", "chunk", "softcap", "temperature")


@pytest.mark.parametrize(CASE_NAMES, VALUE_CASES)
def test_values_and_entropy_match_naive(vocab, chunk, softcap, temperature):
    hidden, unembed, targets, _, _ = make_inputs(vocab)
    logp, entropy = token_logprobs(hidden, unembed, targets, chunk_size=chunk,
                                   return_entropy=True, softcap=softcap, temperature=temperature)
    want_logp, want_entropy = naive_gather_and_entropy(
        naive_logits(hidden, unembed, temperature=temperature, softcap=softcap), targets)
    assert logp.shape == (B, T) and logp.dtype == jnp.float32
    np.testing.assert_allclose(logp, want_logp, **TOL)
    np.testing.assert_allclose(entropy, want_entropy, **TOL)
    # return_entropy=False returns the same log-probs alone.
    np.testing.assert_array_equal(
        token_logprobs(hidden, unembed, targets, chunk_size=chunk, softcap=softcap,
                       temperature=temperature), logp)


@pytest.mark.parametrize(CASE_NAMES, GRAD_CASES)
def test_gradients_match_naive(vocab, chunk, softcap, temperature):
    """d/dH and d/dW of Σ g·logp + Σ g'·entropy, random cotangents g, g' (both outputs)."""
    hidden, unembed, targets, g_logp, g_ent = make_inputs(vocab, seed=1)

    def chunked(h, w):
        logp, ent = token_logprobs(h, w, targets, chunk_size=chunk, return_entropy=True,
                                   softcap=softcap, temperature=temperature)
        return jnp.sum(g_logp * logp) + jnp.sum(g_ent * ent)

    def naive(h, w):
        logp, ent = naive_gather_and_entropy(
            naive_logits(h, w, temperature=temperature, softcap=softcap), targets)
        return jnp.sum(g_logp * logp) + jnp.sum(g_ent * ent)

    got = jax.grad(chunked, argnums=(0, 1))(hidden, unembed)
    want = jax.grad(naive, argnums=(0, 1))(hidden, unembed)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, **TOL)


def test_traced_temperature_gets_its_gradient():
    hidden, unembed, targets, g_logp, _ = make_inputs(37, seed=2)

    def chunked(tau):
        return jnp.sum(g_logp * token_logprobs(hidden, unembed, targets, chunk_size=8,
                                               temperature=tau, softcap=4.0))

    def naive(tau):
        z = naive_logits(hidden, unembed, temperature=tau, softcap=4.0)
        return jnp.sum(g_logp * naive_gather_and_entropy(z, targets)[0])

    for tau in (0.6, 1.0, 1.3):
        np.testing.assert_allclose(jax.jit(jax.grad(chunked))(tau), jax.grad(naive)(tau),
                                   rtol=1e-5, atol=1e-5)


def test_bf16_inputs_accumulate_in_float32():
    """bf16 products are exact in fp32, so the values match fp32 math on the same numbers."""
    hidden, unembed, targets, g_logp, _ = make_inputs(37, seed=3, dtype=jnp.bfloat16)
    logp, entropy = token_logprobs(hidden, unembed, targets, chunk_size=8, return_entropy=True)
    want_logp, want_entropy = naive_gather_and_entropy(naive_logits(hidden, unembed), targets)
    assert logp.dtype == jnp.float32
    np.testing.assert_allclose(logp, want_logp, **TOL)
    np.testing.assert_allclose(entropy, want_entropy, **TOL)

    grads = jax.grad(lambda h, w: jnp.sum(g_logp * token_logprobs(h, w, targets, chunk_size=8)),
                     argnums=(0, 1))(hidden, unembed)
    want = jax.grad(
        lambda h, w: jnp.sum(g_logp * naive_gather_and_entropy(naive_logits(h, w), targets)[0]),
        argnums=(0, 1))(hidden.astype(jnp.float32), unembed.astype(jnp.float32))
    for g, w in zip(grads, want):
        assert g.dtype == jnp.bfloat16
        # bf16 keeps 8 mantissa bits: relative error of the gradients ~ 2^-8.
        np.testing.assert_allclose(g.astype(jnp.float32), w, rtol=2e-2, atol=2e-2)


def test_large_logits_stay_finite_and_exact():
    hidden, unembed, targets, _, _ = make_inputs(37, seed=4, scale=300.0)
    logp, entropy = token_logprobs(hidden, unembed, targets, chunk_size=8, return_entropy=True)
    want_logp, want_entropy = naive_gather_and_entropy(naive_logits(hidden, unembed), targets)
    assert np.isfinite(logp).all() and np.isfinite(entropy).all()
    np.testing.assert_allclose(logp, want_logp, rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(entropy, want_entropy, rtol=1e-5, atol=1e-3)


# ------------------------------------------------------------------------- FPA (002 eq. 4)


def fpa_inputs(vocab=37):
    hidden, unembed, targets, g_logp, _ = make_inputs(vocab, seed=5)
    ref_hidden, ref_unembed, _, _, _ = make_inputs(vocab, seed=6, d=D_REF)
    return hidden, unembed, ref_hidden, ref_unembed, targets, g_logp


@pytest.mark.parametrize(("softcap", "temperature"), [(None, 1.0), (3.0, 0.8)])
@pytest.mark.parametrize("lam", [0.5, 1.0, 2.0])
def test_extrapolated_matches_naive_softmax(lam, softcap, temperature):
    h, w, hr, wr, targets, _ = fpa_inputs()
    got = extrapolated_logprobs(h, w, hr, wr, targets, lam=lam, chunk_size=8,
                                temperature=temperature, softcap=softcap)
    cap = (lambda x: x) if softcap is None else (lambda x: softcap * jnp.tanh(x / softcap))
    raw = jnp.einsum("btd,dv->btv", h, w, precision=HIGHEST)
    raw_ref = jnp.einsum("btd,dv->btv", hr, wr, precision=HIGHEST)
    z = ((1 + lam) * cap(raw) - lam * cap(raw_ref)) / temperature
    np.testing.assert_allclose(got, naive_gather_and_entropy(z, targets)[0], **TOL)


def test_extrapolated_gradients_match_naive_including_traced_lambda():
    h, w, hr, wr, targets, g = fpa_inputs()

    def chunked(h, w, hr, wr, lam):
        return jnp.sum(g * extrapolated_logprobs(h, w, hr, wr, targets, lam=lam, chunk_size=8))

    def naive(h, w, hr, wr, lam):
        z = (1 + lam) * naive_logits(h, w) - lam * naive_logits(hr, wr)
        return jnp.sum(g * naive_gather_and_entropy(z, targets)[0])

    args = (h, w, hr, wr, jnp.float32(1.5))
    got = jax.jit(jax.grad(chunked, argnums=tuple(range(5))))(*args)
    want = jax.grad(naive, argnums=tuple(range(5)))(*args)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize(("softcap", "temperature"), [(None, 1.0), (3.0, 0.8)])
def test_extrapolated_at_lambda_zero_is_token_logprobs_exactly(softcap, temperature):
    h, w, hr, wr, targets, _ = fpa_inputs()
    kw = {"chunk_size": 8, "softcap": softcap, "temperature": temperature}
    want = token_logprobs(h, w, targets, **kw)
    np.testing.assert_array_equal(extrapolated_logprobs(h, w, hr, wr, targets, lam=0.0, **kw),
                                  want)
    # A traced λ = 0 runs the two-model kernel: equal up to float rounding of the fused ops.
    traced = jax.jit(lambda lam: extrapolated_logprobs(h, w, hr, wr, targets, lam=lam, **kw))
    np.testing.assert_allclose(traced(0.0), want, rtol=1e-6, atol=0)


def test_extrapolated_under_stop_gradient_builds_no_backward():
    """FPA's weight is sg(π̂) (002 eq. 3): the gradient w.r.t. the policy must be zero."""
    h, w, hr, wr, targets, _ = fpa_inputs()
    grads = jax.grad(lambda h, w: jnp.sum(jax.lax.stop_gradient(
        extrapolated_logprobs(h, w, hr, wr, targets, lam=1.0, chunk_size=8))), argnums=(0, 1))(
        h, w)
    assert all(not np.any(g) for g in grads)


# ----------------------------------------------------------- no B×T×V array in backward

MEM_B, MEM_T, MEM_D, MEM_V, MEM_CHUNK = 4, 64, 32, 4096, 256
LOGITS_ELEMS = MEM_B * MEM_T * MEM_V


def _all_avals(jaxpr):
    """Every intermediate array shape in a jaxpr, recursing into scan/custom_vjp bodies."""
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield var.aval
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from _all_avals(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _all_avals(sub)


def _mem_setup():
    k = jax.random.split(jax.random.key(7), 3)
    hidden = jax.random.normal(k[0], (MEM_B, MEM_T, MEM_D))
    # The models' layout: the differentiated parameter is the table of rows [V, d] and the
    # unembedding passed in is its transpose (the kernel's own transpose cancels it).
    table = jax.random.normal(k[1], (MEM_V, MEM_D)) / np.sqrt(MEM_D)
    targets = jax.random.randint(k[2], (MEM_B, MEM_T), 0, MEM_V)

    def chunked(h, rows):
        logp, ent = token_logprobs(h, rows.T, targets, chunk_size=MEM_CHUNK,
                                   return_entropy=True)
        return jnp.sum(logp) + jnp.sum(ent)

    def naive(h, rows):
        logp, ent = naive_gather_and_entropy(naive_logits(h, rows.T), targets)
        return jnp.sum(logp) + jnp.sum(ent)

    return hidden, table, chunked, naive


def test_backward_jaxpr_has_no_array_of_logits_size():
    hidden, unembed, chunked, naive = _mem_setup()
    grad_fn = jax.value_and_grad(chunked, argnums=(0, 1))
    biggest = max(int(np.prod(a.shape)) for a in _all_avals(jax.make_jaxpr(grad_fn)(hidden,
                                                                                   unembed).jaxpr)
                  if hasattr(a, "shape"))
    # Largest allowed: one logit chunk, or the unembedding (its gradient) itself.
    assert biggest <= max(MEM_B * MEM_T * MEM_CHUNK, MEM_D * MEM_V) < LOGITS_ELEMS / 4
    # The same inspection does find the logits in the naive gradient (the check can fail).
    naive_jaxpr = jax.make_jaxpr(jax.value_and_grad(naive, argnums=(0, 1)))(hidden, unembed)
    assert max(int(np.prod(a.shape)) for a in _all_avals(naive_jaxpr.jaxpr)
               if hasattr(a, "shape")) >= LOGITS_ELEMS


def test_compiled_backward_temp_memory_is_far_below_logits():
    hidden, unembed, chunked, naive = _mem_setup()
    logits_bytes = LOGITS_ELEMS * 4

    def temp_bytes(fn):
        compiled = jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).lower(hidden, unembed).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temp_bytes(chunked) < logits_bytes / 4
    assert temp_bytes(naive) >= logits_bytes


# ----------------------------------------------------------------------- properties


@st.composite
def problems(draw):
    b, t = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    d, vocab = draw(st.integers(1, 8)), draw(st.integers(1, 24))
    chunk = draw(st.integers(1, 30))
    softcap = draw(st.sampled_from([None, 0.5, 30.0]))
    temperature = draw(st.sampled_from([0.3, 1.0, 2.0]))
    scale = draw(st.sampled_from([0.0, 1.0, 50.0]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))  # numpy: no compile per draw
    hidden = jnp.asarray(scale * rng.standard_normal((b, t, d)), jnp.float32)
    unembed = jnp.asarray(rng.standard_normal((d, vocab)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, vocab, (b, t)), jnp.int32)
    return hidden, unembed, targets, chunk, softcap, temperature


@pytest.mark.slow  # ≈ 21 s: 12 hypothesis examples, each compiled twice
@settings(max_examples=12, deadline=None)
@given(problems())
def test_property_finite_jit_equals_eager_and_matches_naive(problem):
    hidden, unembed, targets, chunk, softcap, temperature = problem
    kw = {"chunk_size": chunk, "return_entropy": True, "softcap": softcap,
          "temperature": temperature}
    eager = token_logprobs(hidden, unembed, targets, **kw)
    jitted = jax.jit(lambda h, w, y: token_logprobs(h, w, y, **kw))(hidden, unembed, targets)
    grads = jax.grad(lambda h, w: jnp.sum(token_logprobs(h, w, targets, **kw)[0]),
                     argnums=(0, 1))(hidden, unembed)
    for arr in (*eager, *grads):
        assert np.isfinite(arr).all()
    assert (eager[0] <= 0).all() and (eager[1] >= 0).all()  # log p ≤ 0, entropy ≥ 0, always
    logits = naive_logits(hidden, unembed, temperature=temperature, softcap=softcap)
    # jit and eager fuse differently; fp32 rounding of lse − Σ p·z scales with the logits' size.
    zscale = max(1.0, float(jnp.abs(logits).max()))
    for a, b in zip(eager, jitted):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * zscale)
    want = naive_gather_and_entropy(logits, targets)
    for a, b in zip(eager, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5 * max(1.0, float(jnp.abs(b).max())))


# ------------------------------------------------------------------------- bad input


def test_bad_inputs_raise_naming_the_argument():
    hidden, unembed, targets, _, _ = make_inputs(37)
    cases = [
        ((hidden, unembed[:5], targets), {}, ValueError, "hidden has d=16 but unembed has d=5"),
        ((hidden[0], unembed, targets), {}, ValueError, r"hidden must be \[B, T, d\]"),
        ((hidden, unembed[None], targets), {}, ValueError, r"unembed must be \[d, V\]"),
        ((hidden, unembed, targets[:, :3]), {}, ValueError, "targets shape"),
        ((hidden, unembed, targets.astype(jnp.float32)), {}, TypeError, "targets must be integer"),
        ((hidden, unembed, targets + 37), {}, ValueError, r"targets must lie in \[0, V=37\)"),
        ((hidden.astype(jnp.int32), unembed, targets), {}, TypeError, "hidden must be floating"),
        ((hidden.astype(jnp.bfloat16), unembed, targets), {}, TypeError, "same dtype"),
        ((hidden, unembed, targets), {"chunk_size": 0}, ValueError, "chunk_size must be > 0"),
        ((hidden, unembed, targets), {"chunk_size": -4}, ValueError, "chunk_size must be > 0"),
        ((hidden, unembed, targets), {"chunk_size": 8.0}, TypeError, "chunk_size must be"),
        ((hidden, unembed, targets), {"temperature": 0.0}, ValueError, "temperature must be"),
        ((hidden, unembed, targets), {"softcap": -1.0}, ValueError, "softcap must be"),
    ]
    for args, kwargs, error, message in cases:
        kwargs = {"chunk_size": 8, **kwargs}
        with pytest.raises(error, match=message):
            token_logprobs(*args, **kwargs)


def test_extrapolated_bad_inputs_raise_naming_the_argument():
    h, w, hr, wr, targets, _ = fpa_inputs()
    cases = [
        ((h, w, hr, wr[:3], targets), {}, "ref_hidden has d=12 but ref_unembed has d=3"),
        ((h, w, hr[:1], wr, targets), {}, r"ref_hidden \[B, T\]"),
        ((h, w, hr, wr[:, :20], targets), {}, "ref_unembed has V=20"),
        ((h, w, hr, wr, targets), {"lam": -0.5}, "lam must be"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            extrapolated_logprobs(*args, **{"lam": 1.0, "chunk_size": 8, **kwargs})


def test_out_of_range_target_under_jit_is_nan_not_a_number():
    hidden, unembed, targets, _, _ = make_inputs(37)
    bad = targets.at[0, 0].set(37)
    logp = jax.jit(lambda y: token_logprobs(hidden, unembed, y, chunk_size=8))(bad)
    assert np.isnan(logp[0, 0]) and np.isfinite(logp[1:]).all()
