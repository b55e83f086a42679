"""The continuous sampler uses the mesh (issue 54), on the 8 fake CPU devices of
tests/conftest.py: slots, store rows and staging rows split over the slot-parallel axes, KV heads
and the weights' head dimensions over "tensor".

- data parallelism alone samples the single-device sampler's tokens and log-probs bit for bit
  (a sample's noise depends only on (key, prompt, sample, t), and its attention reads only its
  own prompt and slots);
- tensor parallelism gives the same greedy tokens and log-probs within 1e-5;
- each KV buffer's addressable shard holds total / (groups × tensor) of its bytes;
- the compiled decode program's per-device FLOPs fall as 1/N from 1 to 8 devices;
- a layout that does not fit the devices, the KV heads or the slots is refused before compiling.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm.config.train import MeshConfig
from jaxrl_llm.core.errors import ConfigError
from jaxrl_llm.models.config import DecoderConfig
from jaxrl_llm.models.decoder import Decoder
from jaxrl_llm.parallel.mesh import make_mesh
from jaxrl_llm.parallel.rules import state_shardings
from jaxrl_llm.sampling.continuous import ContinuousSampler
from jaxrl_llm.sampling.layout import from_model
from jaxrl_llm.sampling.sampler import SamplingParams

VOCAB = 64
CONFIG = DecoderConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2, max_position_embeddings=32)
PROMPTS = [[5, 9, 13], [7, 3, 22, 4, 8, 2, 30], [11], [1, 2, 3, 4], [9, 9], [6, 1, 6],
           [40, 41], [17, 18, 19, 20, 21], [2], [33, 34, 35]]
STOPS = (3, 7, 12)


@pytest.fixture(scope="module")
def model() -> Decoder:
    graphdef, state = nnx.split(Decoder(CONFIG, rngs=nnx.Rngs(3)))
    return nnx.merge(graphdef, jax.tree.map(lambda x: x * 5.0 if x.ndim >= 2 else x, state))


def on_mesh(model: Decoder, devices: int, **sizes) -> Decoder:
    """The model's weights on a training mesh over the first `devices` devices."""
    mesh = make_mesh(MeshConfig(**sizes), devices=jax.devices()[:devices])
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.device_put(state, state_shardings(state, mesh)))


def sample(model, *, slots=8, **kw):
    params = SamplingParams(max_new_tokens=12, temperature=kw.pop("temperature", 1.0), n=2,
                            stop_token_ids=STOPS, **kw)
    sampler = ContinuousSampler(model, slots=slots, prompt_buckets=(8,))
    return sampler, sampler.generate(PROMPTS, params, jax.random.key(11))


@pytest.mark.parametrize("sizes", [dict(data=8, fsdp=1, tensor=1), dict(data=2, fsdp=4, tensor=1)])
def test_data_parallel_sampling_equals_one_device_bit_for_bit(model, sizes):
    """16 slots over 8 slot groups sample bit for bit what one device samples with the same
    per-device shapes (2 slots; one cache window and no tail cut, whose sizes follow the
    schedule), and what one device samples with all 16 slots up to float rounding: XLA's
    matrix products round a row differently at another row count (one device's own 16-slot and
    2-slot runs differ by up to 1 ulp on this CPU), so a log-prob is bit-equal only
    where the per-device shapes are."""
    params = SamplingParams(max_new_tokens=12, temperature=1.0, n=2, stop_token_ids=STOPS,
                            top_k=20, top_p=0.9)
    fixed = dict(prompt_buckets=(8,), cache_windows=1, min_rows=16)
    run = lambda m, slots: ContinuousSampler(m, slots=slots, **fixed).generate(
        PROMPTS, params, jax.random.key(11))
    one_per_device, one_whole = run(model, 2), run(model, 16)
    sharded = on_mesh(model, 8, **sizes)
    out = run(sharded, 16)
    assert from_model(sharded).groups == 8  # FSDP decodes as slot parallelism
    assert len(set(out.lengths.tolist())) > 2  # stops end samples at different lengths
    for name in ("tokens", "logprobs", "raw_logprobs", "lengths"):
        np.testing.assert_array_equal(getattr(out, name), getattr(one_per_device, name))
    np.testing.assert_array_equal(out.tokens, one_whole.tokens)
    np.testing.assert_allclose(out.logprobs, one_whole.logprobs, rtol=0, atol=2e-6)
    # The default sampler (windows, tail cut) on the mesh: the same tokens.
    _, default = sample(sharded, slots=16, top_k=20, top_p=0.9)
    np.testing.assert_array_equal(default.tokens, out.tokens)
    np.testing.assert_allclose(default.logprobs, out.logprobs, rtol=0, atol=2e-6)


def test_tensor_parallel_greedy_tokens_equal_and_logprobs_agree(model):
    _, one = sample(model, temperature=0.0)
    sharded = on_mesh(model, 8, data=4, fsdp=1, tensor=2)
    sampler, out = sample(sharded, temperature=0.0)
    assert (sampler.decode_layout.groups, sampler.decode_layout.tensor) == (4, 2)
    np.testing.assert_array_equal(out.tokens, one.tokens)
    np.testing.assert_allclose(out.raw_logprobs, one.raw_logprobs, atol=1e-5)


def _cache(model, slots=8):
    """The carry and store the sampler allocates, in its layout (as `generate` makes them)."""
    from jaxrl_llm.sampling.prompt_cache import init_staging, init_store
    from jaxrl_llm.sampling.slot_program import init_slots

    layout = from_model(model)
    carry = layout.make(lambda key: init_slots(
        model, slots=slots, gen_len=16, cache_dtype=np.float32, max_new=16, vocab=0,
        pad_token_id=0, key=key, return_logits=False,
        staging=init_staging(model, 8, 8, np.float32)), jax.random.key(0))
    store = layout.make(lambda: init_store(model, slots, 8, np.float32))
    return layout, carry, store


@pytest.mark.parametrize("sizes,per_device", [
    (dict(data=8, fsdp=1, tensor=1), 8),
    (dict(data=2, fsdp=2, tensor=2), 8),
    (dict(data=1, fsdp=4, tensor=2), 8),
])
def test_each_device_holds_its_share_of_the_kv_cache(model, sizes, per_device):
    layout, carry, store = _cache(on_mesh(model, 8, **sizes))
    assert layout.groups * layout.tensor == per_device
    buffers = [*carry["state"]["own"]["k"], *carry["state"]["own"]["v"],
               *store["k"], *store["v"]]
    for a in buffers:
        shard = a.addressable_shards[0].data
        assert shard.nbytes * per_device == a.nbytes, (a.shape, a.sharding)
        assert len({d for d in a.sharding.device_set}) == 8


def test_decode_flops_per_device_fall_as_one_over_n(model):
    """From the compiled decode program's cost analysis: the same 8 slots over 1, 2, 4, 8
    devices (slot parallelism) cost 1/N of the FLOPs per device."""
    from jaxrl_llm.sampling.decode_program import Program
    from jaxrl_llm.sampling.slot_program import decode_slots

    flops = {}
    for n in (1, 2, 4, 8):
        sharded = on_mesh(model, n, data=n, fsdp=1, tensor=1) if n > 1 else model
        layout, carry, store = _cache(sharded)
        graphdef, state = nnx.split(sharded)
        state = layout.place_state(state)
        compiled = decode_slots.lower(
            graphdef, state, None, carry, store, np.int32(1), np.int32(9), np.float32(1),
            np.float32(1), np.asarray([3], np.int32), program=Program(16, 2, False, 0, False),
            pad_token_id=0, return_logits=False, chunk=8, layout=layout).compile()
        cost = compiled.cost_analysis()
        flops[n] = float((cost[0] if isinstance(cost, list) else cost)["flops"])
    for n in (2, 4, 8):
        assert flops[n] == pytest.approx(flops[1] / n, rel=0.15), flops


def test_layouts_that_do_not_fit_are_refused_naming_the_key(model):
    sharded = on_mesh(model, 8, data=8, fsdp=1, tensor=1)
    with pytest.raises(ConfigError, match=r"generate.decode_data=4 × generate.decode_tensor=4"):
        from_model(sharded, data=4, tensor=4)
    with pytest.raises(ConfigError, match="idle"):
        from_model(sharded, data=2, tensor=2)
    with pytest.raises(ConfigError, match=r"generate.decode_tensor=8 does not divide .* 2 KV"):
        from_model(sharded, data=1, tensor=8)
    with pytest.raises(ConfigError, match="do not split over the 8 slot groups"):
        ContinuousSampler(sharded, slots=12)
    layout = from_model(sharded, data=4, tensor=2)
    assert (layout.groups, layout.tensor, layout.devices) == (4, 2, 8)
    assert math.prod(layout.mesh.devices.shape) == 8
