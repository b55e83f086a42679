"""What the sampler computes, not only what it returns: each prompt is prefilled once for
its n samples, and rows that have stopped are dropped from the decode batch without changing
any sample (the noise of a row is drawn at its original row index)."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from jaxrl_llm.models.config import DecoderConfig
from jaxrl_llm.models.decoder import Decoder
from jaxrl_llm.models.sampler import Sampler, SamplingParams

VOCAB = 32
CONFIG = DecoderConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2)
TRACED_SHAPES: list[tuple[int, ...]] = []


class RecordingDecoder(Decoder):
    """A Decoder that records the token shape of every forward it is traced with."""

    def __call__(self, tokens, **kwargs):
        TRACED_SHAPES.append(tuple(tokens.shape))
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
