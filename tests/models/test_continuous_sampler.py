"""Continuous batching (issue 44): a sample does not depend on the slot, batch or call it is
decoded in; slots are refilled as samples end (no decode step waits for a batch's longest
sample while work is left); each prompt is prefilled once for its n samples; bad input is
refused before anything compiles. The distribution tests (full forward, brute-force top-k/p,
transformers' logits) run on this sampler too: tests/models/test_sampler.py and
test_decode_vs_transformers.py are parametrised over both samplers."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm.models.config import DecoderConfig
from jaxrl_llm.models.decoder import Decoder
from jaxrl_llm.sampling.build import build_sampler
from jaxrl_llm.sampling.continuous import ContinuousSampler
from jaxrl_llm.sampling.sampler import Sampler, SamplingParams

VOCAB = 32
CONFIG = DecoderConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2, max_position_embeddings=16)
PROMPTS = [[5, 9, 13], [7, 3, 22, 4, 8, 2, 30], [11], [1, 2, 3, 4], [9, 9], [6, 1, 6]]
STOPS = (3, 7, 12)  # common enough on this model that lengths vary from 1 to MAX_NEW
MAX_NEW = 10


@pytest.fixture(scope="module")
def model() -> Decoder:
    graphdef, state = nnx.split(Decoder(CONFIG, rngs=nnx.Rngs(1)))
    return nnx.merge(graphdef, jax.tree.map(lambda x: x * 5.0 if x.ndim >= 2 else x, state))


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": MAX_NEW, "temperature": 1.0, "n": 3,
                             "stop_token_ids": STOPS, **kw})


@pytest.mark.parametrize("kw", [{}, {"temperature": 0.7, "top_k": 5, "top_p": 0.9}])
def test_a_sample_drawn_alone_equals_the_same_sample_in_a_full_mixed_batch(model, kw):
    sampler = ContinuousSampler(model, slots=5, prompt_buckets=(8,))
    params = _params(**kw)
    full = sampler.generate(PROMPTS, params, jax.random.key(7))
    assert len(set(full.lengths.tolist())) > 2  # a mixed batch: lengths vary
    for i in (0, 4):
        alone = sampler.generate([PROMPTS[i]], params, jax.random.key(7), prompt_ids=[i])
        rows = slice(i * params.n, (i + 1) * params.n)
        np.testing.assert_array_equal(alone.tokens, full.tokens[rows])
        np.testing.assert_array_equal(alone.logprobs, full.logprobs[rows])
        np.testing.assert_array_equal(alone.raw_logprobs, full.raw_logprobs[rows])
        np.testing.assert_array_equal(alone.lengths, full.lengths[rows])
    # The static sampler's batches of 2 prompts put the samples in other rows and batches:
    # the same tokens, the same log-probs up to float rounding of other shapes.
    static = Sampler(model, batch_size=2, prompt_buckets=(8,)).generate(
        PROMPTS, params, jax.random.key(7))
    np.testing.assert_array_equal(static.tokens, full.tokens)
    np.testing.assert_allclose(static.logprobs, full.logprobs, atol=1e-5)
    np.testing.assert_array_equal(static.finish_reason, full.finish_reason)


def test_slots_are_refilled_as_samples_end(model):
    """With refill at every free slot, while prompts are waiting every decode step runs
    `slots` live samples, so the steps are at most Σ(length − 1) / slots (the first token
    comes from the prefill) plus the last samples' tail (≤ max_new − 1 steps). A static batch
    of the same rows waits for its longest sample: far more steps here."""
    slots = 4
    sampler = ContinuousSampler(model, slots=slots, refill_slots=1, prompt_buckets=(8,))
    out = sampler.generate(PROMPTS * 3, _params(), jax.random.key(3))
    work = int(np.sum(out.lengths - 1))
    assert sampler.steps <= math.ceil(work / slots) + MAX_NEW - 1
    static_steps = sum(int(out.lengths[r:r + slots].max()) - 1
                       for r in range(0, len(out.lengths), slots))
    assert sampler.steps < static_steps, (sampler.steps, static_steps)


def test_each_prompt_is_prefilled_once_for_its_n_samples(model):
    sampler = ContinuousSampler(model, slots=4, prompt_buckets=(8,))
    out = sampler.generate(PROMPTS, _params(n=4), jax.random.key(0))
    assert out.tokens.shape == (24, MAX_NEW)
    assert sampler.prefilled_prompts == len(PROMPTS)
    # KV bytes per concurrent sequence, per token 2 (k, v) × 2 layers × 2 KV heads × 8 dims ×
    # 4 bytes. Shared: 10 generated slots + the prompts' slots shared by the 4 slots: one
    # staged prompt (ceil(refill 1 / n 4)) and a store of min(3 × ceil(4 / 4), 4 / 2) + 1 = 3
    # rows, of width 8. Copied (before): the prompt's 8 + 10 slots + the staged prompt's share.
    per_token = 2 * 2 * 2 * 8 * 4
    assert sampler.kv_bytes_per_sequence == (10 + (3 + 1) * 8 / 4) * per_token
    assert sampler.kv_bytes_per_sequence_copied == (8 + 10 + 1 * 8 / 4) * per_token


def test_bad_input_is_refused_before_compiling(model):
    sampler = ContinuousSampler(model, slots=2, prompt_buckets=(8, 16, 32))
    with pytest.raises(ValueError, match=r"stop token ids \[32\] are outside the vocabulary"):
        sampler.generate([[1]], _params(stop_token_ids=(3, VOCAB)), jax.random.key(0))
    with pytest.raises(ValueError, match=r"stop token ids \[-1\]"):
        sampler.generate([[1]], _params(stop_token_ids=(-1,)), jax.random.key(0))
    with pytest.raises(ValueError, match=r"prompts\[1\] has 17 tokens, more than the model's "
                                         r"context of 16 \(max_position_embeddings\)"):
        sampler.generate([[1], [2] * 17], _params(), jax.random.key(0))
    with pytest.raises(ValueError, match="max_new_tokens=0 must be >= 1"):
        _params(max_new_tokens=0)
    with pytest.raises(ValueError, match="slots=0 must be >= 1"):
        ContinuousSampler(model, slots=0)
    with pytest.raises(ValueError, match="refill_slots=3 must be in"):
        ContinuousSampler(model, slots=2, refill_slots=3)
    with pytest.raises(ValueError, match="prompt_ids must be 2 ids"):
        sampler.generate([[1], [2]], _params(), jax.random.key(0), prompt_ids=[0])
    assert sampler.prefills == 0 and sampler.steps == 0  # nothing ran


def test_build_sampler_gives_the_continuous_sampler_unless_asked(model):
    built = build_sampler(model, None, PROMPTS, batch_size=4, n=3, max_new_tokens=8,
                          key="generate.batch_size")
    assert isinstance(built, ContinuousSampler) and built.slots == 12
    assert built.batch_size == 4
    static = build_sampler(model, None, PROMPTS, batch_size=4, n=3, max_new_tokens=8,
                           key="generate.batch_size", batching="static")
    assert type(static) is Sampler and static.batch_size == 4
    with pytest.raises(ValueError, match="batching='paged'"):
        build_sampler(model, None, PROMPTS, batch_size=4, n=3, max_new_tokens=8,
                      key="generate.batch_size", batching="paged")
    # generate.batching / generate.prefill_chunk choose it from a run config
    from jaxrl_llm.config.generate import GenerateConfig

    options = GenerateConfig(batching="static", prefill_chunk=4).sampler_options()
    assert options == {"batching": "static", "prefill_chunk": 4, "decode_data": None,
                       "decode_tensor": None}
    assert type(build_sampler(model, None, PROMPTS, batch_size=4, n=3, max_new_tokens=8,
                              key="generate.batch_size", **options)) is Sampler
    default = GenerateConfig().sampler_options()
    assert default["batching"] == "continuous"
    chunked = build_sampler(model, None, PROMPTS, batch_size=4, n=3, max_new_tokens=8,
                            key="generate.batch_size", **default)
    assert chunked.prefill_chunk == default["prefill_chunk"] == 64


def test_cache_windows_and_tail_rows_cut_the_work_not_the_samples(model):
    """70 new tokens: two cache windows (8 + 36 and 8 + 70 slots); once no prompt waits the
    running samples are gathered into fewer rows. Same samples as one full-width window on
    all slots throughout (the noise is per sample; empty slots are never attended to)."""
    params = _params(max_new_tokens=70, stop_token_ids=(3,))
    lean = ContinuousSampler(model, slots=8, prompt_buckets=(8,), min_rows=2)
    full = ContinuousSampler(model, slots=8, prompt_buckets=(8,), cache_windows=1, min_rows=8)
    a = lean.generate(PROMPTS, params, jax.random.key(2))
    b = full.generate(PROMPTS, params, jax.random.key(2))
    assert a.lengths.min() < 10 and a.lengths.max() == 70  # ragged: some run to the end
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)
    assert full.slots_attended == full.rows_decoded * (8 + 70)
    assert lean.rows_decoded < full.rows_decoded
    assert lean.slots_attended < lean.rows_decoded * (8 + 70)


def test_a_model_sharded_over_a_mesh_samples_what_one_device_samples(model):
    """Weights sharded fsdp × tensor over 4 of the 8 fake devices (tests/conftest.py): the
    slot programs run on the sharded state and give the one-device samples."""
    from jaxrl_llm.config.train import MeshConfig
    from jaxrl_llm.parallel.mesh import make_mesh
    from jaxrl_llm.parallel.rules import state_shardings

    params = _params()
    one = ContinuousSampler(model, slots=4, prompt_buckets=(8,)).generate(
        PROMPTS, params, jax.random.key(4))
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=2), devices=jax.devices()[:4])
    graphdef, state = nnx.split(model)
    with jax.set_mesh(mesh):
        sharded = nnx.merge(graphdef, jax.device_put(state, state_shardings(state, mesh)))
        out = ContinuousSampler(sharded, slots=4, prompt_buckets=(8,)).generate(
            PROMPTS, params, jax.random.key(4))
    np.testing.assert_array_equal(out.tokens, one.tokens)
    np.testing.assert_allclose(out.logprobs, one.logprobs, atol=1e-5)


GEMMA = DecoderConfig(family="gemma2", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, sliding_window=4,
                      layer_types=("sliding_attention", "full_attention"),
                      attn_logit_softcap=20.0, final_logit_softcap=15.0,
                      query_pre_attn_scalar=8, hidden_act="gelu_tanh", scan_layers=True,
                      max_position_embeddings=32)


# gemma2_scanned (17 s) moved out of the default suite (10 min 27 s on 2026-11-28); CI runs it
@pytest.mark.parametrize("config", ["llama", pytest.param("gemma2_scanned", marks=pytest.mark.slow)])
def test_the_shared_prompt_cache_samples_what_copied_caches_sample(model, config):
    """Each prompt's keys and values are stored once and read by its n samples through the
    [store row, sample] grid; the static sampler gives each of the n rows its own copy of the
    prompt's cache. Same tokens, log-probs up to float rounding (the prompt and generated
    parts are summed apart). Also with a one-row store, where slots wait for a free row
    (another schedule, the same samples), and for a Gemma-2-shaped model with scanned layers,
    a sliding window shorter than prompt + completion and soft-caps (masks by position)."""
    if config != "llama":
        graphdef, state = nnx.split(Decoder(GEMMA, rngs=nnx.Rngs(2)))
        model = nnx.merge(graphdef, jax.tree.map(lambda x: x * 3.0 if x.ndim >= 2 else x,
                                                 state))
    params = _params(n=4)
    copied = Sampler(model, batch_size=2, prompt_buckets=(8,)).generate(
        PROMPTS, params, jax.random.key(5))
    shared = ContinuousSampler(model, slots=6, prompt_buckets=(8,))
    tight = ContinuousSampler(model, slots=6, prompt_buckets=(8,), prompt_rows=1)
    assert shared.layout(PROMPTS, 4)["rows"] == 4  # min(3 × ceil(6/4), 6/2) + 1 staged
    for sampler in (shared, tight):
        out = sampler.generate(PROMPTS, params, jax.random.key(5))
        assert len(set(out.lengths.tolist())) > 2
        np.testing.assert_array_equal(out.tokens, copied.tokens)
        np.testing.assert_array_equal(out.lengths, copied.lengths)
        np.testing.assert_allclose(out.logprobs, copied.logprobs, atol=2e-5)
        np.testing.assert_allclose(out.raw_logprobs, copied.raw_logprobs, atol=2e-5)
    assert tight.steps > shared.steps  # its slots waited for the store's one row


def test_chunked_prefill_samples_what_a_whole_prompt_prefill_samples(model):
    """Prompts prefilled 3 tokens at a time (the width 8 rounded up to 9: 3 chunks), one chunk
    per decode step of the other slots, give the samples of one-chunk prefills."""
    params = _params(n=2)
    whole = ContinuousSampler(model, slots=4, refill_slots=2, prompt_buckets=(8,))
    chunked = ContinuousSampler(model, slots=4, refill_slots=2, prompt_buckets=(8,),
                                prefill_chunk=3)
    assert chunked.layout(PROMPTS, 2)["width"] == 9
    a = whole.generate(PROMPTS * 2, params, jax.random.key(6))
    b = chunked.generate(PROMPTS * 2, params, jax.random.key(6))
    np.testing.assert_array_equal(b.tokens, a.tokens)
    np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5)
    np.testing.assert_allclose(b.raw_logprobs, a.raw_logprobs, atol=1e-5)
    # 12 prompts staged one at a time: the first prefilled alone (nothing decodes yet), later
    # ones mostly chunk by chunk beside decode steps.
    assert chunked.prefills == 12 and chunked.overlapped_chunks > 12
    with pytest.raises(ValueError, match="prefill_chunk=0 must be >= 1"):
        ContinuousSampler(model, slots=4, prefill_chunk=0)
    with pytest.raises(ValueError, match=r"prompt_rows=1 must be >= the 2 prompts staged"):
        ContinuousSampler(model, slots=8, refill_slots=4, prompt_rows=1).layout(PROMPTS, 2)


def test_in_flight_weight_updates_log_each_tokens_own_policy(model):
    """PipelineRL's in-flight update (issue 43 item 6): new weights arrive between decode
    segments of running samples. B differs from A only in the unembedding, so every cached key
    and value is the same under both and a cache-free forward of each version is the exact
    reference: token t's raw log-prob must be log π_{v_t}(y_t | prompt, y_<t) for the version
    v_t the output names, the versions must run A…A B…B within a sample, some samples must
    span both, and the tokens before the switch are those A alone samples (the noise of a
    token is keyed by (prompt, sample, t), not by the weights)."""
    config = DecoderConfig(**{**CONFIG.__dict__, "tie_embeddings": False})
    graphdef, state_a = nnx.split(Decoder(config, rngs=nnx.Rngs(4)))
    state_a = jax.tree.map(lambda x: x * 5.0 if x.ndim >= 2 else x, state_a)
    model_a = nnx.merge(graphdef, state_a)
    model_b = nnx.merge(graphdef, jax.tree.map(lambda x: x + 0, state_a))  # its own arrays
    model_b.lm_head[...] = model_b.lm_head[...][::-1] * 1.5  # another head, the same cache
    state_b = nnx.split(model_b)[1]
    assert not np.allclose(model_a.lm_head[...], model_b.lm_head[...])
    calls = []

    def weights():
        calls.append(len(calls))
        return (7, state_b) if len(calls) == 3 else None  # before the third decode segment

    params = _params(max_new_tokens=MAX_NEW, n=2)
    sampler = ContinuousSampler(model_a, slots=4, segment_steps=2, prompt_buckets=(8,))
    out = sampler.generate(PROMPTS, params, jax.random.key(5), weights=weights, version=3)
    alone = ContinuousSampler(model_a, slots=4, segment_steps=2, prompt_buckets=(8,)).generate(
        PROMPTS, params, jax.random.key(5))
    assert out.versions is not None and alone.versions is None
    forward = jax.jit(lambda m, tokens: m.logits(m(tokens)))
    mixed = 0
    for row, length in enumerate(out.lengths):
        prompt = PROMPTS[int(out.prompt_index[row])]
        seq = np.asarray([*prompt, *out.tokens[row, :length].tolist()], np.int32)[None]
        versions = out.versions[row, :length]
        assert set(versions.tolist()) <= {3, 7}
        assert np.all(np.diff(versions) >= 0)  # A … A then B … B
        mixed += len(set(versions.tolist())) == 2
        logp = {v: np.asarray(jax.nn.log_softmax(forward(m, seq)[0], axis=-1), np.float64)
                for v, m in ((3, model_a), (7, model_b))}
        for t in range(length):
            want = logp[int(versions[t])][len(prompt) - 1 + t, out.tokens[row, t]]
            np.testing.assert_allclose(out.raw_logprobs[row, t], want, atol=2e-5)
        before = int(np.sum(versions == 3))
        np.testing.assert_array_equal(out.tokens[row, :before], alone.tokens[row, :before])
    assert mixed >= 1, "no sample spans the update: the test would not see a switch"
    assert 7 in out.versions[:, 0], "no sample started on the new weights"
