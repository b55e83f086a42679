"""Sampling a mixture of experts (docs/moe.md): both samplers (the static `Sampler` and the
continuous one, shared prompt cache and all) on tiny random Qwen3-MoE and Mixtral decoders.

Independent check: a cache-free forward of the whole sequence (prompt + completion, no KV
cache, no prompt store, no fused decode weights; the path tests/models/test_moe_parity.py
holds to transformers) gives every sampled token the log-prob the sampler reported, and routes
every fed completion token to the experts the sampler recorded (`return_routing`), layer by
layer. Recording changes no sample; a dense model has nothing to record.
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
from jaxrl_llm.sampling.sampler import Sampler, SamplingParams

PROMPTS = [[5, 9, 13], [7, 3, 22, 4, 8, 2, 30], [11], [1, 2, 3, 4]]
FAMILIES = {
    "qwen3_moe": dict(family="qwen3_moe", qk_norm=True, num_experts=8, num_experts_per_tok=2),
    "mixtral": dict(family="mixtral", num_experts=4, num_experts_per_tok=2),
}
MAX_NEW = 10
PARAMS = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, n=2,
                        stop_token_ids=tuple(range(0, 48, 5)))  # ~1 in 5: lengths vary


def _model(family: str) -> Decoder:
    config = DecoderConfig(vocab_size=48, hidden_size=32, intermediate_size=48, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=8, moe_intermediate_size=24,
                           max_position_embeddings=32, **FAMILIES[family])
    graphdef, state = nnx.split(Decoder(config, rngs=nnx.Rngs(3)))
    # larger weights: peaked next-token distributions and routers far from uniform
    return nnx.merge(graphdef, jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, state))


def _samplers(model: Decoder) -> dict:
    return {"static": Sampler(model, batch_size=2, prompt_buckets=(8,)),
            "continuous": ContinuousSampler(model, slots=3, prompt_buckets=(8,))}


def _full_forward(model: Decoder, prompt: list[int], completion: np.ndarray):
    """(log-probs [C] of the completion's tokens, routing [L, C − 1, k] of its fed tokens)
    from one cache-free forward of prompt + completion[:-1]."""
    tokens = jnp.asarray([list(prompt) + completion[:-1].tolist()], jnp.int32)
    hidden, aux = model(tokens, return_moe=True)
    logp = jax.nn.log_softmax(model.logits(hidden)[0], axis=-1)
    p = len(prompt)
    rows = np.arange(p - 1, p - 1 + completion.size)
    return (np.asarray(logp)[rows, completion],
            np.asarray(aux.routing)[:, 0, p:p + completion.size - 1])


# Three of the four cases (up to a minute each on 2 cores) run with the slow tests; the default
# run keeps the static sampler on Qwen3-MoE (and samples the continuous one's MoE path below).
@pytest.mark.parametrize("family, kind", [
    ("qwen3_moe", "static"),
    pytest.param("qwen3_moe", "continuous", marks=pytest.mark.slow),
    pytest.param("mixtral", "static", marks=pytest.mark.slow),
    pytest.param("mixtral", "continuous", marks=pytest.mark.slow),
])
def test_moe_samples_and_routing_equal_a_cache_free_forward(family, kind):
    model = _model(family)
    sampler = _samplers(model)[kind]
    out = sampler.generate(PROMPTS, PARAMS, jax.random.key(5), return_routing=True)
    config = model.config
    assert out.routing.shape == (len(PROMPTS) * PARAMS.n, MAX_NEW, config.num_layers,
                                 config.num_experts_per_tok)
    assert out.routing.dtype == np.int8
    assert len(set(out.lengths.tolist())) > 1  # stops end some samples early
    worst = 0.0
    for row in range(out.tokens.shape[0]):
        n = int(out.lengths[row])
        completion = out.tokens[row, :n]
        logp, routing = _full_forward(model, PROMPTS[out.prompt_index[row]], completion)
        worst = max(worst, float(np.max(np.abs(logp - out.raw_logprobs[row, :n]))))
        recorded = out.routing[row, :n - 1].transpose(1, 0, 2)  # [L, C − 1, k]
        np.testing.assert_array_equal(np.sort(recorded, -1), np.sort(routing, -1),
                                      err_msg=f"row {row}")
        assert (out.routing[row, n - 1:] == -1).all()  # the last token is never fed
    assert worst < 2e-6, worst


@pytest.mark.parametrize("kind", ["static", "continuous"])
def test_recording_routing_changes_no_sample_and_needs_experts(kind):
    model = _model("qwen3_moe")
    sampler = _samplers(model)[kind]
    off = sampler.generate(PROMPTS, PARAMS, jax.random.key(8))
    on = sampler.generate(PROMPTS, PARAMS, jax.random.key(8), return_routing=True)
    assert off.routing is None
    np.testing.assert_array_equal(on.tokens, off.tokens)
    np.testing.assert_array_equal(on.raw_logprobs, off.raw_logprobs)
    dense = Decoder(DecoderConfig(vocab_size=48, hidden_size=32, intermediate_size=48,
                                  num_layers=1, num_heads=4, num_kv_heads=2),
                    rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="has no experts to record"):
        _samplers(dense)[kind].generate(PROMPTS, PARAMS, jax.random.key(8), return_routing=True)
