"""LoRA training (`model.lora`): a step moves only the adapters (the base stays bit-identical
and sharded as full fine-tuning shards it; only adapters hold optimizer state); the reference
policy of FPA and DPO is the base model (adapters off), without a copy of its weights; and
`jaxrl-llm train` + `jaxrl-llm export` write a merged HF directory and a PEFT adapter that
transformers and `peft` load with our logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm.config import config_from_dict
from jaxrl_llm.losses.logprobs import token_logprobs
from jaxrl_llm.parallel.distributed import global_batch
from jaxrl_llm.parallel.mesh import make_mesh
from jaxrl_llm.plan import make_plan
from jaxrl_llm.train.forward import forward
from jaxrl_llm.train.state import abstract_train_state, build_model, create_train_state
from jaxrl_llm.train.step import make_loss_and_grad, make_train_step
from jaxrl_llm.weights.lora_export import merge_lora
from tests.parallel.helpers import B, V, make_batch
from tests.xla_flags import ONE_DEVICE

RANK, ALPHA = 4, 8.0
ARCH = {"vocab_size": V, "hidden_size": 32, "intermediate_size": 48, "num_layers": 2,
        "num_heads": 4, "num_kv_heads": 2}


def adapter_count(a: dict = ARCH, rank: int = RANK) -> int:
    """r·(in + out) per targeted projection, all seven targets, every layer."""
    d, f = a["hidden_size"], a["intermediate_size"]
    hd = d // a["num_heads"]
    q, kv = a["num_heads"] * hd, a["num_kv_heads"] * hd
    per_layer = (d + q) + 2 * (d + kv) + (q + d) + 2 * (d + f) + (f + d)
    return rank * per_layer * a["num_layers"]


def lora_config(loss: str = "topr", mesh=(1, 1, 1), lora: bool = True, **sections):
    tree = {
        "seed": 3,
        "model": {**ARCH, **({"lora": {"rank": RANK, "alpha": ALPHA}} if lora else {})},
        "loss": {"name": loss, "logprob_chunk_size": 24},
        "optim": {"name": "adamw", "learning_rate": 1e-2, "weight_decay": 0.0},
        "mesh": dict(zip(("data", "fsdp", "tensor"), mesh)),
        "train": {"batch_size": B},
    }
    for key, value in sections.items():
        tree.setdefault(key, {}).update(value)
    return config_from_dict(tree)


def _flat(tree) -> dict[str, np.ndarray]:
    return {"/".join(map(str, p)): np.asarray(v) for p, v in nnx.to_flat_state(tree)}


def test_a_lora_step_moves_only_the_adapters():
    config = lora_config(mesh=(1, 2, 2))
    mesh = make_mesh(config.mesh, jax.devices()[:4])
    state = create_train_state(config, mesh)
    # Trainable = the adapters only; optimizer state (AdamW μ, ν) only for them.
    params = _flat(state.params)
    assert params and all(k.endswith(("lora_a", "lora_b")) for k in params)
    n_adapters = sum(v.size for v in params.values())
    assert n_adapters == adapter_count()
    opt_sizes = [x.size for x in jax.tree.leaves(state.opt_state)]
    assert sum(s for s in opt_sizes if s > 1) == 2 * n_adapters
    # The frozen base is sharded exactly as full fine-tuning shards its params.
    full = abstract_train_state(lora_config(mesh=(1, 2, 2), lora=False), mesh)
    full_specs = {k: v.sharding.spec for k, v in nnx.to_flat_state(full.params)}
    base_specs = {"/".join(map(str, k)): v.sharding.spec
                  for k, v in nnx.to_flat_state(state.model_state)}
    assert base_specs == {"/".join(map(str, k)): s for k, s in full_specs.items()}
    assert base_specs["embed"] != jax.sharding.PartitionSpec()  # really split, not replicated

    base_before = _flat(state.model_state)
    step = make_train_step(config, mesh, state, donate=False)
    new, metrics = step(state, global_batch(make_batch(), mesh))
    new, metrics = step(new, global_batch(make_batch(seed=1), mesh))
    assert float(metrics["update_skipped"]) == 0.0
    for name, value in _flat(new.model_state).items():
        np.testing.assert_array_equal(value, base_before[name], err_msg=name)
    after = _flat(new.params)
    # B starts at 0 and moves first; A moves once B ≠ 0 (∂L/∂A = xᵀ·δ·Bᵀ).
    for name, value in after.items():
        assert np.abs(value - params[name]).max() > 0, name


def _base_logprobs(config, batch) -> np.ndarray:
    """Log-probs of the base model, built without any LoRA (an independent reference)."""
    base = build_model(config.model_copy(update={"model": config.model.model_copy(
        update={"lora": None})}))
    logits = nnx.jit(lambda m, t: m.logits(m(t)))(base, jnp.asarray(batch.inputs))
    logp = jax.nn.log_softmax(logits, axis=-1)
    return np.asarray(jnp.take_along_axis(logp, jnp.asarray(batch.targets)[..., None], -1)[..., 0])


def _nonzero_adapters(state, seed: int = 7):
    leaves, treedef = jax.tree.flatten(state.params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return state.replace(params=jax.tree.unflatten(
        treedef, [0.3 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]))


@pytest.mark.slow  # 7–10 s; the default run keeps a LoRA step and DPO-with-LoRA
def test_fpa_reference_is_the_base_model_with_adapters_off():
    config = lora_config("fpa")
    mesh = make_mesh(config.mesh, jax.devices()[:1])
    state = _nonzero_adapters(create_train_state(config, mesh))
    # No copy of the weights: the reference holds adapter-shaped zeros only.
    ref = jax.tree.leaves(state.ref_params)
    assert sum(x.size for x in ref) == adapter_count()
    assert all(float(jnp.abs(x).max()) == 0 for x in ref)
    batch = make_batch()

    @jax.jit
    def logprobs(params):
        hidden, unembed, _ = forward(state.graphdef, params, state.model_state,
                                     batch.inputs, batch.positions, batch.segment_ids)
        return token_logprobs(hidden, unembed, jnp.asarray(batch.targets), chunk_size=24)

    base = _base_logprobs(config, batch)
    np.testing.assert_allclose(np.asarray(logprobs(state.ref_params)), base, atol=2e-6)
    policy = np.asarray(logprobs(state.model_params()))
    assert np.abs(policy - base).max() > 1e-2  # the policy itself has moved off the base


@pytest.mark.slow  # 7–10 s; the default run keeps a LoRA step and DPO-with-LoRA
def test_score_pass_of_a_lora_policy_writes_the_base_as_reference():
    """The score pass (iterate scores π_{i−1}, a LoRA policy after the first iteration): μ
    from the policy with its adapters, π_ref from the base."""
    from jaxrl_llm.train.score import make_scorer

    config = lora_config("fpa")
    mesh = make_mesh(config.mesh, jax.devices()[:1])
    state = _nonzero_adapters(create_train_state(config, mesh))
    batch = make_batch()
    scorer = make_scorer(state.model(), temperature=1.0, chunk_size=24, mesh=mesh)
    mu, ref = scorer(batch.inputs, batch.targets, batch.positions, batch.segment_ids)
    np.testing.assert_allclose(ref, _base_logprobs(config, batch), atol=2e-6)
    policy = make_scorer(merge_lora(state.model()), temperature=1.0, chunk_size=24, mesh=mesh)
    np.testing.assert_allclose(mu, policy(batch.inputs, batch.targets, batch.positions,
                                          batch.segment_ids)[0], atol=2e-5)
    assert np.abs(mu - ref).max() > 1e-2


@pytest.mark.slow  # ~11 s: the default suite's 10-minute budget
def test_dpo_with_lora_uses_the_base_as_reference():
    """The step's DPO loss with `ref_logprobs: model` (π_ref = adapters off) equals the loss
    with the base model's log-probs given in the batch."""
    batch = make_batch().replace(pair_index=np.array([[0, 1], [2, 3], [4, 5], [6, 7]],
                                                     np.int32))
    model_ref = lora_config("dpo", train={"ref_logprobs": "model"})
    mesh = make_mesh(model_ref.mesh, jax.devices()[:1])
    state = _nonzero_adapters(create_train_state(model_ref, mesh))
    given = batch.replace(ref_logprobs=_base_logprobs(model_ref, batch) * batch.loss_mask)
    batch_ref = lora_config("dpo")  # ref_logprobs: batch

    def loss(config, b) -> float:
        fn = make_loss_and_grad(config, mesh, state)
        _, total, weight, _, _ = jax.jit(fn)(state.params, state, global_batch(b, mesh))
        return float(total / weight)

    ours = loss(model_ref, batch)
    assert ours == pytest.approx(loss(batch_ref, given), abs=1e-5)
    # Were the reference the policy itself, every pair's margin would be 0: loss log 2.
    assert abs(ours - np.log(2.0)) > 1e-3


@pytest.mark.slow  # 7–10 s; the default run keeps a LoRA step and DPO-with-LoRA
def test_plan_counts_adapters_as_trainable_and_the_base_as_frozen():
    full = make_plan(lora_config(mesh=(1, 8, 1), lora=False,
                                 plan={"platform": "cpu", "num_devices": 8}))
    lora = make_plan(lora_config(mesh=(1, 8, 1), plan={"platform": "cpu", "num_devices": 8}))
    assert lora.num_params == adapter_count()
    assert lora.frozen_params == full.num_params
    assert (lora.lora["rank"], lora.lora["alpha"]) == (RANK, ALPHA)
    trainable = lambda r: r.section_bytes["params"] + r.section_bytes["opt_state"]
    # fp32 master + AdamW μ, ν: 12 bytes per adapter weight, every factor split 8 ways over
    # fsdp (none replicated), plus AdamW's step counter.
    assert trainable(lora) == pytest.approx(12 * adapter_count() / 8, abs=16)
    assert trainable(lora) < trainable(full)
    # The frozen base (fp32 here) takes exactly the bytes full fine-tuning's params take.
    assert lora.section_bytes["model_state"] == full.section_bytes["params"]
    assert "ref_params" not in lora.section_bytes  # TOPR needs no reference
    assert lora.model_flops_6nd == pytest.approx(
        6 * (full.num_params + adapter_count()) * B * lora.batch["seq_len"], rel=1e-9)


# ---- the command line: train, then export -------------------------------------------------

CLI_YAML = """\
name: lora_cli
run_dir: runs/lora
seed: 0
model:
  source: hf
  path: base
  lora: {rank: 4, alpha: 8, targets: [q_proj, v_proj, o_proj, down_proj]}
loss: {name: topr}
optim: {name: adamw, learning_rate: 0.05}
mesh: {data: 1}
data: {records: recs, tokenizer: char}
train: {steps: 3, batch_size: 4, max_seq_len: 8, log_every: 1}
"""


def _jaxrl(cwd: Path, *args: str) -> None:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = ONE_DEVICE
    exe = Path(sys.executable).with_name("jaxrl-llm")
    proc = subprocess.run([str(exe), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"{args}: {proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


@pytest.mark.slow
def test_train_and_export_through_the_cli_with_lora(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    import safetensors.numpy
    from transformers import AutoModelForCausalLM

    from jaxrl_llm.data.records import Record
    from jaxrl_llm.data.shards import write_records
    from jaxrl_llm.train.checkpoint import restore_model
    from tests.models.tiny_hf import hf_configs, make_hf_model

    make_hf_model(hf_configs()["llama3_tied"], seed=1).save_pretrained(tmp_path / "base")
    rng = np.random.default_rng(0)
    write_records(tmp_path / "recs", [
        Record(prompt_ids=np.array([5, 6 + i]), completion_ids=rng.integers(3, 200, size=5),
               reward=1.0 if i % 2 else -1.0, correct=bool(i % 2), group_id=i,
               mu_logprobs=np.full(5, -5.0, np.float32))
        for i in range(8)], vocab_size=256)
    (tmp_path / "lora.yaml").write_text(CLI_YAML)
    _jaxrl(tmp_path, "train", "--config", "lora.yaml", "--no-progress")
    _jaxrl(tmp_path, "export", "--checkpoint", "runs/lora", "--out", "export")

    out = tmp_path / "export"
    assert not (out / "adapter_config.json").exists()  # transformers must see a plain model
    adapter = safetensors.numpy.load_file(out / "adapter" / "adapter_model.safetensors")
    assert len(adapter) == 2 * 4 * 2  # (A, B) × 4 targets × 2 layers
    assert all(np.abs(v).max() > 0 for k, v in adapter.items() if "lora_B" in k)  # trained
    # every file readable by others like any output (safetensors alone makes it 0600)
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.relative_to(out).as_posix(): oct(p.stat().st_mode & 0o777)
             for p in out.rglob("*") if p.is_file()}
    assert modes["adapter/adapter_model.safetensors"] == oct(0o666 & ~umask), modes
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes

    monkeypatch.chdir(tmp_path)  # the run's config names model.path relative to it
    restored = restore_model("runs/lora").model
    tokens = np.array([[1, 7, 20, 33, 64, 90, 127, 3]], np.int32)
    ours = np.asarray(restored.logits(restored(jnp.asarray(tokens))))
    with torch.no_grad():
        ids = torch.from_numpy(tokens.astype(np.int64))
        merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        np.testing.assert_allclose(merged(ids).logits.numpy(), ours, atol=2e-4, rtol=1e-4)
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
        base_logits = base.eval()(ids).logits.numpy()
        assert np.abs(base_logits - ours).max() > 1e-3  # training moved the policy
        with_adapter = peft.PeftModel.from_pretrained(base, out / "adapter").eval()
        np.testing.assert_allclose(with_adapter(ids).logits.numpy(), ours, atol=2e-4, rtol=1e-4)
    # The checkpoint's frozen base is the HF base, bit for bit (only the adapters trained).
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["peft_type"] == "LORA"
    theirs = safetensors.numpy.load_file(tmp_path / "base" / "model.safetensors")
    # pretrained sources scan their layers by default: layer 0 is the stack's first slice
    q0 = np.asarray(restored.layers.attn.q[...])[0]  # ours [d, H, D] = HF [H·D, d]ᵀ
    np.testing.assert_array_equal(
        q0.reshape(q0.shape[0], -1).T, theirs["model.layers.0.self_attn.q_proj.weight"])
