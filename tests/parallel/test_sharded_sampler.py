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


def make_model() -> Decoder:
    """A tiny random decoder whose weights are scaled so that samples end at varied lengths."""
    graphdef, state = nnx.split(Decoder(CONFIG, rngs=nnx.Rngs(3)))
    return nnx.merge(graphdef, jax.tree.map(lambda x: x * 5.0 if x.ndim >= 2 else x, state))


@pytest.fixture(scope="module")
def model() -> Decoder:
    return make_model()


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


def test_weights_reach_the_sampler_in_the_sampling_dtype_and_change_no_logit():
    """float32 masters, bfloat16 compute: the decode copy holds the weight matrices in
    bfloat16 (half the bytes), the norm scales in float32 (RMSNorm reads them so), and the
    model's logits are bit-identical, since it casts each matrix to bfloat16 at every use."""
    import jax.numpy as jnp

    from jaxrl_llm.sampling.layout import DecodeLayout

    config = DecoderConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                           num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=32,
                           param_dtype="float32", compute_dtype="bfloat16")
    model = on_mesh(Decoder(config, rngs=nnx.Rngs(5)), 8, data=4, fsdp=1, tensor=2)
    graphdef, state = nnx.split(model)
    layout = from_model(model)
    lean = layout.place_state(state, jnp.bfloat16)
    dtypes = {a.ndim: set() for a in jax.tree.leaves(lean)}
    for a in jax.tree.leaves(lean):
        dtypes[a.ndim].add(str(a.dtype))
    assert dtypes[1] == {"float32"} and all(dtypes[k] == {"bfloat16"} for k in dtypes if k > 1)
    nbytes = lambda tree: sum(a.nbytes for a in jax.tree.leaves(tree) if a.ndim > 1)
    assert nbytes(lean) * 2 == nbytes(state)
    embed = lean["embed"].get_value()  # decode rules: vocab over tensor, d_model replicated
    assert embed.sharding.spec == jax.sharding.PartitionSpec("tensor", None)
    tokens = jnp.asarray([[3, 9, 27, 4]])
    full = model.logits(model(tokens))
    decode = nnx.merge(graphdef, lean)
    cast = decode.logits(decode(tokens))
    np.testing.assert_array_equal(np.asarray(cast, np.float32), np.asarray(full, np.float32))
    assert DecodeLayout().place_state(state) is state  # unplaced, no dtype: no copy


@pytest.mark.slow
def test_two_processes_sample_what_one_process_samples(tmp_path):
    """2 processes × 4 devices (localhost `jax.distributed`) against 1 process × 8 devices:
    the same records bit for bit, and every process's devices hold slot groups."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.parallel.helpers import free_port

    worker = Path(__file__).with_name("mp_sampler_worker.py")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    port = str(free_port())
    runs = [[sys.executable, str(worker), port, str(i), str(tmp_path / f"p{i}.npz")]
            for i in range(2)] + [[sys.executable, str(worker), "-", "0",
                                   str(tmp_path / "one.npz")]]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for cmd in runs]
    for p in procs:
        out = p.communicate(timeout=600)[0]
        assert p.returncode == 0, out[-3000:]
    one = np.load(tmp_path / "one.npz")
    for i in range(2):
        got = np.load(tmp_path / f"p{i}.npz")
        assert int(got["groups"]) == 8 and int(got["local_devices"]) == 4
        assert got["owners"].tolist() == [0, 1]  # no host's devices idle
        for name in ("tokens", "logprobs", "raw_logprobs", "lengths"):
            np.testing.assert_array_equal(got[name], one[name], err_msg=name)


def test_build_sampler_rounds_slots_to_the_groups_and_budgets_per_chip(model, monkeypatch):
    """`build_sampler` (what generate, evaluate and the API call): batch_size × n slots rounded
    up to a multiple of the slot groups, said; a cache that cannot fit refused per chip before
    anything compiles, naming the layout and the keys that lower it."""
    from jaxrl_llm.parallel.memory import LIMIT_ENV, InsufficientMemory
    from jaxrl_llm.sampling.build import build_sampler

    sharded = on_mesh(model, 8, data=8, fsdp=1, tensor=1)
    said: list[str] = []
    sampler = build_sampler(sharded, None, PROMPTS, batch_size=3, n=1, max_new_tokens=4,
                            key="generate.batch_size", say=said.append)
    assert sampler.slots == 8 and sampler.decode_layout.groups == 8
    assert "3×1 = 3 samples at a time rounded up to 8 decode slots" in said[0]
    monkeypatch.setenv(LIMIT_ENV, "0.01")
    with pytest.raises(InsufficientMemory, match=r"per chip .*8 slot group.*generate\.decode_data"):
        build_sampler(sharded, None, PROMPTS, batch_size=8, n=4, max_new_tokens=8,
                      key="generate.batch_size", say=said.append)
