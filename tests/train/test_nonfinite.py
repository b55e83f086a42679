"""Non-finite values inside the jitted step: NaN/inf in a batch field or a gradient skips the
update with parameters and optimizer state unchanged bit for bit, is counted in the metrics,
and `train.max_nonfinite_steps` consecutive skips stop the run naming the step and the first
non-finite quantity; every loss keeps its ratios finite under extreme log-ratios."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm.losses.registry import LOSS_SPECS
from jaxrl_llm.parallel.distributed import global_batch
from jaxrl_llm.parallel.mesh import make_mesh
from jaxrl_llm.train import step as step_module
from jaxrl_llm.train.nonfinite import (
    NONFINITE_KEY,
    NonFiniteError,
    NonfiniteGuard,
    nonfinite_quantities,
)
from jaxrl_llm.train.state import create_train_state
from jaxrl_llm.train.step import make_train_step
from tests.parallel.helpers import make_batch, make_config
from tests.parallel.toy_model import ToyLM
from tests.reliability import record

pytestmark = pytest.mark.reliability
SECTION = "non-finite values"


def toy() -> ToyLM:
    with nnx.use_eager_sharding(False):
        return ToyLM(rngs=nnx.Rngs(0))


def host_bits(tree) -> list[tuple[str, bytes]]:
    """Every leaf's path and raw bytes: equality is bit-exact (NaN payloads and −0.0 too)."""
    return [(jax.tree_util.keystr(p), np.asarray(jax.device_get(x)).tobytes())
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def setup(loss: str = "topr", **sections):
    """(config, mesh, un-donated jitted step, state after one finite AdamW step)."""
    config = make_config(loss, optim={"name": "adamw", "learning_rate": 1e-2, "clip_norm": 1.0},
                         **sections)
    mesh = make_mesh(config.mesh, jax.devices()[:1])
    state = create_train_state(config, mesh, toy())
    step = make_train_step(config, mesh, state, donate=False)
    state, metrics = step(state, global_batch(make_batch(), mesh))
    assert float(metrics["update_skipped"]) == 0.0 and int(state.step) == 1
    return config, mesh, step, state


@pytest.fixture(scope="module")
def topr():
    return setup("topr")


def poisoned(field: str, value: float):
    """The default batch with `value` at one completion token (or one record) of `field`."""
    batch = make_batch(seed=1)
    arr = np.array(getattr(batch, field))
    if arr.ndim == 2:
        row, col = 2, int(np.argmax(batch.loss_mask[2]))  # a token the loss reads
        arr[row, col] = value
    else:
        arr[2] = value
    return batch.replace(**{field: arr})


CASES = [("mu_logprobs", np.nan), ("mu_logprobs", -np.inf), ("rewards", np.nan),
         ("rewards", np.inf), ("ref_logprobs", np.nan), ("loss_mask", np.nan)]


def test_nonfinite_batch_field_skips_the_update_bit_exactly(topr):
    _, mesh, step, state = topr
    names = nonfinite_quantities(state.params)
    failures = 0
    for field, value in CASES:
        new_state, metrics = step(state, global_batch(poisoned(field, value), mesh))
        ok = (float(metrics["update_skipped"]) == 1.0
              and int(new_state.step) == int(state.step)
              and host_bits(new_state.params) == host_bits(state.params)
              and host_bits(new_state.opt_state) == host_bits(state.opt_state)
              and names[int(metrics[NONFINITE_KEY])] == f"batch field {field}")
        failures += not ok
        assert ok, (field, value, names[int(metrics[NONFINITE_KEY])])
    # The same step on a clean batch does update (the comparison above can fail).
    clean_state, clean = step(state, global_batch(make_batch(seed=1), mesh))
    assert float(clean["update_skipped"]) == 0.0 and int(clean[NONFINITE_KEY]) == -1
    assert host_bits(clean_state.params) != host_bits(state.params)
    assert host_bits(clean_state.opt_state) != host_bits(state.opt_state)
    record(SECTION, "NaN/inf in a batch field (train step)", runs=len(CASES), failures=failures,
           detail=", ".join(f"{f}={v}" for f, v in CASES) + ": update skipped, params and "
           "AdamW state bit-identical, the field named")


def test_nonfinite_gradient_leaf_skips_and_is_named(monkeypatch):
    """An inf in the second-to-last gradient leaf and a NaN in the last, with a finite loss:
    skipped bit-exactly, and the first bad leaf in parameter order is named."""
    real = step_module.make_loss_and_grad

    def poisoned_loss_and_grad(config, mesh, state):
        inner = real(config, mesh, state)

        def loss_and_grad(params, st, batch):
            grads, total, weight, metrics, sign = inner(params, st, batch)
            leaves, treedef = jax.tree.flatten(grads)
            for i, value in ((-2, np.inf), (-1, np.nan)):
                leaves[i] = leaves[i].at[(0,) * leaves[i].ndim].set(value)
            return jax.tree.unflatten(treedef, leaves), total, weight, metrics, sign

        return loss_and_grad

    monkeypatch.setattr(step_module, "make_loss_and_grad", poisoned_loss_and_grad)
    config = make_config("topr", optim={"name": "adamw", "learning_rate": 1e-2})
    mesh = make_mesh(config.mesh, jax.devices()[:1])
    state = create_train_state(config, mesh, toy())
    paths = [jax.tree_util.keystr(p)
             for p, _ in jax.tree_util.tree_flatten_with_path(state.params)[0]]
    step = make_train_step(config, mesh, state, donate=False)
    new_state, metrics = step(state, global_batch(make_batch(), mesh))
    name = nonfinite_quantities(state.params)[int(metrics[NONFINITE_KEY])]
    assert np.isfinite(float(metrics["loss"])) and float(metrics["update_skipped"]) == 1.0
    assert host_bits(new_state.params) == host_bits(state.params)
    assert host_bits(new_state.opt_state) == host_bits(state.opt_state)
    assert int(new_state.step) == 0 and name == f"gradient of params{paths[-2]}", name
    record(SECTION, "inf and NaN in two gradient leaves (finite loss)", runs=1, failures=0,
           detail=f"update skipped, params and AdamW state bit-identical, first bad leaf named "
           f"({name})")


def test_guard_counts_and_stops_after_m_consecutive_skips():
    guard = NonfiniteGuard(("batch field rewards", "loss", "gradient of params['w']"), limit=3)
    pattern = [0, 1, 0, 1, 1]  # skipped steps 2, 4, 5: the streak restarts after step 3
    for step, skipped in enumerate(pattern, start=1):
        scalars = {"update_skipped": float(skipped), NONFINITE_KEY: 1.0 if skipped else -1.0}
        guard.observe(step, scalars)
        assert NONFINITE_KEY not in scalars  # popped: an index is not a metric to average
    assert guard.metrics() == {"train/nonfinite_skips": 3.0, "train/consecutive_nonfinite": 2.0}
    with pytest.raises(NonFiniteError, match=r"step 6: 3 consecutive .*train\.max_nonfinite_"
                       r"steps=3.*the first, at step 4, had a non-finite loss"):
        guard.observe(6, {"update_skipped": 1.0, NONFINITE_KEY: 2.0, "loss": 1.0})


def extreme_batch(loss: str):
    """Log-ratios of ±10⁴ nats on every completion token: μ and π_ref put e^−10⁴ on the
    sampled tokens, so exp(log π − log μ) overflows float32 unless clamped in log space."""
    batch = make_batch(seed=2)
    mask = batch.loss_mask
    fields = {"mu_logprobs": -1e4 * mask, "behavior_logprobs": -1e4 * mask,
              "ref_logprobs": -1e4 * mask}
    if LOSS_SPECS[loss].needs_pairs:
        fields["pair_index"] = np.array([[0, 1], [2, 3], [4, 5], [6, 7]], np.int32)
    return batch.replace(**{k: np.asarray(v, np.float32) if k != "pair_index" else v
                            for k, v in fields.items()})


@pytest.mark.slow
@pytest.mark.reliability
def test_every_loss_stays_finite_under_extreme_log_ratios():
    failures, bad = 0, []
    for loss in sorted(LOSS_SPECS):
        config = make_config(loss, optim={"name": "sgd", "learning_rate": 1e-3})
        mesh = make_mesh(config.mesh, jax.devices()[:1])
        state = create_train_state(config, mesh, toy())
        step = make_train_step(config, mesh, state, donate=False)
        _, metrics = step(state, global_batch(extreme_batch(loss), mesh))
        ok = (float(metrics["update_skipped"]) == 0.0 and np.isfinite(float(metrics["loss"]))
              and np.isfinite(float(metrics["grad_norm"])))
        if not ok:
            failures += 1
            bad.append((loss, float(metrics["loss"]), float(metrics["grad_norm"])))
    record(SECTION, "every loss under log-ratios of 1e4 nats", runs=len(LOSS_SPECS),
           failures=failures, detail=f"{len(LOSS_SPECS)} losses of losses/registry.py: loss and "
           "gradient norm finite, no step skipped (ratios clamped in log space)")
    assert not bad, bad
