"""Mixture-of-experts decoders against transformers' PyTorch models (the second
implementation): tiny random `Qwen3MoeForCausalLM`, `MixtralForCausalLM` and
`Qwen2MoeForCausalLM` checkpoints saved by transformers load with our `load_pretrained` and
give the same logits (float32, 1e-4) on a right-padded batch, unrolled and scanned with
remat; every layer's top-k experts are the ones transformers' router logits
(`output_router_logits=True`) choose on every real token, and our load-balancing loss is
transformers' `aux_loss`; our export loads back in transformers with the same logits; a
checkpoint whose expert count differs from its config is refused before anything loads.
"""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

torch = pytest.importorskip("torch")

from jaxrl_llm.config import ModelConfig  # noqa: E402
from jaxrl_llm.weights.hf import CheckpointError, load_pretrained, save_pretrained  # noqa: E402
from jaxrl_llm.weights.loading import load_model  # noqa: E402

from .tiny_hf import build_checkpoints, hf_logits, moe_hf_configs, padded_batch  # noqa: E402

ATOL = 1e-4
CONFIGS = moe_hf_configs()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (torch model, saved directory), built once for the module."""
    return build_checkpoints(CONFIGS, tmp_path_factory)


def _hf_router_choices(torch_model, tokens, mask, k):
    """Per layer [B, T, k]: transformers' top-k of the softmax of its router logits."""
    with torch.no_grad():
        out = torch_model(torch.tensor(tokens), attention_mask=torch.tensor(mask),
                          output_router_logits=True)
    choices = [torch.topk(torch.softmax(logits.float(), -1), k, -1).indices.numpy()
               .reshape(*tokens.shape, k) for logits in out.router_logits]
    return np.stack(choices), float(out.aux_loss)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned_remat"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_router_choices_match_transformers(checkpoints, name, scan):
    torch_model, path = checkpoints[name]
    tokens, mask = padded_batch()
    ref = hf_logits(torch_model, tokens, mask)
    model = load_pretrained(path, **({"scan_layers": True, "remat": "full"} if scan else {}))
    k = model.config.num_experts_per_tok
    hidden, aux = model(jnp.asarray(tokens), segment_ids=jnp.asarray(mask), return_moe=True)
    ours = np.asarray(model.logits(hidden))
    real = mask.astype(bool)
    assert np.abs(ref[real]).max() > 0.5  # logits are not trivially small
    np.testing.assert_allclose(ours[real], ref[real], atol=ATOL, rtol=0)
    hf_choices, hf_aux = _hf_router_choices(torch_model, tokens, mask, k)
    routing = np.asarray(aux.routing)
    assert routing.shape == (2, *tokens.shape, k)
    # Same experts in the same (descending probability) order, every layer, every real token;
    # and the tokens spread over most experts (not one choice for everything).
    np.testing.assert_array_equal(routing[:, real], hf_choices[:, real])
    assert len(np.unique(routing[:, real])) > model.config.num_experts // 2
    np.testing.assert_allclose(float(aux.aux_loss), hf_aux, rtol=1e-5)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_export_loads_in_transformers_with_the_same_logits(checkpoints, tmp_path, name):
    import transformers as tf

    torch_model, path = checkpoints[name]
    out = save_pretrained(load_pretrained(path, scan_layers=True), tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [CONFIGS[name].architectures[0]]
    reloaded = tf.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager")
    assert type(reloaded).__name__ == type(torch_model).__name__
    tokens, mask = padded_batch()
    real = mask.astype(bool)
    np.testing.assert_allclose(hf_logits(reloaded.eval(), tokens, mask)[real],
                               hf_logits(torch_model, tokens, mask)[real], atol=1e-6, rtol=0)
    # the same tensors, bit for bit, under the same names
    ours = safetensors.numpy.load_file(str(out / "model.safetensors"))
    theirs = safetensors.numpy.load_file(str(path / "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)


@pytest.mark.parametrize("name, drop", [("qwen3_moe", "mlp.experts.7."),
                                        ("mixtral", "block_sparse_moe.experts.3.")])
def test_checkpoint_with_other_expert_count_is_refused_before_loading(checkpoints, tmp_path,
                                                                      name, drop):
    """The weights hold one expert fewer per layer than config.json says."""
    _, path = checkpoints[name]
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    tensors = safetensors.numpy.load_file(str(bad / "model.safetensors"))
    kept = {k: v for k, v in tensors.items() if drop not in k}
    safetensors.numpy.save_file(kept, str(bad / "model.safetensors"))
    experts = CONFIGS[name].num_local_experts
    key = "num_local_experts" if name == "mixtral" else "num_experts"
    with pytest.raises(CheckpointError, match=rf"{bad}: the checkpoint holds {experts - 1} "
                       rf"experts in layer 0 but its config says {key}={experts}"):
        load_pretrained(bad)


def test_config_with_top_k_above_the_expert_count_is_refused(checkpoints, tmp_path):
    _, path = checkpoints["mixtral"]
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    config = json.loads((bad / "config.json").read_text())
    config["num_experts_per_tok"] = 5
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"{bad}/config.json: num_experts_per_tok=5 \(top-k\) "
                       "must be between 1 and num_experts=4"):
        load_pretrained(bad)


def test_hub_id_of_a_moe_family_loads_offline(checkpoints, tmp_path, monkeypatch):
    """`model.path: org/name` of a Qwen3-MoE snapshot in the HF cache, as for dense models."""
    torch_model, path = checkpoints["qwen3_moe"]
    repo = tmp_path / "hub" / "models--Qwen--Qwen3-tiny-A1B"
    shutil.copytree(path, repo / "snapshots" / ("c" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("c" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = ModelConfig(source="hf", path="Qwen/Qwen3-tiny-A1B", param_dtype="float32",
                         compute_dtype="float32")
    model = load_model(config).model
    assert model.config.family == "qwen3_moe" and model.config.num_experts == 8
    tokens, mask = padded_batch()
    real = mask.astype(bool)
    ours = np.asarray(model.logits(model(jnp.asarray(tokens), segment_ids=jnp.asarray(mask))))
    np.testing.assert_allclose(ours[real], hf_logits(torch_model, tokens, mask)[real],
                               atol=ATOL, rtol=0)
