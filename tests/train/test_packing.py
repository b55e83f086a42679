"""Packed rows (several records per row, segment ids) give the same losses, gradients and
train step as one record per row.

The unpacked path is tested against SPEC §2–4 elsewhere (tests/losses, tests/parallel), so it
is the oracle here: the same 8 records, once as 8 padded rows and once packed by hand into 4
rows of up to 3 records (in a different record order), through a tiny random-init Llama
decoder whose attention honours the segment ids.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm.config import ConfigError, config_from_dict
from jaxrl_llm.data.batch import records_view, token_record_mask
from jaxrl_llm.data.loader import collate, collate_packed, record_row
from jaxrl_llm.data.records import Record
from jaxrl_llm.models.decoder import Decoder
from jaxrl_llm.parallel.distributed import global_batch
from jaxrl_llm.parallel.mesh import make_mesh
from jaxrl_llm.train.forward import forward
from jaxrl_llm.train.loss_fn import compute_loss
from jaxrl_llm.train.state import create_train_state
from jaxrl_llm.train.step import make_train_step
from jaxrl_llm.weights.loading import decoder_config

VOCAB, MAX_LEN, K = 64, 24, 3
# (prompt, completion) lengths; row length = prompt + completion − 1.
SHAPES = [(4, 6), (2, 4), (3, 5), (3, 2), (5, 7), (2, 5), (2, 2), (4, 5)]
ROW_LEN = [p + c - 1 for p, c in SHAPES]  # [9, 5, 7, 4, 11, 6, 3, 8]
# Hand packing into 4 rows of ≤ 3 records and ≤ 24 tokens (17, 11, 17, 8 tokens).
LAYOUT = [[0, 1, 6], [2, 3], [4, 5], [7]]


def make_records() -> list[Record]:
    rng = np.random.default_rng(7)
    out = []
    for i, (p, c) in enumerate(SHAPES):
        reward = 1.0 if i % 3 == 0 else -1.0
        out.append(Record(
            prompt_ids=rng.integers(1, VOCAB, p), completion_ids=rng.integers(1, VOCAB, c),
            reward=reward, correct=reward > 0, group_id=i // 4, task="unit",
            behavior_logprobs=-rng.uniform(0.5, 4.0, c), mu_logprobs=-rng.uniform(0.5, 4.0, c),
        ))
    return out


def batches():
    """(unpacked [8 rows], packed [4 rows × 3 slots]) batches of the same records."""
    rows = [record_row(r) for r in make_records()]
    assert [r["inputs"].size for r in rows] == ROW_LEN
    unpacked = collate(rows, len(rows), (MAX_LEN,))
    packed = collate_packed([[rows[i] for i in row] for row in LAYOUT], len(LAYOUT), MAX_LEN, K)
    return unpacked, packed


def make_config(name: str, **sections):
    tree = {
        "seed": 0,
        "model": {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_layers": 2,
                  "num_heads": 4, "num_kv_heads": 2, "max_position_embeddings": 64,
                  "tie_embeddings": False},
        "loss": {"name": name, "logprob_chunk_size": 16, "fpa_lambda": 1.5},
        "optim": {"name": "sgd", "learning_rate": 1.0, "clip_norm": None},
        "mesh": {"data": 1, "fsdp": 1, "tensor": 1},
        "train": {"batch_size": 8, "max_seq_len": MAX_LEN, "ref_logprobs": "model"},
    }
    for key, value in sections.items():
        tree.setdefault(key, {}).update(value)
    return config_from_dict(tree)


def decoder(config, seed: int) -> Decoder:
    """Random-init decoder with weights scaled up so attention and logits are far from uniform
    (a leak across segments would then show in every value)."""
    with nnx.use_eager_sharding(False):
        model = Decoder(decoder_config(config.model), rngs=nnx.Rngs(seed))
    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, state)
    return nnx.merge(graphdef, state)


def test_records_view_by_hand():
    x = jnp.asarray([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    seg = jnp.asarray([[1, 1, 2, 2, 2, 0]], jnp.int32)
    np.testing.assert_array_equal(records_view(x, seg, 3), [
        [1, 2, 0, 0, 0, 0],
        [0, 0, 3, 4, 5, 0],
        [0, 0, 0, 0, 0, 0],
    ])
    # Gradients flow back into each token's own segment only.
    w = jnp.arange(18.0).reshape(3, 6)
    grad = jax.grad(lambda v: jnp.sum(records_view(v, seg, 3) * w))(x)
    np.testing.assert_array_equal(grad, [[0, 1, 8, 9, 10, 0]])


def test_token_record_mask_and_completion_tokens_count_real_records_only():
    unpacked, packed = batches()
    completion = sum(c for _, c in SHAPES)
    for batch in (unpacked, packed):
        assert float(jnp.sum(batch.loss_mask * token_record_mask(batch))) == completion
    # Drop record 1 (row 0, slot 1 when packed; row 1 unpacked): its 4 completion tokens go.
    slot = 1
    packed = packed.replace(record_mask=packed.record_mask.copy())
    packed.record_mask[slot] = 0.0
    unpacked = unpacked.replace(record_mask=unpacked.record_mask.copy())
    unpacked.record_mask[1] = 0.0
    for batch in (unpacked, packed):
        assert float(jnp.sum(batch.loss_mask * token_record_mask(batch))) == completion - SHAPES[1][1]


SLOW = pytest.mark.slow  # the rest of the loss families: CI's slow run, not the default one
LOSS_CASES = [
    pytest.param("topr", {}, id="topr"),
    pytest.param("sft", {}, id="sft"),
    pytest.param("grpo", {"aggregation": "token-mean"}, id="grpo"),
    pytest.param("fpa", {}, id="fpa"),
    pytest.param("ppo", {}, id="ppo", marks=SLOW),
    pytest.param("dr_grpo", {}, id="dr_grpo", marks=SLOW),
    pytest.param("off_rl_kl", {"kl_exact": True}, id="off_rl_kl", marks=SLOW),
    pytest.param("kto", {}, id="kto", marks=SLOW),
    pytest.param("apo", {}, id="apo", marks=SLOW),
]


@pytest.mark.parametrize(("loss", "options"), LOSS_CASES)
def test_packed_loss_and_gradients_equal_unpacked(loss, options):
    config = make_config(loss, loss=options)
    policy, ref = decoder(config, 0), decoder(config, 1)
    graphdef, params, model_state = nnx.split(policy, nnx.Param, ...)
    ref_graphdef, ref_params, ref_state = nnx.split(ref, nnx.Param, ...)

    @jax.jit
    def loss_and_grad(params, batch):
        rows = (batch.inputs, batch.positions, batch.segment_ids)
        ref_hidden, ref_unembed, _ = forward(ref_graphdef, ref_params, ref_state, *rows)

        def f(p):
            hidden, unembed, softcap = forward(graphdef, p, model_state, *rows)
            out = compute_loss(config, batch, hidden, unembed, ref_hidden=ref_hidden,
                               ref_unembed=ref_unembed, softcap=softcap)
            return out.total / out.weight, out.weight

        return jax.value_and_grad(f, has_aux=True)(params)

    unpacked, packed = batches()
    (loss_u, weight_u), grads_u = loss_and_grad(params, unpacked)
    (loss_p, weight_p), grads_p = loss_and_grad(params, packed)
    assert np.isfinite(float(loss_u)) and abs(float(loss_u)) > 1e-4  # a non-trivial oracle
    np.testing.assert_allclose(float(weight_p), float(weight_u), rtol=1e-6)
    np.testing.assert_allclose(float(loss_p), float(loss_u), rtol=1e-5, atol=1e-6)
    leaves_u = jax.tree.leaves(grads_u)
    scale = max(float(jnp.max(jnp.abs(g))) for g in leaves_u)
    assert scale > 1e-6
    for (path, gp), gu in zip(jax.tree_util.tree_flatten_with_path(grads_p)[0], leaves_u):
        np.testing.assert_allclose(gp, gu, rtol=1e-5, atol=1e-5 * scale, err_msg=str(path))


def test_pair_losses_refuse_packing():
    # The config refuses the combination (naming both keys) ...
    with pytest.raises(ConfigError, match=r"data\.pack=true cannot train loss\.name=dpo.*set data\.pack=false"):
        make_config("dpo", data={"pack": True, "records_per_row": K})
    # ... and the loss refuses a packed batch handed to it directly.
    _, packed = batches()
    h = jnp.zeros((*packed.inputs.shape, 32))
    with pytest.raises(ConfigError, match=r"loss\.name=rpo cannot train on packed rows.*data\.pack"):
        compute_loss(make_config("rpo"), packed, h, jnp.zeros((32, VOCAB)))


@pytest.mark.parametrize(("loss", "packed_mesh"), [
    ("topr", (1, 1, 1)), pytest.param("grpo", (1, 2, 1), marks=SLOW)])
def test_packed_train_step_with_micro_batches_equals_unpacked_step(loss, packed_mesh):
    """Oracle: the unpacked full batch on one device. Packed: 2 micro-batches of 2 rows (and
    their 6 record slots) each; on `(1, 2, 1)` every micro-batch is also split over 2 fsdp
    shards, so rows and their records must land on the same device."""
    unpacked, packed = batches()
    results = []
    for batch, mesh_shape, train, data in (
        (unpacked, (1, 1, 1), {"batch_size": 8}, {}),
        (packed, packed_mesh, {"batch_size": 4, "micro_batch_size": 2},
         {"pack": True, "records_per_row": K}),
    ):
        config = make_config(loss, train=train, data=data,
                             mesh=dict(zip(("data", "fsdp", "tensor"), mesh_shape)))
        mesh = make_mesh(config.mesh, jax.devices()[: int(np.prod(mesh_shape))])
        state = create_train_state(config, mesh, decoder(config, 0))
        before = jax.tree.map(np.asarray, state.params)
        step = make_train_step(config, mesh, state, donate=False)
        new_state, metrics = step(state, global_batch(batch, mesh))
        delta = jax.tree.map(lambda a, b: np.asarray(a) - b, new_state.params, before)
        results.append((jax.device_get(metrics), delta))
    (m_u, d_u), (m_p, d_p) = results
    assert m_u["update_skipped"] == m_p["update_skipped"] == 0
    assert m_u["completion_tokens"] == m_p["completion_tokens"] == sum(c for _, c in SHAPES)
    np.testing.assert_allclose(m_p["loss_weight"], m_u["loss_weight"], rtol=1e-6)
    np.testing.assert_allclose(m_p["loss"], m_u["loss"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m_p["grad_norm"], m_u["grad_norm"], rtol=1e-5)
    scale = max(float(np.max(np.abs(x))) for x in jax.tree.leaves(d_u))
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(d_p)[0], jax.tree.leaves(d_u)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale, err_msg=str(path))
