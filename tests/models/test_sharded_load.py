"""Pod-ready loading through the weights loader, `weights.loading.load_model`.

On 8 fake CPU devices (tests/conftest.py): pretrained weights go straight into their
shardings (each device holds only its shard, the host reads only slices of the sharded
tensors), the values equal the files' tensors (derived here from the HF layouts by hand, and
as logits against transformers), every source honours the `model:` section's numerics, and
every command's loader goes through `load_model`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

pytest.importorskip("torch")

from jaxrl_llm.config import ConfigError, MeshConfig, config_from_dict
from jaxrl_llm.models.config import DecoderConfig, UnsupportedConfigError
from jaxrl_llm.parallel.mesh import make_mesh
from jaxrl_llm.weights import hf as hf_module
from jaxrl_llm.weights import loading

from .tiny_gguf import tiny_llama_config, write_gguf
from .tiny_hf import hf_configs, hf_logits, make_hf_model, padded_batch, save_hf

MESHES = {"fsdp8": (1, 8, 1), "data2_fsdp2_tensor2": (2, 2, 2)}


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    """(transformers model, its HF directory): untied Llama with q/k/v/o biases."""
    model = make_hf_model(hf_configs()["llama_linear_bias"])
    return model, save_hf(model, tmp_path_factory.mktemp("hf") / "llama")


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory):
    model = make_hf_model(tiny_llama_config())
    return model, write_gguf(model, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def _model_config(**model):
    return config_from_dict({"model": model}).model


def _mesh(name: str):
    data, fsdp, tensor = MESHES[name]
    return make_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor))


def _tensors(hf_dir: Path) -> dict[str, np.ndarray]:
    return safetensors.numpy.load_file(str(hf_dir / "model.safetensors"))


def _expected(hf: dict[str, np.ndarray], layer: int, d: int = 64, heads: int = 4,
              kv: int = 2, hd: int = 16) -> dict[str, np.ndarray]:
    """Our parameters of one layer, from HF's [out, in] tensors by the documented layouts."""
    p = f"model.layers.{layer}."
    return {
        "attn.q": hf[p + "self_attn.q_proj.weight"].T.reshape(d, heads, hd),
        "attn.k": hf[p + "self_attn.k_proj.weight"].T.reshape(d, kv, hd),
        "attn.o": hf[p + "self_attn.o_proj.weight"].T.reshape(heads, hd, d),
        "attn.q_bias": hf[p + "self_attn.q_proj.bias"].reshape(heads, hd),
        "mlp.up": hf[p + "mlp.up_proj.weight"].T,
        "mlp.down": hf[p + "mlp.down_proj.weight"].T,
        "attn_norm.scale": hf[p + "input_layernorm.weight"],
    }


def _get(model, path: str) -> jax.Array:
    node = model
    for part in path.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node[...]


def _assert_only_own_shards(array: jax.Array, expected: np.ndarray, mesh) -> None:
    """Every device of `mesh` holds exactly its shard of `expected`, nothing more."""
    assert array.shape == expected.shape
    assert {s.device for s in array.addressable_shards} == set(mesh.devices.flat)
    want = array.sharding.shard_shape(array.shape)
    for shard in array.addressable_shards:
        assert shard.data.shape == want
        np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index])


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_hf_weights_go_straight_into_their_shards(hf_pair, mesh_name, scan, monkeypatch):
    torch_model, hf_dir = hf_pair
    mesh = _mesh(mesh_name)
    reads: list[tuple[str, tuple[int, ...]]] = []
    original = hf_module._LazySafetensors.read_slice

    def spy(self, name, index):
        out = original(self, name, index)
        reads.append((name, out.shape))
        return out

    monkeypatch.setattr(hf_module._LazySafetensors, "read_slice", spy)
    # Nothing may put a whole parameter on one device first.
    monkeypatch.setattr(hf_module.jnp, "asarray", lambda *a, **k: pytest.fail("jnp.asarray"))
    model = loading.load_model(_model_config(source="hf", path=str(hf_dir), scan_layers=scan),
                               mesh=mesh).model
    monkeypatch.undo()

    hf = _tensors(hf_dir)
    fsdp = mesh.shape["fsdp"]
    for layer in range(2):
        for path, want in _expected(hf, layer).items():
            if scan:
                got = _get(model, f"layers.{path}")
                want = np.stack([_expected(hf, i)[path] for i in range(2)])
            else:
                got = _get(model, f"layers.{layer}.{path}")
            _assert_only_own_shards(got, want, mesh)
            if path not in ("attn_norm.scale", "attn.q_bias"):  # matrices: no device has one whole
                assert math.prod(got.sharding.shard_shape(got.shape)) < got.size
    embed = _get(model, "embed")
    _assert_only_own_shards(embed, hf["model.embed_tokens.weight"], mesh)
    # d_model over fsdp: each device holds 1/fsdp of the embedding columns.
    assert embed.addressable_shards[0].data.shape[1] == 64 // fsdp
    # The host read only slices of the split matrices, never a whole one.
    for name, shape in reads:
        if name.endswith("proj.weight") or name == "model.embed_tokens.weight":
            assert math.prod(shape) < math.prod(hf[name].shape), (name, shape)
    # And the sharded model computes what transformers computes from the same file.
    tokens, mask = padded_batch()
    got = np.asarray(model.logits(model(jnp.asarray(tokens), segment_ids=jnp.asarray(mask))))
    want = hf_logits(torch_model, tokens, mask)
    np.testing.assert_allclose(got * mask[..., None], want * mask[..., None], atol=1e-4)


def test_train_state_from_hf_on_8_devices_keeps_every_array_sharded(hf_pair, monkeypatch):
    """create_train_state(source=hf): bf16 weights, fp32 master copy, AdamW moments and the
    frozen reference copy all live as shards; the master weights equal the file's values."""
    from jaxrl_llm.train.state import create_train_state

    _, hf_dir = hf_pair
    config = config_from_dict({
        "model": {"source": "hf", "path": str(hf_dir), "param_dtype": "bfloat16",
                  "scan_layers": False,  # indexed per layer below
                  "compute_dtype": "bfloat16"},
        "loss": {"name": "fpa"}, "mesh": {"data": 1, "fsdp": 8, "tensor": 1},
        "optim": {"name": "adamw", "master_weights_fp32": True}})
    mesh = make_mesh(config.mesh)
    monkeypatch.setattr(hf_module.jnp, "asarray", lambda *a, **k: pytest.fail("jnp.asarray"))
    state = create_train_state(config, mesh)
    monkeypatch.undo()
    up = _tensors(hf_dir)["model.layers.1.mlp.up_proj.weight"].T
    bf16 = up.astype(jnp.bfloat16)
    master = state.params["layers"][1]["mlp"]["up"].get_value()
    assert master.dtype == jnp.float32
    _assert_only_own_shards(master, bf16.astype(np.float32), mesh)
    ref = state.ref_params["layers"][1]["mlp"]["up"].get_value()
    assert ref.dtype == jnp.bfloat16
    _assert_only_own_shards(ref, bf16, mesh)
    for leaf in jax.tree.leaves(state.opt_state):
        if leaf.ndim == 2 and leaf.shape == up.shape:
            assert leaf.addressable_shards[0].data.shape == (64 // 8, 128)
    assert state.param_dtypes[0] == "bfloat16"


@pytest.mark.parametrize("remat", ["none", "full"])
def test_scan_and_remat_are_honoured_for_every_pretrained_source(hf_pair, gguf_pair, remat):
    tokens, mask = padded_batch()
    for (torch_model, path), source in ((hf_pair, "hf"), (gguf_pair, "gguf")):
        want = hf_logits(torch_model, tokens, mask) * mask[..., None]
        for scan in (False, True):
            if remat != "none" and not scan:  # refused by the config (test_memory_defaults.py)
                continue
            cfg = _model_config(source=source, path=str(path), scan_layers=scan, remat=remat)
            model = loading.load_model(cfg, mesh=_mesh("fsdp8")).model
            assert (model.config.scan_layers, model.config.remat) == (scan, remat)
            assert hasattr(model.layers, "attn") == scan  # one stacked Block vs a list
            got = np.asarray(model.logits(model(jnp.asarray(tokens),
                                                segment_ids=jnp.asarray(mask))))
            np.testing.assert_allclose(got * mask[..., None], want, atol=1e-4)
            assert loading.decoder_config(cfg) == model.config  # architecture without weights


def test_gguf_source_is_sharded_and_carries_its_tokenizer(gguf_pair):
    torch_model, path = gguf_pair
    mesh = _mesh("data2_fsdp2_tensor2")
    model, tokenizer = loading.load_model(
        _model_config(source="gguf", path=str(path), param_dtype="bfloat16", scan_layers=False),
        mesh=mesh)
    q = torch_model.state_dict()["model.layers.0.self_attn.q_proj.weight"].numpy()
    want = q.T.reshape(64, 4, 16).astype(jnp.bfloat16)  # llama.cpp's row permutation undone
    _assert_only_own_shards(_get(model, "layers.0.attn.q"), want, mesh)
    assert tokenizer("ab ab")["input_ids"] == [8, 9]
    assert loading.source_tokenizer(_model_config(source="gguf", path=str(path))).vocab_size \
        == tokenizer.vocab_size


def test_random_source_is_initialised_in_place_with_the_same_values():
    cfg = _model_config(source="random", scan_layers=True, param_dtype="bfloat16")
    mesh = _mesh("fsdp8")
    sharded = loading.load_model(cfg, seed=3, mesh=mesh).model
    plain = loading.load_model(cfg, seed=3).model
    up = _get(sharded, "layers.mlp.up")
    assert up.dtype == jnp.bfloat16 and sharded.config.scan_layers
    _assert_only_own_shards(up, np.asarray(_get(plain, "layers.mlp.up")), mesh)


def test_every_command_loads_through_load_model(hf_pair, tmp_path, monkeypatch):
    """train (state), the opener (the config's model: generate, score, iterate; an HF
    directory: evaluate, export) and export/plan (abstract) all call `load_model`, so the
    section's numerics reach each of them."""
    from jaxrl_llm.models.tokenizer import char_tokenizer
    from jaxrl_llm.policy.opener import open_model
    from jaxrl_llm.train.state import abstract_train_state, create_train_state

    _, hf_dir = hf_pair
    calls: list[tuple[str, bool]] = []
    original = loading.load_model

    def spy(model_config, **kwargs):
        calls.append((model_config.source, kwargs.get("weights", True)))
        return original(model_config, **kwargs)

    # the two callers bind the loader at import: the spy goes where each of them reads it
    import jaxrl_llm.policy.opener as opener_module
    import jaxrl_llm.train.state as state_module

    for module in (loading, opener_module, state_module):
        monkeypatch.setattr(module, "load_model", spy)
    config = config_from_dict({"model": {"source": "hf", "path": str(hf_dir),
                                         "scan_layers": True, "compute_dtype": "bfloat16"},
                               "data": {"tokenizer": "char"},
                               "mesh": {"data": 1, "fsdp": 8, "tensor": 1}})
    mesh = make_mesh(config.mesh)
    char_tokenizer().save_pretrained(str(tmp_path / "tok"))  # the tiny checkpoint has none
    models = [create_train_state(config, mesh).model(), open_model(None, config).model,
              open_model(str(hf_dir), config, tokenizer=str(tmp_path / "tok")).model]
    for model in models:
        assert model.config.scan_layers and model.config.compute_dtype == "bfloat16"
    abstract = abstract_train_state(config, mesh)
    assert abstract.params["layers"]["mlp"]["up"].get_value().shape == (2, 64, 128)
    assert calls == [("hf", True)] * 3 + [("hf", False)]


# ---- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_pretrained_source_without_path_names_model_path(source):
    cfg = _model_config(source=source)
    with pytest.raises(ConfigError, match=r"model\.path is not set.*model\.source="):
        loading.load_model(cfg)
    with pytest.raises(ConfigError, match=r"model\.path"):
        loading.decoder_config(cfg)  # plan / export / resume: the abstract model too


def test_dtype_as_a_jax_or_numpy_type_or_string(hf_pair):
    _, hf_dir = hf_pair
    model = hf_module.load_pretrained(hf_dir, dtype=jnp.float32)
    assert model.config.param_dtype == "float32" and model.embed[...].dtype == jnp.float32
    assert hf_module.load_pretrained(hf_dir, dtype=jnp.bfloat16).embed[...].dtype == jnp.bfloat16
    assert hf_module.load_pretrained(hf_dir, dtype=np.dtype("float32")).config.param_dtype \
        == "float32"
    for bad in (np.float16, "fp8", "bf16", object()):
        with pytest.raises(UnsupportedConfigError,
                           match=r"dtype=.* use one of \['float32', 'bfloat16'\]"):
            hf_module.load_pretrained(hf_dir, dtype=bad)
    assert DecoderConfig(param_dtype=jnp.bfloat16, compute_dtype=np.float32).param_dtype \
        == "bfloat16"
    with pytest.raises(UnsupportedConfigError, match=r"compute_dtype=.*float32"):
        DecoderConfig(compute_dtype=jnp.int8)
    # Export also writes float16; other dtypes are refused with the export choices.
    assert hf_module.state_dict(model, dtype=np.float16)["model.norm.weight"].dtype == np.float16
    with pytest.raises(UnsupportedConfigError, match=r"'float16'\]"):
        hf_module.state_dict(model, dtype=jnp.int8)


def _rewrite(hf_dir: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text((hf_dir / "config.json").read_text())
    tensors = _tensors(hf_dir)
    edit(tensors)
    safetensors.numpy.save_file(tensors, str(dst / "model.safetensors"),
                                metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.update({"model.layers.1.self_attn.k_proj.weight":  # stored transposed
                         t["model.layers.1.self_attn.k_proj.weight"].T.copy()}),
     r"model\.safetensors: tensor model\.layers\.1\.self_attn\.k_proj\.weight has shape "
     r"\[64, 32\], config\.json implies \[32, 64\]"),
    (lambda t: t.update({"model.layers.0.mlp.down_proj.weight":
                         t["model.layers.0.mlp.down_proj.weight"][:, :-1].copy()}),
     r"model\.layers\.0\.mlp\.down_proj\.weight has shape \[64, 127\], config\.json implies "
     r"\[64, 128\]"),
    (lambda t: t.update({"model.norm.weight": np.arange(64, dtype=np.int32)}),
     r"tensor model\.norm\.weight has non-float dtype I32"),
    (lambda t: t.pop("model.layers.1.self_attn.v_proj.bias"),
     r"missing tensor\(s\) \['model\.layers\.1\.self_attn\.v_proj\.bias'\]"),
])
def test_bad_tensors_are_named_before_anything_is_placed(hf_pair, tmp_path, edit, message):
    _, hf_dir = hf_pair
    bad = _rewrite(hf_dir, tmp_path / "bad", edit)
    cfg = _model_config(source="hf", path=str(bad))
    with pytest.raises(hf_module.CheckpointError, match=message):
        loading.load_model(cfg, mesh=_mesh("fsdp8"))
    assert json.loads((bad / "config.json").read_text())["num_hidden_layers"] == 2
