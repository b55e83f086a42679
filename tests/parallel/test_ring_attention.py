"""Ring attention (models/ring.py, `model.attention: ring`) on 8 fake CPU devices, `context` 4 ×
`fsdp` 2: the same outputs and q/k/v gradients as the all-gather strategy and as unsplit
attention on the original order (GQA, packed and padded rows, a sliding window, a logit
soft-cap); its compiled program passes keys round the ring (collective-permute) and gathers
none; a TOPR train step with it equals the unsharded step and compiles to under 0.6× the
all-gather step's temporary memory per device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm.config import config_from_dict
from jaxrl_llm.models.attention import attention_mesh, self_attention
from jaxrl_llm.models.decoder import Decoder
from jaxrl_llm.parallel.context import inverse_order, load_balance_order
from jaxrl_llm.parallel.mesh import make_mesh

from .test_context_parallel import CONTEXT, SINGLE, _batch, _decoder_config, _step

B, T, HQ, HKV, D = 2, 32, 4, 2, 8


def _inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, T, HQ, D)).astype(np.float32)
    k, v = (rng.normal(size=(B, T, HKV, D)).astype(np.float32) for _ in range(2))
    seg = np.ones((B, T), np.int32)
    seg[0, 19:], seg[1, 27:] = 2, 0  # a second record in row 0 (crossing shards); padding
    weight = rng.normal(size=(B, T, HQ, D)).astype(np.float32) * (seg > 0)[..., None, None]
    return q, k, v, seg, weight


def _split_attention(implementation: str, window, softcap, mesh, order):
    def loss(q, k, v, s, w):
        with attention_mesh(mesh):
            out = self_attention(q, k, v, s, scale=0.3, implementation=implementation,
                                 order=order, window=window, is_local=window is not None,
                                 logit_softcap=softcap)
        return jnp.sum(out * w), out

    return jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))


def _placed(mesh, order, *arrays):
    rows = NamedSharding(mesh, P(("data", "fsdp"), "context"))
    heads = NamedSharding(mesh, P(("data", "fsdp"), "context", None, None))
    return [jax.device_put(x[:, order], heads if x.ndim == 4 else rows) for x in arrays]


@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (None, 2.0)],
                         ids=["causal", "window5", "softcap"])
def test_ring_equals_all_gather_and_unsplit_attention(window, softcap):
    q, k, v, seg, weight = _inputs()
    mesh = make_mesh(config_from_dict({"mesh": CONTEXT, "train": {"max_seq_len": T}}).mesh)
    order = load_balance_order(T, 4)

    def unsplit(q, k, v):
        out = self_attention(q, k, v, jnp.asarray(seg), scale=0.3, implementation="jnp",
                             window=window, is_local=window is not None, logit_softcap=softcap)
        return jnp.sum(out * weight), out

    (_, out_ref), grads_ref = jax.value_and_grad(unsplit, (0, 1, 2), has_aux=True)(q, k, v)
    args = _placed(mesh, order, q, k, v, seg, weight)
    (_, out_ring), grads_ring = _split_attention("ring", window, softcap, mesh, order)(*args)
    (_, out_gather), grads_gather = _split_attention("jnp", window, softcap, mesh, order)(*args)
    back = inverse_order(order)
    real = (seg > 0)[..., None, None]
    for out in (out_ring, out_gather):
        np.testing.assert_allclose(np.where(real, np.asarray(out)[:, back], 0),
                                   np.where(real, out_ref, 0), atol=1e-5)
    for name, g_ring, g_gather, g_ref in zip("qkv", grads_ring, grads_gather, grads_ref,
                                             strict=True):
        np.testing.assert_allclose(np.asarray(g_ring), np.asarray(g_gather), atol=1e-5,
                                   err_msg=name)
        np.testing.assert_allclose(np.asarray(g_ring)[:, back], g_ref, atol=1e-5, err_msg=name)
    assert np.abs(out_ref).max() > 0.1 and all(np.abs(g).max() > 1e-3 for g in grads_ref)


def test_ring_passes_chunks_round_and_gathers_none():
    q, k, v, seg, weight = _inputs()
    mesh = make_mesh(config_from_dict({"mesh": CONTEXT, "train": {"max_seq_len": T}}).mesh)
    order = load_balance_order(T, 4)
    args = _placed(mesh, order, q, k, v, seg, weight)
    ring = _split_attention("ring", None, None, mesh, order).lower(*args).compile().as_text()
    gather = _split_attention("jnp", None, None, mesh, order).lower(*args).compile().as_text()
    assert "collective-permute" in ring and "all-gather" not in ring
    assert "all-gather" in gather and "collective-permute" not in gather


def test_ring_train_step_equals_unsharded():
    with nnx.use_eager_sharding(False):
        ring = Decoder(_decoder_config().replace(attention="ring"), rngs=nnx.Rngs(0))
    batch = _batch("packed")
    ref_metrics, ref_grads = _step("topr", SINGLE, batch)
    metrics, grads = _step("topr", CONTEXT, batch, model=ring)
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-5, atol=1e-6)
    assert ref_metrics["grad_norm"] > 0
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads),
                            jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("remat", ["none", "full"])
def test_ring_train_step_needs_less_temporary_memory_than_all_gather(remat):
    """What the ring is for, asserted from the compiler's own numbers: `plan` compiles the
    project's TOPR train step on 8 fake CPU devices (fsdp 2 × context 4, 2,048-token rows)
    with each strategy, and `memory_analysis()`'s temp bytes per device are well below the
    all-gather strategy's. All-gather keeps each layer's float32 scores against the whole row
    for the backward pass; the ring recomputes each step's (models/ring.py: a scan over the
    steps, each `jax.checkpoint`ed), so one step's [heads, T/c, T/c] block is live at a time.
    Measured: 36.3 MB against 93.0 MB (remat none), 24.0 MB against 56.7 MB (full); the
    ring unrolled without the per-step remat needed 90.4 MB (none)."""
    from jaxrl_llm.plan import make_plan

    from .test_plan import ARCH, tree

    temp = {}
    for attention in ("jnp", "ring"):
        model = {**ARCH, "attention": attention, "max_position_embeddings": 2048,
                 "remat": remat, "scan_layers": remat != "none"}
        config = config_from_dict({**tree(CONTEXT, {"platform": "cpu", "num_devices": 8}),
                                   "model": model, "train": {"batch_size": 2, "max_seq_len": 2048}})
        temp[attention] = make_plan(config).temp_bytes
    print(f"temp bytes per device, remat {remat}: {temp}")
    assert temp["ring"] < 0.6 * temp["jnp"], temp
