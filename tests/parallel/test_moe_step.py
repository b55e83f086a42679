"""The train step of a mixture-of-experts policy (models/moe.py) on 8 fake CPU devices.

1. One device: the step's loss is the naive full-logits TOPR loss plus
   router_aux_loss_coef · load-balancing + router_z_loss_coef · z-loss, and its update (SGD,
   lr 1) is minus the autodiff gradient of that sum; both router losses are logged.
2. Expert parallelism: with the experts split over an "expert" mesh axis (data × expert,
   fsdp × expert, data × fsdp × expert; tokens dispatched under `shard_map` by all-gather +
   reduce-scatter, and by the all-to-all variant) the step equals the one-device step to
   float tolerance, and the shard shapes say the experts really are split.
3. An expert count the expert axis does not divide is refused before the model is built.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxrl_llm.config import ConfigError, config_from_dict
from jaxrl_llm.models.config import DecoderConfig
from jaxrl_llm.models.decoder import Decoder
from jaxrl_llm.parallel.distributed import global_batch
from jaxrl_llm.parallel.mesh import make_mesh
from jaxrl_llm.train.state import create_train_state
from jaxrl_llm.train.step import make_train_step
from jaxrl_llm.weights.loading import load_model

from .helpers import B, V, make_batch, naive_token_logprobs, naive_topr_loss, to_numpy

EXPERTS, TOP_K, AUX, Z = 8, 2, 0.1, 0.01


def moe_config(dispatch: str = "all_gather") -> DecoderConfig:
    return DecoderConfig(family="qwen3_moe", vocab_size=V, hidden_size=16, intermediate_size=32,
                         num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, qk_norm=True,
                         num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                         moe_intermediate_size=12, router_aux_loss_coef=AUX,
                         router_z_loss_coef=Z, moe_dispatch=dispatch)


def experiment(mesh: dict):
    return config_from_dict({
        "loss": {"name": "topr", "logprob_chunk_size": 24},
        "optim": {"name": "sgd", "learning_rate": 1.0, "clip_norm": None},
        "mesh": {"data": 1, "fsdp": 1, "tensor": 1, **mesh},
        "train": {"batch_size": B},
    })


def run_step(mesh_sizes: dict, dispatch: str = "all_gather"):
    """(params before, params after, metrics, state after) of one step on the mesh."""
    config = experiment(mesh_sizes)
    n = int(np.prod(list(mesh_sizes.values()))) if mesh_sizes else 1
    mesh = make_mesh(config.mesh, jax.devices()[:n])
    state = create_train_state(config, mesh, Decoder(moe_config(dispatch), rngs=nnx.Rngs(0)))
    before = to_numpy(state.params)
    step = make_train_step(config, mesh, state)
    new_state, metrics = step(state, global_batch(make_batch(), mesh))
    return before, to_numpy(new_state.params), to_numpy(metrics), new_state


@pytest.fixture(scope="module")
def reference():
    return run_step({})


def test_one_device_step_adds_the_router_losses_to_the_naive_loss(reference):
    before, after, metrics, _ = reference
    batch = jax.tree.map(jnp.asarray, make_batch())
    model = Decoder(moe_config(), rngs=nnx.Rngs(0))

    def loss_of(m):
        hidden, aux = m(batch.inputs, positions=batch.positions, return_moe=True)
        logp = naive_token_logprobs(hidden, m.unembedding(), batch.targets)
        return naive_topr_loss(logp, batch) + AUX * aux.aux_loss + Z * aux.z_loss, aux

    (loss, aux), grads = nnx.jit(nnx.value_and_grad(loss_of, has_aux=True))(model)
    assert float(aux.aux_loss) > TOP_K  # not balanced: the term is not trivially its minimum
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(metrics["loss/router_aux_loss"], aux.aux_loss, rtol=1e-5)
    np.testing.assert_allclose(metrics["loss/router_z_loss"], aux.z_loss, rtol=1e-5)
    step_grads = jax.tree.map(lambda b, a: b - a, before, after)
    expected = to_numpy(nnx.state(grads, nnx.Param))
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(step_grads)[0],
                            jax.tree.leaves(expected)):
        np.testing.assert_allclose(x, y, atol=1e-6, rtol=1e-5, err_msg=str(path))
    router = step_grads["layers"][0]["mlp"]["router"]
    assert np.abs(router).max() > 1e-4  # the router is trained


MESHES = [
    pytest.param({"data": 2, "expert": 4}, "all_gather", id="data2-expert4"),
    pytest.param({"fsdp": 2, "expert": 4}, "all_gather", id="fsdp2-expert4"),
    pytest.param({"data": 2, "fsdp": 2, "expert": 2}, "all_gather", id="data2-fsdp2-expert2"),
    pytest.param({"data": 2, "expert": 4}, "all_to_all", id="data2-expert4-all_to_all",
                 marks=pytest.mark.slow),
    pytest.param({"fsdp": 8}, "all_gather", id="fsdp8-no-expert-axis",
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("mesh_sizes, dispatch", MESHES)
def test_expert_parallel_step_equals_one_device_step(reference, mesh_sizes, dispatch):
    ref_before, ref_after, ref_metrics, _ = reference
    before, after, metrics, state = run_step(mesh_sizes, dispatch)
    for key in ("loss", "grad_norm", "loss/router_aux_loss", "loss/router_z_loss"):
        np.testing.assert_allclose(metrics[key], ref_metrics[key], rtol=1e-5, atol=1e-6,
                                   err_msg=key)
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(after)[0],
                            jax.tree.leaves(ref_after)):
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5, err_msg=str(path))
    # The experts are split: each device holds E / expert of them (and d / fsdp of each).
    ep = mesh_sizes.get("expert", 1)
    fsdp = mesh_sizes.get("fsdp", 1)
    gate = state.params["layers"][0]["mlp"]["gate"][...]  # [E, d, F]
    shard = gate.addressable_shards[0].data.shape
    assert shard == (EXPERTS // ep, 16 // fsdp, 12)
    if ep > 1:
        assert gate.sharding.spec[0] == "expert"
        held = {s.index[0].start for s in gate.addressable_shards}
        assert held == set(range(0, EXPERTS, EXPERTS // ep))  # every expert on some device
        # outside the experts the expert axis splits d like FSDP does
        q = state.params["layers"][0]["attn"]["q"][...]
        assert "expert" in str(q.sharding.spec[0])


def test_expert_axis_that_does_not_divide_the_experts_is_refused():
    config = config_from_dict({
        "model": {"family": "mixtral", "num_experts": 6, "num_experts_per_tok": 2,
                  "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
                  "num_heads": 2, "num_kv_heads": 1},
        "mesh": {"data": 2, "expert": 4, "tensor": 1}})
    mesh = make_mesh(config.mesh)
    with pytest.raises(ConfigError, match=r"mesh.expert=4 does not divide the experts: the "
                       r"model: section \(source random\) has num_experts=6"):
        load_model(config.model, mesh=mesh)


def test_expert_axis_on_a_dense_model_is_refused():
    config = config_from_dict({"mesh": {"data": 2, "expert": 4}})
    with pytest.raises(ConfigError, match="has no experts"):
        load_model(config.model, mesh=make_mesh(config.mesh))


def test_mesh_with_an_expert_axis_splits_rows_over_it():
    config = experiment({"data": 2, "expert": 4})
    mesh = make_mesh(config.mesh)
    assert mesh.axis_names == ("data", "fsdp", "expert", "tensor")
    batch = global_batch(make_batch(), mesh)
    assert batch.inputs.sharding.spec == P(("data", "fsdp", "expert"))
    assert batch.inputs.addressable_shards[0].data.shape == (1, 12)
