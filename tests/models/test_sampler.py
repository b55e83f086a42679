"""KV-cache sampler on a tiny random-init Decoder, checked against full forwards and numpy.

Every expected value is recomputed here independently: logits by a full (cache-free) forward
over prompt + completion, and the processed sampling distribution (temperature, top-k, top-p)
by a brute-force numpy implementation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm.models.config import DecoderConfig
from jaxrl_llm.models.decoder import Decoder
from jaxrl_llm.sampling.continuous import ContinuousSampler
from jaxrl_llm.sampling.decode_program import first_argmax
from jaxrl_llm.sampling.sampler import (
    FINISH_LENGTH,
    FINISH_STOP,
    Sampler,
    SamplingParams,
    default_bucket,
    process_logits,
)

VOCAB = 64
PAD = 0
PROMPTS = [[5, 9, 13], [7, 3, 22, 41, 8, 2, 30], [11]]
MAX_NEW = 8


@pytest.fixture(scope="module")
def model() -> Decoder:
    config = DecoderConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2,
                           num_heads=4, num_kv_heads=2, tie_embeddings=False)
    model = Decoder(config, rngs=nnx.Rngs(0))
    # Larger random weights than HF's 0.02 init so logits are spread out (distinct argmaxes,
    # non-trivial top-p sets) instead of nearly uniform.
    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda x: x * 6.0 if x.ndim >= 2 else x, state)
    return nnx.merge(graphdef, state)


@pytest.fixture(scope="module", params=["static", "continuous"])
def sampler(model, request) -> Sampler:
    # static: batch_size 2 with 3 prompts, the last batch is padded; continuous: 3 slots for
    # 3 prompts × n samples, refilled as samples end. One bucket so that each SamplingParams
    # structure compiles once (temperature / top_p / stop ids are traced).
    if request.param == "continuous":
        return ContinuousSampler(model, pad_token_id=PAD, slots=3, prompt_buckets=(8,))
    return Sampler(model, pad_token_id=PAD, batch_size=2, prompt_buckets=(8,))


@pytest.fixture(scope="module")
def full_forward(model):
    """Logits [N, L, V] of right-padded sequences by one cache-free forward (causal, so the
    padding at the end cannot change earlier positions)."""
    forward = jax.jit(lambda graphdef, state, tokens: nnx.merge(graphdef, state).logits(
        nnx.merge(graphdef, state)(tokens)))

    def run(sequences: list[list[int]]) -> np.ndarray:
        width = max(len(s) for s in sequences)
        tokens = np.full((len(sequences), width), PAD, np.int32)
        for row, seq in enumerate(sequences):
            tokens[row, : len(seq)] = seq
        return np.asarray(forward(*nnx.split(model), tokens))

    return run


def np_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    finite = np.where(np.isfinite(x), x, -np.inf)
    m = np.max(finite, axis=-1, keepdims=True)
    return finite - m - np.log(np.sum(np.exp(finite - m), axis=-1, keepdims=True))


def np_process(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Brute-force reference: per row, keep the k best, then the smallest prefix (by
    descending probability) whose mass reaches top_p; everything else -inf."""
    out = logits.astype(np.float64) / temperature
    for row in out.reshape(-1, out.shape[-1]):
        order = np.argsort(-row, kind="stable")
        allowed = np.ones(row.shape, bool)
        if top_k:
            allowed[:] = False
            allowed[order[:top_k]] = True
            row[~allowed] = -np.inf
        if top_p < 1.0:
            probs = np.exp(np_log_softmax(row))
            kept, mass = [], 0.0
            for idx in order:
                if not allowed[idx]:
                    continue
                kept.append(idx)
                mass += probs[idx]
                if mass >= top_p:
                    break
            mask = np.zeros(row.shape, bool)
            mask[kept] = True
            row[~mask] = -np.inf
    return out


def _prompt_plus(out, row: int) -> list[int]:
    return PROMPTS[out.prompt_index[row]] + out.tokens[row, : out.lengths[row]].tolist()


@pytest.fixture(scope="module")
def sampled(sampler):
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, n=2)
    return sampler.generate(PROMPTS, params, jax.random.key(0), return_logits=True)


def test_output_layout(sampled):
    n = 2
    assert sampled.tokens.shape == (len(PROMPTS) * n, MAX_NEW)
    np.testing.assert_array_equal(sampled.prompt_index, [0, 0, 1, 1, 2, 2])
    np.testing.assert_array_equal(sampled.sample_index, [0, 1, 0, 1, 0, 1])
    np.testing.assert_array_equal(sampled.lengths, MAX_NEW)
    assert list(sampled.finish_reason) == [FINISH_LENGTH] * 6


def test_incremental_logits_equal_full_forward_at_every_step(sampled, full_forward):
    sequences = [_prompt_plus(sampled, r) for r in range(len(sampled.tokens))]
    logits = full_forward(sequences)
    for row in range(len(sequences)):
        start = len(PROMPTS[sampled.prompt_index[row]]) - 1  # logits predicting token 0
        expected = logits[row, start : start + MAX_NEW]
        np.testing.assert_allclose(sampled.logits[row], expected, atol=1e-5, rtol=1e-5)


def test_logprobs_at_temperature_one_are_log_softmax_of_full_forward(sampled, full_forward):
    sequences = [_prompt_plus(sampled, r) for r in range(len(sampled.tokens))]
    logits = full_forward(sequences)
    for row in range(len(sequences)):
        start = len(PROMPTS[sampled.prompt_index[row]]) - 1
        logp = np_log_softmax(logits[row, start : start + MAX_NEW])
        expected = logp[np.arange(MAX_NEW), sampled.tokens[row]]
        # No truncation: both reported log-probs are the same distribution.
        np.testing.assert_allclose(sampled.raw_logprobs[row], expected, atol=1e-5)
        np.testing.assert_allclose(sampled.logprobs[row], expected, atol=1e-5)


def test_greedy_is_argmax_and_low_temperature_matches_it(sampler, full_forward):
    greedy = sampler.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0),
                              jax.random.key(1))
    logits = full_forward([_prompt_plus(greedy, r) for r in range(len(PROMPTS))])
    for row, prompt in enumerate(PROMPTS):
        start = len(prompt) - 1
        np.testing.assert_array_equal(
            greedy.tokens[row], np.argmax(logits[row, start : start + MAX_NEW], axis=-1))
        logp = np_log_softmax(logits[row, start : start + MAX_NEW])
        np.testing.assert_allclose(greedy.raw_logprobs[row],
                                   logp[np.arange(MAX_NEW), greedy.tokens[row]], atol=1e-5)
    np.testing.assert_array_equal(greedy.logprobs, 0.0)  # point mass
    cold = sampler.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW, temperature=1e-5,
                                                    n=2), jax.random.key(2), return_logits=True)
    np.testing.assert_array_equal(cold.tokens[::2], greedy.tokens)
    np.testing.assert_array_equal(cold.tokens[1::2], greedy.tokens)


def test_truncated_sampling_uses_the_processed_distribution(sampler):
    # top-k and top-p together (each alone is covered against brute force below).
    temperature, top_k, top_p = 0.8, 6, 0.8
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=temperature, top_k=top_k,
                            top_p=top_p, n=2)
    out = sampler.generate(PROMPTS, params, jax.random.key(3), return_logits=True)
    processed = np_process(out.logits, temperature, top_k, top_p)
    logp = np_log_softmax(processed)
    raw = np_log_softmax(out.logits.astype(np.float64) / temperature)
    rows, steps = np.indices(out.tokens.shape)
    chosen = logp[rows, steps, out.tokens]
    assert np.all(np.isfinite(chosen)), "a token outside the top-k/top-p set was sampled"
    np.testing.assert_allclose(out.logprobs, chosen, atol=1e-5)
    np.testing.assert_allclose(out.raw_logprobs, raw[rows, steps, out.tokens], atol=1e-5)
    # The truncation actually removed tokens (so the test above can fail).
    assert np.all(np.isinf(processed).sum(-1) > 0)
    assert np.any(out.logprobs > out.raw_logprobs + 1e-3)


def test_process_logits_matches_brute_force_on_random_rows():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(16, 50)).astype(np.float32) * 3
    for top_k, top_p in [(0, 0.5), (10, 1.0), (10, 0.9)]:
        got = np.asarray(process_logits(logits, np.float32(0.7), np.float32(top_p), top_k=top_k,
                                        use_top_p=top_p < 1.0))
        want = np_process(logits, 0.7, top_k, top_p)
        np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
        np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], rtol=1e-6)


def test_first_argmax_is_numpy_argmax_with_ties_nan_and_all_minus_inf_rows():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 4, size=(64, 300)).astype(np.float32)  # many tied maxima per row
    x[3, :] = -np.inf
    x[5, [7, 250]] = np.nan  # argmax's convention: the first NaN
    x[6, 299] = np.inf
    x[7, :] = 0.0
    np.testing.assert_array_equal(np.asarray(first_argmax(x)), np.argmax(x, axis=-1))


def test_default_buckets_are_powers_of_two_and_their_halfway_points():
    allowed = sorted(m * 2**k for k in range(3, 12) for m in (2, 3))  # 16, 24, 32, 48, …
    for length in range(0, 3000):
        want = next(b for b in allowed if b >= max(length, 16))
        assert default_bucket(length) == want, length
    assert default_bucket(42) == 48 and default_bucket(49) == 64


def test_stop_tokens_end_a_row(sampler, sampled):
    # Same key and params as `sampled` plus a stop token: identical draws until it appears.
    greedy = sampled
    # row 2's first token from its 3rd on that it has not emitted before
    k = next(k for k in range(2, MAX_NEW) if greedy.tokens[2, k] not in greedy.tokens[2, :k])
    stop = int(greedy.tokens[2, k])
    first = [int(np.argmax(row == stop)) if stop in row else None for row in greedy.tokens]
    out = sampler.generate(
        PROMPTS, SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, n=2,
                                stop_token_ids=(stop,)),
        jax.random.key(0), return_logits=True)
    for row in range(len(greedy.tokens)):
        if first[row] is None:
            assert out.lengths[row] == MAX_NEW and out.finish_reason[row] == FINISH_LENGTH
            np.testing.assert_array_equal(out.tokens[row], greedy.tokens[row])
            continue
        end = first[row] + 1
        assert out.lengths[row] == end and out.finish_reason[row] == FINISH_STOP
        np.testing.assert_array_equal(out.tokens[row, :end], greedy.tokens[row, :end])
        np.testing.assert_array_equal(out.tokens[row, end:], PAD)
        np.testing.assert_array_equal(out.raw_logprobs[row, end:], 0.0)
    assert out.lengths[2] == k + 1 and out.finish_reason[2] == FINISH_STOP
    assert out.completions()[2] == greedy.tokens[2, :k + 1].tolist()


def test_same_key_same_samples_and_n_samples_are_distinct(sampler, sampled):
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, n=2)
    again = sampler.generate(PROMPTS, params, jax.random.key(0), return_logits=True)
    np.testing.assert_array_equal(again.tokens, sampled.tokens)
    np.testing.assert_array_equal(again.logprobs, sampled.logprobs)
    other = sampler.generate(PROMPTS, params, jax.random.key(123), return_logits=True)
    assert not np.array_equal(other.tokens, sampled.tokens)
    for prompt in range(len(PROMPTS)):
        rows = sampled.tokens[sampled.prompt_index == prompt]
        assert not np.array_equal(rows[0], rows[1]), f"prompt {prompt}: identical samples"


def test_bad_arguments_are_clear_errors(sampler):
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(max_new_tokens=4, top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(max_new_tokens=4, temperature=-1.0)
    with pytest.raises(ValueError, match="largest prompt bucket 8"):
        sampler.generate([list(range(1, 12))], SamplingParams(max_new_tokens=2),
                         jax.random.key(0))
    with pytest.raises(ValueError, match=r"prompts\[1\] has token ids outside"):
        sampler.generate([[1], [VOCAB + 3]], SamplingParams(max_new_tokens=2), jax.random.key(0))
    with pytest.raises(ValueError, match=r"prompts\[0\] is empty"):
        sampler.generate([[]], SamplingParams(max_new_tokens=2), jax.random.key(0))
    with pytest.raises(ValueError, match="cache_windows=0 must be >= 1"):
        Sampler(sampler.model, cache_windows=0)


def test_inverse_cdf_token_is_the_float64_inverse_cdf_and_never_an_excluded_token():
    from jaxrl_llm.sampling.decode_program import inverse_cdf_token

    rng = np.random.default_rng(2)
    b, v = 64, 700  # not a multiple of the 256-token block
    logits = (rng.normal(size=(b, v)) * 3).astype(np.float32)
    logits[rng.random((b, v)) < 0.5] = -np.inf  # top-k/top-p style exclusions
    logits[0, :] = -np.inf
    logits[0, 333] = 1.0  # one admissible token, in the middle of a block
    u = rng.random(b).astype(np.float32)
    u[1], u[2] = 0.0, np.nextafter(np.float32(1), np.float32(0))  # both ends of [0, 1)
    token, lse = (np.asarray(a) for a in inverse_cdf_token(jnp.asarray(u), jnp.asarray(logits)))
    p = np.exp(logits.astype(np.float64) - logits.max(-1, keepdims=True))
    cdf = np.cumsum(p, -1) / p.sum(-1, keepdims=True)
    want = np.array([np.searchsorted(cdf[r], u[r], side="right") for r in range(b)])
    want = np.minimum(want, v - 1)
    near_edge = np.array([np.min(np.abs(cdf[r][np.isfinite(logits[r])] - u[r])) < 1e-5
                          for r in range(b)])
    assert near_edge.sum() <= 3
    np.testing.assert_array_equal(token[~near_edge], want[~near_edge])
    assert np.all(np.isfinite(logits[np.arange(b), token])), "an excluded token was drawn"
    assert token[0] == 333
    first_ok = np.argmax(np.isfinite(logits[1]))
    last_ok = v - 1 - np.argmax(np.isfinite(logits[2][::-1]))
    assert token[1] == first_ok and token[2] == last_ok
    np.testing.assert_allclose(lse, np.log(np.sum(np.exp(logits.astype(np.float64)), -1)),
                               rtol=1e-6)


def test_sampled_token_frequencies_match_softmax():
    # Over many step keys the sampling step draws each token with its softmax probability
    # (6 SE bound per token), and a top-k of 3 never leaves its three tokens.
    from jaxrl_llm.sampling.decode_program import sample_step

    logits = jnp.asarray(np.log(np.array([[0.5, 0.2, 0.15, 0.1, 0.05] + [1e-9] * 295])),
                         jnp.float32)
    draws = 4000
    keys = jax.random.split(jax.random.key(4), draws)
    sample = jax.jit(jax.vmap(lambda k: sample_step(
        k[None], jnp.zeros((1,), jnp.int32), logits, jnp.float32(1.0), jnp.float32(1.0),
        greedy=False, top_k=0, use_top_p=False)[0][0]))
    counts = np.bincount(np.asarray(sample(keys)), minlength=300)[:5]
    p = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
    assert np.all(np.abs(counts / draws - p) < 6 * np.sqrt(p * (1 - p) / draws)), counts
    top3 = jax.jit(jax.vmap(lambda k: sample_step(
        k[None], jnp.zeros((1,), jnp.int32), logits, jnp.float32(1.0), jnp.float32(1.0),
        greedy=False, top_k=3, use_top_p=False)[0][0]))
    assert set(np.unique(np.asarray(top3(keys)))) == {0, 1, 2}
