"""Context parallelism (parallel/context.py): on 8 fake CPU devices, `mesh.context` 4 ×
`mesh.fsdp` 2 gives the unsharded step's loss and gradients (to 1e-5) for TOPR, GRPO, GSPO, FPA
(π_ref in the step), DPO (pairs), packed rows and PKPO-transformed rewards, on a scanned,
rematerialised decoder with GQA; splash's query-sharded kernel equals the jnp path; the score
pass's μ and the API's `Policy.score` / `Policy.step` (online's update) equal the unsharded ones;
a run killed after a checkpoint resumes bit-identically; bad set-ups are refused at config load,
a row too long for a chip by `plan` before compiling."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm.config import MeshConfig, config_from_dict
from jaxrl_llm.core.errors import ConfigError
from jaxrl_llm.data.collate import collate, collate_packed, record_row
from jaxrl_llm.data.records import Record
from jaxrl_llm.losses import pkpo
from jaxrl_llm.models.attention import attention_mesh, self_attention
from jaxrl_llm.models.config import DecoderConfig
from jaxrl_llm.models.decoder import Decoder
from jaxrl_llm.parallel.context import inverse_order, load_balance_order, reorder_batch
from jaxrl_llm.parallel.distributed import global_batch
from jaxrl_llm.parallel.mesh import make_mesh
from jaxrl_llm.plan import libtpu_available
from jaxrl_llm.train.scorer import make_scorer
from jaxrl_llm.train.state import create_train_state
from jaxrl_llm.train.step import make_train_step
from jaxrl_llm.train.trainer import Trainer
from tests.train.test_trainer import N, params_of, records, tiny_config  # noqa: F401 (fixture)

from .helpers import to_numpy

V, T, B = 64, 32, 4
CONTEXT = {"data": 1, "fsdp": 2, "tensor": 1, "context": 4}
SINGLE = {"data": 1, "fsdp": 1, "tensor": 1}


def test_load_balance_order_gives_chip_i_chunks_i_and_2c_minus_1_minus_i():
    order = load_balance_order(16, 2)  # 4 chunks of 4 tokens; chip 0: chunks 0, 3; chip 1: 1, 2
    np.testing.assert_array_equal(order, [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11])
    np.testing.assert_array_equal(order[inverse_order(order)], np.arange(16))
    # equal causal work: Σ (original slot + 1) over each chip's half of the row
    work = [(order[:8] + 1).sum(), (order[8:] + 1).sum()]
    assert work[0] == work[1]
    with pytest.raises(ValueError, match="2 × mesh.context = 8"):
        load_balance_order(12, 4)


def _decoder_config() -> DecoderConfig:
    return DecoderConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=T,
                         rope_theta=10_000.0, rms_norm_eps=1e-6, tie_embeddings=False,
                         param_dtype="float32", compute_dtype="float32", scan_layers=True,
                         remat="full", attention="jnp")


def _model() -> Decoder:
    with nnx.use_eager_sharding(False):
        return Decoder(_decoder_config(), rngs=nnx.Rngs(0))


def _config(loss: str, mesh: dict, **loss_options):
    return config_from_dict({
        "loss": {"name": loss, "logprob_chunk_size": 24, "fpa_lambda": 1.5, **loss_options},
        "optim": {"name": "sgd", "learning_rate": 1.0, "clip_norm": None},
        "mesh": mesh,
        "train": {"batch_size": B, "max_seq_len": T,
                  "ref_logprobs": "model" if loss == "dpo" else "batch"},
    })


def _records(seed: int, n: int, longest: int) -> list[Record]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = int(rng.integers(2, 6))
        c = int(rng.integers(2, longest - p))
        mu = (rng.normal(size=c) * 0.3 - 4.2).astype(np.float32)
        out.append(Record(prompt_ids=rng.integers(1, V, p).astype(np.int32),
                          completion_ids=rng.integers(1, V, c).astype(np.int32),
                          reward=float(rng.choice([-1.0, 0.5, 1.0])), correct=bool(i % 2),
                          group_id=i // 2, behavior_logprobs=mu, mu_logprobs=mu,
                          ref_logprobs=mu - 0.1))
    return out


def _batch(kind: str):
    if kind == "packed":  # 2 records per row, 4 rows: segments and positions cross shards
        rows = [[record_row(r) for r in _records(3 + i, 2, 14)] for i in range(B)]
        return collate_packed(rows, B, T, 2)
    rows = [record_row(r) for r in _records(1, B, T)]
    batch = collate(rows, B, (T,), pairs=kind == "pairs")
    if kind == "pkpo":  # PKPO's leave-one-out max@2 transform over groups of 2 (PKPO eq. 29)
        rewards = pkpo.sloo_minus_one(np.asarray(batch.rewards).reshape(-1, 2), 2)
        batch = batch.replace(rewards=np.asarray(rewards, np.float32).reshape(-1))
    return batch


def _step(loss: str, mesh_sizes: dict, batch, model: Decoder | None = None, **loss_options):
    config = _config(loss, mesh_sizes, **loss_options)
    n = int(np.prod(list(mesh_sizes.values())))
    mesh = make_mesh(config.mesh, jax.devices()[:n])
    state = create_train_state(config, mesh, model or _model())
    before = to_numpy(state.params)
    step = make_train_step(config, mesh, state)
    new_state, metrics = step(state, global_batch(batch, mesh))
    if mesh_sizes.get("context", 1) > 1:  # the context shards split the state like FSDP's
        assert new_state.params["embed"].get_value().sharding.spec == P(None, ("fsdp", "context"))
    grads = jax.tree.map(lambda b, a: b - a, before, to_numpy(new_state.params))
    return to_numpy(metrics), grads


CASES = [("topr", "plain", {}), ("grpo", "plain", {}), ("gspo", "plain", {}),
         ("fpa", "plain", {}), ("dpo", "pairs", {}), ("topr", "packed", {}),
         ("grpo", "packed", {}), ("topr", "pkpo", {"baseline": 0.0})]


@pytest.mark.parametrize("loss, kind, options", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_context_parallel_step_equals_unsharded(loss, kind, options):
    batch = _batch(kind)
    ref_metrics, ref_grads = _step(loss, SINGLE, batch, **options)
    metrics, grads = _step(loss, CONTEXT, batch, **options)
    assert np.isfinite(ref_metrics["loss"]) and ref_metrics["loss_weight"] > 0
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["grad_norm"], ref_metrics["grad_norm"], rtol=1e-5)
    assert ref_metrics["grad_norm"] > 0
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads),
                            jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, err_msg=jax.tree_util.keystr(path))


def test_reordered_rows_change_the_loss_without_the_order():
    """The check above can fail: the same reordered rows given to the unsharded step (whose
    model assumes the natural order) as if natural (their recorded order dropped: with it,
    `global_batch` would put them back) give different gradients, far beyond the tolerance."""
    batch = _batch("plain")
    _, base = _step("topr", SINGLE, batch)
    _, shuffled = _step("topr", SINGLE, reorder_batch(batch, 4).replace(context_order=1))
    gap = max(float(np.abs(a - b).max())
              for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(shuffled), strict=True))
    assert gap > 1e-3


def test_score_pass_mu_equals_unsharded():
    rows = [record_row(r) for r in _records(7, B, 20)]
    batch = collate(rows, B, (24,))  # 24 tokens: the scorer pads to 32 = a multiple of 2 × 4
    arrays = (batch.inputs, batch.targets, batch.positions, batch.segment_ids)
    config = _config("topr", CONTEXT)
    single = make_scorer(_model(), temperature=0.7, chunk_size=24,
                         mesh=make_mesh(_config("topr", SINGLE).mesh, jax.devices()[:1]))
    split = make_scorer(_model(), temperature=0.7, chunk_size=24,
                        mesh=make_mesh(config.mesh, jax.devices()))
    mu_1, ref_1 = single(*arrays)
    mu_c, ref_c = split(*arrays)
    assert mu_c.shape == mu_1.shape == (B, 24)
    real = np.asarray(batch.segment_ids) > 0
    np.testing.assert_allclose(mu_c[real], mu_1[real], atol=1e-5)
    np.testing.assert_allclose(ref_c[real], ref_1[real], atol=1e-5)


@pytest.mark.parametrize("overrides, message", [
    ({"mesh": {"context": 4}, "train": {"max_seq_len": 100}},
     r"2 × 4 = 8 load-balanced chunks, which do not divide train.max_seq_len=100"),
    ({"mesh": {"context": 2}, "train": {"max_seq_len": 64}, "data": {"buckets": [30, 64]}},
     r"do not divide data.buckets=30"),
    ({"mesh": {"context": 2}, "model": {"attention": "cudnn"}},
     r"model.attention=cudnn cannot run context parallelism"),
    ({"mesh": {"context": 2}, "loss": {"name": "m2po"}},
     r"loss.name=m2po cannot train with mesh.context=2"),
])
def test_bad_context_setups_are_refused_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(overrides)


def test_splash_with_query_shards_equals_jnp_attention():
    """Splash (Pallas interpret mode here) in its context-parallel shard_map: each device's
    two load-balanced query chunks against the gathered keys, on packed and padded rows; the
    outputs and the gradients of q, k, v equal the jnp path's on the original order."""
    b, t, d = 2, 512, 8  # 512 / 4 shards = one 128-token block of queries per device
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(b, t, h, d)).astype(np.float32) for h in (2, 1, 1))
    seg = np.ones((b, t), np.int32)
    seg[0, 300:], seg[1, 400:] = 2, 0  # a second record in row 0; padding in row 1
    weight = rng.normal(size=(b, t, 2, d)).astype(np.float32) * (seg > 0)[..., None, None]
    mesh = make_mesh(config_from_dict({"mesh": CONTEXT, "train": {"max_seq_len": t}}).mesh)
    order = load_balance_order(t, 4)

    def reference(q, k, v):
        out = self_attention(q, k, v, jnp.asarray(seg), scale=0.3, implementation="jnp")
        return jnp.sum(out * weight), out

    def split(q, k, v, s, w):
        with attention_mesh(mesh):
            out = self_attention(q, k, v, s, scale=0.3, implementation="splash", order=order)
        return jnp.sum(out * w), out

    (_, out_ref), grads_ref = jax.value_and_grad(reference, (0, 1, 2), has_aux=True)(q, k, v)
    rows = NamedSharding(mesh, P(("data", "fsdp"), "context"))
    heads = NamedSharding(mesh, P(("data", "fsdp"), "context", None, None))
    args = [jax.device_put(x[:, order], heads if x.ndim == 4 else rows)
            for x in (q, k, v, seg, weight)]
    (_, out), grads = jax.jit(jax.value_and_grad(split, (0, 1, 2), has_aux=True))(*args)
    back = inverse_order(order)
    real = (seg > 0)[..., None, None]
    np.testing.assert_allclose(np.where(real, np.asarray(out)[:, back], 0),
                               np.where(real, out_ref, 0), atol=1e-5)
    for name, g, g_ref in zip("qkv", grads, grads_ref, strict=True):
        np.testing.assert_allclose(np.asarray(g)[:, back], g_ref, atol=1e-5, err_msg=name)


KILLED_CONTEXT_RUN = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from tests.parallel.test_context_parallel import context_config
    from jaxrl_llm.train.trainer import Trainer

    def on_step(step, trainer):
        if step == int(sys.argv[3]) + 1:  # checkpoint N committed, step N+1 trained, not saved
            trainer.checkpointer.wait()
            os.kill(os.getpid(), signal.SIGKILL)

    Trainer(context_config(Path(sys.argv[1]), Path(sys.argv[2])), on_step=on_step,
            progress=False, tensorboard=False).run()
    """
)


def context_config(run_dir: Path, records_dir: Path):
    """test_trainer's tiny run on a context 4 × fsdp 2 mesh (16-token rows: 8 chunks of 2)."""
    config = tiny_config(run_dir, records_dir)
    return config.model_copy(update={"mesh": MeshConfig(data=1, fsdp=2, tensor=1, context=4)})


@pytest.mark.slow  # moved out of the default suite (10 min 27 s on 2026-11-28); CI runs it (13 s)
def test_context_parallel_run_resumes_after_sigkill_bit_identically(tmp_path, records):  # noqa: F811
    straight = Trainer(context_config(tmp_path / "straight", records), progress=False,
                       tensorboard=False)
    result = straight.run()
    straight.close()
    assert result.step == 2 * N
    killed_dir = tmp_path / "killed"
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", KILLED_CONTEXT_RUN, str(killed_dir),
                           str(records), str(N)],
                          env={**os.environ, "PYTHONPATH": f"{root}{os.pathsep}"
                               f"{os.environ.get('PYTHONPATH', '')}"},
                          cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    resumed = Trainer(context_config(killed_dir, records), progress=False, tensorboard=False)
    again = resumed.run()
    resumed.close()
    assert again.step == 2 * N
    for a, b in zip(params_of(result.state), params_of(again.state), strict=True):
        np.testing.assert_array_equal(a, b)


def test_plan_reports_the_context_split_and_splits_the_state_over_it():
    """`plan` on 8 fake CPU devices, fsdp 2 × context 4: the state is 1/8 per device (split
    over both axes), and the K/V traffic is the analytic all-gather + reduce-scatter bytes."""
    from jaxrl_llm.plan import make_plan

    from .test_plan import ARCH, expected_state_bytes, tree

    config = config_from_dict(tree(CONTEXT, {"platform": "cpu", "num_devices": 8}))
    report = make_plan(config)
    assert report.mesh == {"data": 1, "fsdp": 2, "context": 4, "tensor": 1}
    assert report.state_bytes_per_device == pytest.approx(expected_state_bytes(8), abs=64)
    split = report.context
    assert split.shards == 4 and split.tokens_per_chip == 8 // 2 * 16 // 4
    # per device: 4 rows × 16 tokens × 2 KV heads × 16 dims × (K, V), 3/4 of it received, in
    # 2 layers × 2 passes (forward; backward's reduce-scatter; no remat), float32
    assert split.collective_bytes == 4 * 16 * ARCH["num_kv_heads"] * ARCH["head_dim"] * 2 \
        * 3 / 4 * 2 * 2 * 4
    assert split.collective_seconds is None  # no ICI figure for CPU devices


@pytest.mark.skipif(not libtpu_available(), reason="needs the `tpu` extra (PyPI libtpu)")
def test_plan_refuses_a_row_too_long_for_a_chip_before_compiling(monkeypatch):
    """Llama-3-8B at 65,536 tokens, one row per v5e chip: its 32 layer inputs alone are
    32 × 65,536 × 4,096 × 2 bytes = 16 GiB > 16 GiB, so `plan` refuses without compiling
    (the step is never built) and names mesh.context; with mesh.context=4 it passes the check."""
    from jaxrl_llm import plan as plan_module
    from jaxrl_llm.config import load_config

    def no_compile(*args, **kwargs):
        raise AssertionError("plan compiled a step it should have refused")

    monkeypatch.setattr(plan_module, "make_train_step", no_compile)
    config = load_config(Path(__file__).resolve().parents[2] / "configs"
                         / "topr_gsm8k_llama3_8b_8k_v5e256.yaml",
                         ["train.max_seq_len=65536", "model.max_position_embeddings=65536"])
    with pytest.raises(plan_module.PlanOutOfMemory,
                       match=r"refused before compiling.*16\.00 GiB, over the chip's 16\.00 GiB"
                             r"\. Raise mesh.context"):
        plan_module.make_plan(config)
    split = config.model_copy(update={"mesh": MeshConfig(data=1, fsdp=-1, tensor=1, context=4),
                                      "train": config.train.model_copy(
                                          update={"batch_size": 64, "micro_batch_size": 64})})
    with pytest.raises(AssertionError, match="compiled a step"):  # past the check, to compile
        plan_module.make_plan(split)


def test_policy_score_and_step_on_a_context_mesh_equal_one_device():
    """The public API (`Policy.score`, and `Policy.step`: online's update) on context 4 ×
    fsdp 2: the batch goes in reordered, the log-probs come back in the tokens' order."""
    from jaxrl_llm.api import load_policy

    tree = {"model": {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
                      "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "attention": "jnp"},
            "loss": {"name": "topr"},
            "optim": {"name": "sgd", "learning_rate": 1.0, "clip_norm": None},
            "train": {"batch_size": B, "max_seq_len": T}}
    recs = _records(11, B, 30)
    results = []
    for sizes in (SINGLE, CONTEXT):
        config = config_from_dict({**tree, "mesh": sizes})
        devices = jax.devices()[:int(np.prod(list(sizes.values())))]
        policy = load_policy(config=config, mesh=make_mesh(config.mesh, devices))
        before = policy.score(recs)
        metrics = policy.step(recs)
        results.append((before, metrics["loss"], policy.score(recs)))
    (one_before, one_loss, one_after), (cp_before, cp_loss, cp_after) = results
    assert [a.shape for a in cp_before] == [(r.completion_ids.size,) for r in recs]
    for a, b in zip(one_before + one_after, cp_before + cp_after, strict=True):
        np.testing.assert_allclose(b, a, atol=1e-5)
    np.testing.assert_allclose(cp_loss, one_loss, rtol=1e-5)
    assert np.abs(one_after[0] - one_before[0]).max() > 1e-3  # the step changed the policy
