"""What the sampler computes, not only what it returns: each prompt is prefilled once for
its n samples, rows that have stopped are dropped from the decode batch, and the KV cache
grows by windows, without changing any sample (the noise of a row is drawn at its original
row index; empty cache slots are never attended to)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm.models.config import DecoderConfig
from jaxrl_llm.models.decoder import Decoder
from jaxrl_llm.sampling.sampler import Sampler, SamplingParams, window_ends

VOCAB = 32
CONFIG = DecoderConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2)
TRACED_SHAPES: list[tuple[int, ...]] = []
TRACED_CACHE_SLOTS: list[int] = []


class RecordingDecoder(Decoder):
    """A Decoder that records the token shape and cache size of every forward it is traced
    with."""

    def __call__(self, tokens, **kwargs):
        TRACED_SHAPES.append(tuple(tokens.shape))
        TRACED_CACHE_SLOTS.append(kwargs["cache"].max_len)
        return super().__call__(tokens, **kwargs)


def _spread(model):
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(lambda x: x * 5.0 if x.ndim >= 2 else x, state))


def test_n_samples_share_one_prefill_per_prompt():
    TRACED_SHAPES.clear()
    sampler = Sampler(RecordingDecoder(CONFIG, rngs=nnx.Rngs(0)), batch_size=3,
                      prompt_buckets=(8,))
    out = sampler.generate([[1, 2, 3], [4, 5], [6]], SamplingParams(max_new_tokens=4, n=4),
                           jax.random.key(0))
    assert out.tokens.shape == (12, 4)
    # One prefill of the 3 prompts ([3, 8], not [12, 8]); the decode steps run all 12 rows.
    assert TRACED_SHAPES == [(3, 8), (12, 1)]


def test_finished_rows_leave_the_batch_and_the_samples_do_not_change():
    model = _spread(Decoder(CONFIG, rngs=nnx.Rngs(1)))
    prompts = [[int(t) for t in np.random.RandomState(i).randint(1, VOCAB, 3 + i % 4)]
               for i in range(8)]
    # Two frequent tokens as stop ids: rows end at very different steps.
    params = SamplingParams(max_new_tokens=24, n=4, stop_token_ids=(3, 7))
    whole = Sampler(model, batch_size=8, prompt_buckets=(8,), segment_steps=24)
    pruned = Sampler(model, batch_size=8, prompt_buckets=(8,), segment_steps=2, min_rows=1)
    a = whole.generate(prompts, params, jax.random.key(4))
    b = pruned.generate(prompts, params, jax.random.key(4))

    lengths = a.lengths
    assert 1 <= lengths.min() < 8 and lengths.max() == 24  # early and late finishers
    np.testing.assert_array_equal(b.tokens, a.tokens)
    np.testing.assert_array_equal(b.lengths, a.lengths)
    np.testing.assert_array_equal(b.finish_reason, a.finish_reason)
    np.testing.assert_allclose(b.raw_logprobs, a.raw_logprobs, atol=1e-5)
    # Compute: without pruning every step runs all 32 rows until the longest row ends; with
    # pruning, a segment runs only the rows kept after the previous one. Upper bound: twice
    # the rows still running at each step (power-of-two padding), plus 32 rows for 2 steps.
    steps = lengths.max() - 1
    assert whole.rows_decoded == 32 * steps
    running = np.array([(lengths > s).sum() for s in range(1, lengths.max())])
    assert pruned.rows_decoded <= 2 * 32 + 2 * running.sum()
    assert pruned.rows_decoded < 0.75 * whole.rows_decoded


def test_timed_segments_call_back_after_each_and_do_not_change_the_samples():
    """`segment_s` cuts segments by time (a stop check or progress line at least that often):
    at 1e-9 s every segment after the first one's 8 steps is one step; the samples are those of
    the default segments. `on_segment` sees each batch's prefill (0) and every segment's end."""
    model = _spread(Decoder(CONFIG, rngs=nnx.Rngs(1)))
    prompts = [[int(t) for t in np.random.RandomState(i).randint(1, VOCAB, 3 + i % 4)]
               for i in range(6)]
    for stops in ((3, 7), ()):  # with stop tokens (pruned rows) and without (one segment)
        params = SamplingParams(max_new_tokens=24, n=2, stop_token_ids=stops)
        calls: list[tuple[int, int]] = []
        default = Sampler(model, batch_size=4, prompt_buckets=(8,)).generate(
            prompts, params, jax.random.key(5))
        timed = Sampler(model, batch_size=4, prompt_buckets=(8,), min_rows=1, segment_s=1e-9)
        out = timed.generate(prompts, params, jax.random.key(5),
                             on_segment=lambda b, step, calls=calls: calls.append((b, step)))
        np.testing.assert_array_equal(out.tokens, default.tokens)
        np.testing.assert_array_equal(out.lengths, default.lengths)
        np.testing.assert_allclose(out.raw_logprobs, default.raw_logprobs, atol=1e-5)
        for batch, rows in ((0, slice(0, 8)), (1, slice(8, 12))):
            steps = [step for b, step in calls if b == batch]
            last = int(out.lengths[rows].max()) if stops else 24
            # prefill, then 8 steps (the very first segment: it measures the rate), then one
            # step per segment (step 1 is the prefill's token)
            first = 9 if batch == 0 else 2
            assert steps == [0, *range(first, last + 1)], (stops, batch, steps)


def test_window_ends_split_the_decode_steps_in_parts_of_at_least_32():
    # max_new - 1 decode steps in min(windows, steps // 32) parts, rounded up: worked by hand.
    assert window_ends(40, 4) == [40]  # 39 steps: one window
    assert window_ends(70, 4) == [36, 70]  # 69 = 35 + 34
    assert window_ends(128, 4) == [44, 86, 128]  # 127 = 43 + 42 + 42
    assert window_ends(257, 4) == [65, 129, 193, 257]
    assert window_ends(257, 1) == [257]
    for max_new in range(1, 600, 7):
        ends = window_ends(max_new, 4)
        spans = np.diff([1, *ends])
        assert ends[-1] == max_new and len(ends) <= 4
        assert len(ends) == 1 or (spans.min() >= 32 and spans.max() - spans.min() <= 1)


@pytest.mark.slow
def test_the_cache_grows_by_windows_and_the_samples_do_not_change():
    model = _spread(RecordingDecoder(CONFIG, rngs=nnx.Rngs(2)))
    prompts = [[int(t) for t in np.random.RandomState(10 + i).randint(1, VOCAB, 2 + i % 5)]
               for i in range(6)]
    width, max_new = 8, 70  # 69 decode steps: windows of 35 and 34 steps
    for params in (SamplingParams(max_new_tokens=max_new, temperature=0.0),
                   SamplingParams(max_new_tokens=max_new, n=2, stop_token_ids=(3,))):
        TRACED_CACHE_SLOTS.clear()
        windowed = Sampler(model, batch_size=6, prompt_buckets=(width,), min_rows=1)
        b = windowed.generate(prompts, params, jax.random.key(5))
        # Prefill and the first window ran with 8 + 36 slots, the second with 8 + 70.
        assert TRACED_CACHE_SLOTS[:2] == [width + 36, width + 36], TRACED_CACHE_SLOTS
        assert width + 70 in TRACED_CACHE_SLOTS
        whole = Sampler(model, batch_size=6, prompt_buckets=(width,), min_rows=1,
                        cache_windows=1)
        a = whole.generate(prompts, params, jax.random.key(5))
        np.testing.assert_array_equal(b.tokens, a.tokens)
        np.testing.assert_array_equal(b.lengths, a.lengths)
        np.testing.assert_allclose(b.raw_logprobs, a.raw_logprobs, atol=1e-5)
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5)
        if params.greedy:  # every row runs every step: the slots attended, counted by hand
            assert whole.slots_attended == 6 * 69 * (width + 70)
            assert windowed.slots_attended == 6 * (35 * (width + 36) + 34 * (width + 70))
        else:
            assert 1 <= a.lengths.min() < 35 and a.lengths.max() > 36  # ends in both windows
