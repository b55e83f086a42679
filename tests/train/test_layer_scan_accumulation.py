"""Micro-batch gradients accumulated inside the layer scan's backward pass
(`models/layer_scan.py`, `train.accumulate_in_layer_scan`) equal the plain scan's autodiff
summed over micro-batches, and equal one big batch; on an FSDP mesh too; with bf16 compute;
for FPA (policy + frozen reference forward) and TOPR. The compiled step holds fewer bytes of
temporaries (no stacked micro-batch gradient, no whole-model compute-dtype copy)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxrl_llm.config import config_from_dict
from jaxrl_llm.parallel.distributed import global_batch
from jaxrl_llm.parallel.mesh import make_mesh
from jaxrl_llm.train.state import create_train_state
from jaxrl_llm.train.step import accumulates_in_layer_scan, make_loss_and_grad

from ..parallel.helpers import make_batch

MODEL = {"source": "random", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
         "num_layers": 3, "num_heads": 4, "num_kv_heads": 2, "max_position_embeddings": 64,
         "scan_layers": True, "remat": "full"}


def _config(loss: str, *, fsdp: int, in_scan: bool, micro: int | None, dtype: str = "float32",
            masters: bool = True):
    return config_from_dict({
        "model": {**MODEL, "param_dtype": dtype, "compute_dtype": dtype},
        "loss": {"name": loss},
        "optim": {"master_weights_fp32": masters},
        "mesh": {"data": 1, "fsdp": fsdp, "tensor": 1},
        "train": {"batch_size": 8, "micro_batch_size": micro, "max_seq_len": 16,
                  "accumulate_in_layer_scan": in_scan},
    })


def _grads(loss: str, *, fsdp: int = 1, in_scan: bool, micro: int | None,
           dtype: str = "float32", masters: bool = True):
    """(gradients by key path, Σ total, the compiled step's temp bytes) of one batch."""
    config = _config(loss, fsdp=fsdp, in_scan=in_scan, micro=micro, dtype=dtype, masters=masters)
    mesh = make_mesh(config.mesh, jax.devices()[:fsdp])
    state = create_train_state(config, mesh)
    loss_and_grad = make_loss_and_grad(config, mesh, state)
    batch = global_batch(make_batch(), mesh)
    fn = jax.jit(lambda s, b: loss_and_grad(s.params, s, b)[:2])
    compiled = fn.lower(state, batch).compile()  # run this one: calling `fn` would compile again
    temp = compiled.memory_analysis().temp_size_in_bytes
    grads, total = compiled(state, batch)
    flat = {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(grads)}
    return flat, float(total), temp


def _assert_same(a: dict, b: dict, rtol: float, atol: float):
    assert a.keys() == b.keys()
    layer_keys = [k for k in a if k.startswith("['layers']")]
    assert layer_keys, sorted(a)
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=rtol, atol=atol, err_msg=key)


def test_the_switch_follows_the_config():
    assert accumulates_in_layer_scan(_config("topr", fsdp=1, in_scan=True, micro=2))
    assert not accumulates_in_layer_scan(_config("topr", fsdp=1, in_scan=False, micro=2))
    cfg = _config("topr", fsdp=1, in_scan=True, micro=2)
    assert not accumulates_in_layer_scan(cfg.model_copy(update={
        "model": cfg.model.model_copy(update={"scan_layers": False})}))
    assert not accumulates_in_layer_scan(cfg.model_copy(update={
        "model": cfg.model.model_copy(update={"remat": "dots"})}))


@pytest.mark.parametrize("loss", ["topr", pytest.param("fpa", marks=pytest.mark.slow)])
def test_in_scan_accumulation_equals_plain_scan_and_one_big_batch(loss):
    plain, total_plain, temp_plain = _grads(loss, in_scan=False, micro=2)
    in_scan, total_in, temp_in = _grads(loss, in_scan=True, micro=2)
    whole, total_whole, _ = _grads(loss, in_scan=True, micro=None)  # n = 1: the plain path
    _assert_same(in_scan, plain, rtol=1e-5, atol=1e-7)
    _assert_same(in_scan, whole, rtol=1e-4, atol=1e-6)
    assert total_in == pytest.approx(total_plain, rel=1e-6)
    assert total_in == pytest.approx(total_whole, rel=1e-5)
    # The plain scan holds a stacked micro-batch gradient of the layers besides the accumulator.
    layer_bytes = sum(v.nbytes for k, v in in_scan.items() if k.startswith("['layers']"))
    assert temp_in <= temp_plain - layer_bytes // 2, (temp_in, temp_plain, layer_bytes)


@pytest.mark.slow
def test_in_scan_accumulation_on_an_fsdp_mesh_with_bf16_compute():
    plain, _, _ = _grads("topr", fsdp=4, in_scan=False, micro=4, dtype="bfloat16")
    in_scan, _, _ = _grads("topr", fsdp=4, in_scan=True, micro=4, dtype="bfloat16")
    # Same bf16 matmuls; only where the bf16 → fp32 conversion sits differs.
    _assert_same(in_scan, plain, rtol=2e-2, atol=1e-4)


def test_bf16_weights_without_float32_masters():
    """`optim.master_weights_fp32: false` with bf16 weights: the same gradients, bit for bit,
    with the switch on (the step then keeps the plain scan) as off."""
    on, _, _ = _grads("topr", in_scan=True, micro=2, dtype="bfloat16", masters=False)
    off, _, _ = _grads("topr", in_scan=False, micro=2, dtype="bfloat16", masters=False)
    _assert_same(on, off, rtol=0, atol=0)
