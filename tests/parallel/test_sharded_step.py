"""One train step on meshes of 8 fake CPU devices equals the single-device step (TOPR, FPA),
the single-device step equals a naive full-logits loss (SPEC §2–3), parameters and optimizer
state are sharded as the rules say, and 4 micro-batches equal one big batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxrl_llm.config import ConfigError
from jaxrl_llm.parallel.distributed import global_batch
from jaxrl_llm.parallel.mesh import make_mesh
from jaxrl_llm.train.state import create_train_state
from jaxrl_llm.train.step import make_train_step

from .helpers import (
    make_batch,
    make_config,
    naive_fpa_loss,
    naive_token_logprobs,
    naive_topr_loss,
    to_numpy,
)
from .toy_model import ToyLM

MESHES = [(8, 1, 1), (2, 4, 1), (2, 2, 2), (1, 4, 2)]
DEFAULT = {("topr", (2, 2, 2)), ("topr", (1, 4, 2)), ("fpa", (2, 2, 2))}


def toy() -> ToyLM:
    with nnx.use_eager_sharding(False):
        return ToyLM(rngs=nnx.Rngs(0))


_STEPS: dict = {}


def compiled_step(loss: str, mesh_shape, **sections):
    """(config, mesh, jitted step), compiled once per distinct set-up in this process."""
    key = (loss, tuple(mesh_shape), repr(sorted(sections.items())))
    if key not in _STEPS:
        config = make_config(loss, mesh_shape, **sections)
        n = int(np.prod(mesh_shape))
        mesh = make_mesh(config.mesh, jax.devices()[:n])
        state = create_train_state(config, mesh, toy())
        _STEPS[key] = (config, mesh, make_train_step(config, mesh, state))
    return _STEPS[key]


def run_step(loss: str, mesh_shape, batch=None, **sections):
    """(params before, params after, metrics, state after) of one step from the toy model."""
    config, mesh, step = compiled_step(loss, mesh_shape, **sections)
    state = create_train_state(config, mesh, toy())
    before = to_numpy(state.params)
    batch = make_batch() if batch is None else batch
    new_state, metrics = step(state, global_batch(batch, mesh))
    return before, to_numpy(new_state.params), to_numpy(metrics), new_state


@pytest.fixture(scope="module")
def reference():
    """Single-device results per loss (computed once per module)."""
    return {loss: run_step(loss, (1, 1, 1)) for loss in ("topr", "fpa")}


def _assert_tree_close(a, b, atol):
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, atol=atol, rtol=1e-5, err_msg=str(path))


def test_single_device_topr_matches_naive_full_logits_loss(reference):
    before, after, metrics, _ = reference["topr"]
    batch = make_batch()
    model = toy()

    def loss_of(m):
        hidden = m(jnp.asarray(batch.inputs), positions=jnp.asarray(batch.positions))
        logp = naive_token_logprobs(hidden, m.unembedding(), jnp.asarray(batch.targets))
        return naive_topr_loss(logp, jax.tree.map(jnp.asarray, batch))

    loss, grads = nnx.value_and_grad(loss_of)(model)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
    # SGD lr 1: after = before − grad.
    step_grads = jax.tree.map(lambda b, a: b - a, before, after)
    _assert_tree_close(step_grads, to_numpy(nnx.state(grads, nnx.Param)), atol=1e-6)


def test_single_device_fpa_matches_naive_extrapolated_loss(reference):
    _, _, metrics, _ = reference["fpa"]
    batch = jax.tree.map(jnp.asarray, make_batch())
    model = toy()
    hidden = model(batch.inputs, positions=batch.positions)
    w = model.unembedding()
    # At step 0 the reference is the policy itself, so z = (1+λ) hW − λ hW = hW.
    lam = 1.5
    logits = jnp.einsum("btd,dv->btv", hidden, w)
    z = (1 + lam) * logits - lam * logits
    logp_hat = jnp.take_along_axis(jax.nn.log_softmax(z, -1), batch.targets[..., None], -1)[..., 0]
    logp = naive_token_logprobs(hidden, w, batch.targets)
    np.testing.assert_allclose(metrics["loss"], naive_fpa_loss(logp, logp_hat, batch), rtol=1e-5)


# The default run compiles three meshes; the full sweep (8 set-ups) runs with -m slow.
SWEEP = [
    pytest.param(loss, mesh, id=f"{loss}-{'x'.join(map(str, mesh))}",
                 marks=() if (loss, mesh) in DEFAULT else pytest.mark.slow)
    for loss in ("topr", "fpa") for mesh in MESHES
]


@pytest.mark.parametrize("loss, mesh_shape", SWEEP)
def test_sharded_step_matches_single_device(reference, loss, mesh_shape):
    ref_before, ref_after, ref_metrics, _ = reference[loss]
    before, after, metrics, state = run_step(loss, mesh_shape)
    _assert_tree_close(before, ref_before, atol=0)
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["grad_norm"], ref_metrics["grad_norm"], rtol=1e-5)
    grads = jax.tree.map(lambda b, a: b - a, before, after)
    ref_grads = jax.tree.map(lambda b, a: b - a, ref_before, ref_after)
    _assert_tree_close(grads, ref_grads, atol=1e-5)
    _assert_tree_close(after, ref_after, atol=1e-5)
    # The updated params stay where the rules put them (out_shardings of the jitted step).
    data, fsdp, tensor = mesh_shape
    expect = {
        "embed": P("tensor" if tensor > 1 else None, "fsdp" if fsdp > 1 else None),
        "w_in": P("fsdp" if fsdp > 1 else None, "tensor" if tensor > 1 else None),
        "w_out": P("tensor" if tensor > 1 else None, "fsdp" if fsdp > 1 else None),
        "norm": P(None),
    }
    for name, spec in expect.items():
        assert state.params[name].get_value().sharding.spec == spec, name


@pytest.mark.parametrize("optimizer", ["adamw", "adafactor"])
def test_optimizer_state_is_sharded_like_params(optimizer):
    config = make_config("topr", (2, 2, 2), optim={"name": optimizer, "clip_norm": 1.0})
    mesh = make_mesh(config.mesh)
    with nnx.use_eager_sharding(False):
        # Dims ≥ 128 so that Adafactor factors the embedding's second moment.
        model = ToyLM(vocab=256, d=128, ff=256, rngs=nnx.Rngs(0))
    state = create_train_state(config, mesh, model)
    embed = state.params["embed"][...]  # [256, 128] ("vocab", "embed")
    assert embed.sharding.spec == P("tensor", "fsdp")
    assert embed.addressable_shards[0].data.shape == (128, 64)
    leaves = jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
    by_name = {jax.tree_util.keystr(p): x for p, x in leaves}

    def find(stat: str, param: str):
        hits = [x for k, x in by_name.items() if f".{stat}[" in k and f"'{param}'" in k]
        assert len(hits) == 1, (stat, param, list(by_name))
        return hits[0]

    if optimizer == "adamw":
        assert find("mu", "w_in").sharding.spec == P("fsdp", "tensor")
        assert find("nu", "embed").sharding.spec == P("tensor", "fsdp")
        assert find("mu", "embed").addressable_shards[0].data.shape == (128, 64)
    else:
        # Factored second moment of embed [256, 128]: the statistic over the 128 "embed"
        # entries keeps its "fsdp" split, the one over the 256 "vocab" entries "tensor".
        v_row, v_col = find("v_row", "embed"), find("v_col", "embed")
        assert v_row.shape == (128,) and v_row.sharding.spec == P("fsdp")
        assert v_col.shape == (256,) and v_col.sharding.spec == P("tensor")
    counts = [x for k, x in by_name.items() if "count" in k]
    assert counts and all(c.sharding.spec == P() for c in counts)


def test_decoder_parameters_follow_the_rules():
    """The real Decoder's annotations through the rules (abstract state: no weights)."""
    from jaxrl_llm.train.state import abstract_train_state

    config = make_config("topr", (2, 2, 2), model={
        "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2,
        "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "scan_layers": True,
        "tie_embeddings": False}, optim={"name": "adamw"})
    state = abstract_train_state(config, make_mesh(config.mesh))
    layers = state.params["layers"]
    expect = {
        ("embed",): P("tensor", "fsdp"),
        ("lm_head",): P("tensor", "fsdp"),
        ("final_norm", "scale"): P(None),
        ("layers", "attn", "q"): P(None, "fsdp", "tensor", None),
        ("layers", "attn", "k"): P(None, "fsdp", "tensor", None),
        ("layers", "attn", "o"): P(None, "tensor", None, "fsdp"),
        ("layers", "mlp", "gate"): P(None, "fsdp", "tensor"),
        ("layers", "mlp", "down"): P(None, "tensor", "fsdp"),
        ("layers", "attn_norm", "scale"): P(None, None),
    }
    for path, spec in expect.items():
        node = state.params
        for key in path:
            node = node[key]
        assert node.get_value().sharding.spec == spec, path
    assert layers["mlp"]["up"].get_value().dtype == np.float32  # fp32 master weights
    mu = [x for p, x in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
          if ".mu['layers']['mlp']['down']" in jax.tree_util.keystr(p)]
    assert len(mu) == 1 and mu[0].sharding.spec == P(None, "tensor", "fsdp")


def test_four_micro_batches_equal_one_big_batch(reference):
    _, ref_after, ref_metrics, _ = reference["topr"]
    _, after, metrics, _ = run_step("topr", (1, 2, 4), train={"micro_batch_size": 2})
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-5, atol=1e-6)
    _assert_tree_close(after, ref_after, atol=1e-5)


def test_non_finite_loss_skips_the_update(reference):
    batch = make_batch()
    batch = batch.replace(rewards=np.where(np.arange(8) == 3, np.nan, batch.rewards))
    before, after, metrics, new_state = run_step("topr", (1, 1, 1), batch=batch)
    assert metrics["update_skipped"] == 1.0 and not np.isfinite(metrics["loss"])
    assert int(new_state.step) == 0
    _assert_tree_close(after, before, atol=0)
    _, _, ok_metrics, ok_state = reference["topr"]
    assert ok_metrics["update_skipped"] == 0.0 and int(ok_state.step) == 1


def test_micro_batch_must_split_over_batch_shards():
    with pytest.raises(ConfigError, match="micro_batch_size=2 must be a multiple"):
        run_step("topr", (2, 2, 2), train={"micro_batch_size": 2})


@pytest.mark.slow
def test_grpo_micro_batches_use_full_batch_group_advantages():
    """Groups of 4 rows are cut by micro-batches of 2: advantages come from the full batch."""
    _, full_after, full_metrics, _ = run_step("grpo", (1, 2, 1))
    _, after, metrics, _ = run_step("grpo", (1, 2, 1), train={"micro_batch_size": 2})
    np.testing.assert_allclose(metrics["loss"], full_metrics["loss"], rtol=1e-5, atol=1e-6)
    _assert_tree_close(after, full_after, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("ref_source", ["batch", "model"])
def test_dpo_step_with_reference_from_batch_or_model(ref_source):
    """At step 0 the reference is the policy, so Δ = 0 and the DPO loss is log 2 (SPEC §4);
    with `ref_logprobs: batch` holding the policy's own log-probs the same holds."""
    batch = make_batch()
    model = toy()
    hidden = model(jnp.asarray(batch.inputs), positions=jnp.asarray(batch.positions))
    own = np.asarray(naive_token_logprobs(hidden, model.unembedding(), batch.targets))
    pairs = np.array([[1, 0], [3, 2], [5, 4]], np.int32)
    batch = batch.replace(ref_logprobs=own * batch.loss_mask, pair_index=pairs)
    _, _, metrics, _ = run_step("dpo", (2, 2, 2), batch=batch, train={"ref_logprobs": ref_source})
    np.testing.assert_allclose(metrics["loss"], np.log(2.0), rtol=1e-5)
