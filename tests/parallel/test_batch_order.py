"""A `Batch` carries its token order (`Batch.context_order`, static): natural (1) or the
load-balanced order of c context shards (parallel/context.py). On 8 fake CPU devices: a batch
a user builds by hand (natural order) and gives `Policy.step` on a context-parallel mesh
trains as the same batch does without context parallelism (derived from that run, not from
the order's own code), so does a batch in another mesh's order; the train step itself refuses
a batch in another order than its mesh's, naming the fix; converting orders composes."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxrl_llm.api import load_policy
from jaxrl_llm.config import config_from_dict
from jaxrl_llm.data.batch import array_fields
from jaxrl_llm.data.collate import collate, record_row
from jaxrl_llm.data.records import Record
from jaxrl_llm.parallel.context import BatchOrderError, check_order, reorder_batch
from jaxrl_llm.parallel.distributed import global_batch
from jaxrl_llm.parallel.mesh import make_mesh
from jaxrl_llm.train.step import make_train_step, train_step_fn

from .helpers import to_numpy

V, T, B = 128, 32, 4
SINGLE = {"data": 1, "fsdp": 1, "tensor": 1}
CONTEXT_2 = {"data": 1, "fsdp": 2, "tensor": 1, "context": 2}
TREE = {"model": {"vocab_size": V, "hidden_size": 32, "intermediate_size": 64, "num_layers": 2,
                  "num_heads": 4, "num_kv_heads": 2, "attention": "jnp"},
        "loss": {"name": "topr"},
        "optim": {"name": "sgd", "learning_rate": 1.0, "clip_norm": None},
        "train": {"batch_size": B, "max_seq_len": T}}


def _records(seed: int) -> list[Record]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(B):
        p = int(rng.integers(2, 6))
        c = int(rng.integers(8, T - p))  # completions reaching the last chunks
        mu = (rng.normal(size=c) * 0.3 - 4.2).astype(np.float32)
        out.append(Record(prompt_ids=rng.integers(1, V, p).astype(np.int32),
                          completion_ids=rng.integers(1, V, c).astype(np.int32),
                          reward=float(rng.choice([-1.0, 0.5, 1.0])), correct=bool(i % 2),
                          group_id=i // 2, behavior_logprobs=mu, mu_logprobs=mu))
    return out


def _user_batch(seed: int = 0):
    """What a user builds: `collate` of record rows, host arrays in the natural order."""
    return collate([record_row(r) for r in _records(seed)], B, (T,))


def _policy(sizes: dict):
    config = config_from_dict({**TREE, "mesh": sizes})
    devices = jax.devices()[:int(np.prod(list(sizes.values())))]
    return load_policy(config=config, mesh=make_mesh(config.mesh, devices))


def _params(policy) -> list[np.ndarray]:
    return jax.tree.leaves(to_numpy(policy.state.params))


def test_order_is_static_so_jit_never_mixes_two_orders():
    batch = _user_batch()
    assert batch.context_order == 1
    assert "context_order" not in array_fields(batch)
    reordered = reorder_batch(batch, 2)
    assert reordered.context_order == 2
    assert jax.tree.structure(reordered) != jax.tree.structure(batch)  # another jit signature
    assert jax.tree.map(lambda x: x, reordered).context_order == 2  # kept through tree maps


def test_reorder_batch_converts_from_any_order_and_never_twice():
    batch = _user_batch()
    for name in ("inputs", "positions", "loss_mask", "mu_logprobs"):
        natural = np.asarray(getattr(batch, name))
        twice = reorder_batch(reorder_batch(batch, 2), 2)  # a no-op the second time
        np.testing.assert_array_equal(getattr(twice, name), getattr(reorder_batch(batch, 2), name))
        via_4 = reorder_batch(reorder_batch(batch, 4), 2)  # 4 shards' order to 2's
        np.testing.assert_array_equal(getattr(via_4, name), getattr(reorder_batch(batch, 2), name))
        back = reorder_batch(reorder_batch(batch, 4), 1)
        assert back.context_order == 1
        np.testing.assert_array_equal(getattr(back, name), natural)
    assert reorder_batch(batch, 1) is batch
    np.testing.assert_array_equal(reorder_batch(batch, 4).rewards, batch.rewards)


def test_user_built_batch_on_a_context_mesh_trains_like_one_device():
    """The bug of issue 55 item 8: a hand-built `Batch` given to `Policy.step` on a
    context-parallel mesh trained on the natural order with the load-balanced causal masks.
    Now it is converted: the loss, gradient norm and updated weights equal the same batch's
    step on one device (which has no order to get wrong); so do a batch in another mesh's
    order (context 4's) and one from the context-parallel `Policy.batch` given to the
    one-device policy."""
    batch = _user_batch()
    one = _policy(SINGLE)
    ref = one.step(batch)
    ref_params = _params(one)
    assert ref["grad_norm"] > 0

    for given in (batch, reorder_batch(batch, 4)):
        cp = _policy(CONTEXT_2)
        metrics = cp.step(given)
        np.testing.assert_allclose(metrics["loss"], ref["loss"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(metrics["grad_norm"], ref["grad_norm"], rtol=1e-5)
        for a, b in zip(_params(cp), ref_params, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)

    built = _policy(CONTEXT_2).batch(_records(0))  # the context mesh's order, on its devices
    assert built.context_order == 2
    again = _policy(SINGLE)
    metrics = again.step(built)
    np.testing.assert_allclose(metrics["loss"], ref["loss"], rtol=1e-5, atol=1e-6)
    for a, b in zip(_params(again), ref_params, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def _refusal(given: int, context: int) -> str:
    natural = "natural token order" if given == 1 else f"order of {given} context shards"
    return (rf"this Batch is in the (load-balanced token )?{natural} \(Batch.context_order="
            rf"{given}\).*Policy.step\(batch\) converts it.*reorder_batch\(batch, {context}\)")


@pytest.mark.parametrize("sizes, given", [(CONTEXT_2, 1), (CONTEXT_2, 4), (SINGLE, 2)],
                         ids=["natural-on-context-2", "context-4-on-context-2",
                              "context-2-on-no-context"])
def test_the_train_step_refuses_a_batch_in_another_order(sizes, given):
    """Below `Policy.step`, the jitted step (and the pure step under a user's own jit) refuse
    a batch whose order is not the mesh's, before compiling anything."""
    config = config_from_dict({**TREE, "mesh": sizes})
    mesh = make_mesh(config.mesh, jax.devices()[:int(np.prod(list(sizes.values())))])
    policy = load_policy(config=config, mesh=mesh)
    context = sizes.get("context", 1)
    batch = reorder_batch(_user_batch(), given)
    with pytest.raises(BatchOrderError, match=_refusal(given, context)):
        make_train_step(config, mesh, policy.state)(policy.state, batch)
    with pytest.raises(BatchOrderError, match=_refusal(given, context)):
        jax.jit(train_step_fn(config, mesh, policy.state))(policy.state, batch)
    placed = global_batch(batch, mesh)  # what builds batches puts them in the mesh's order
    assert placed.context_order == context
    check_order(placed, context)


def test_a_forgotten_order_is_what_the_check_guards():
    """Why the order must travel with the batch: the load-balanced arrays read as natural
    (the order dropped) train differently from the batch itself, far beyond the tolerance."""
    batch = _user_batch()
    config = config_from_dict({**TREE, "mesh": SINGLE})
    mesh = make_mesh(config.mesh, jax.devices()[:1])
    state = load_policy(config=config, mesh=mesh).state
    step = make_train_step(config, mesh, state, donate=False)
    _, right = step(state, global_batch(batch, mesh))
    wrong_batch = reorder_batch(batch, 2).replace(context_order=1)
    _, wrong = step(state, global_batch(wrong_batch, mesh))
    assert abs(float(right["grad_norm"]) - float(wrong["grad_norm"])) > 1e-4
