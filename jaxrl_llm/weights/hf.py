"""Hugging Face checkpoints in and out: `config.json` + safetensors <-> `Decoder`.

One mapping table per family (`hf_layout.tensor_rules`) drives both directions: each
`TensorRule` names the HF tensor, our parameter path and the layout change between them (a
`Layout`, which knows both the forward and the inverse reshape/transpose). With a mesh, each
parameter is built shard by shard from safetensors slices straight into its `NamedSharding`
(`model_from_state_dict(mesh=...)`). Loading validates everything — the
architecture, every tensor name (missing and unexpected), every shape — before a model is
built, so a bad checkpoint never yields a half-loaded model. Export (`hf_export.py`, re-exported here) writes safetensors shards
(+ index), `config.json`, `generation_config.json` and tokenizer files that
`transformers.AutoModelForCausalLM.from_pretrained` and vLLM read. Weights are only ever read and written as safetensors.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.numpy
from flax import nnx

from jaxrl_llm.models.config import PARAM_DTYPES, DecoderConfig, UnsupportedConfigError, dtype_name
from jaxrl_llm.models.decoder import Decoder
from jaxrl_llm.parallel.rules import DEFAULT_PARAM_RULES, logical_to_mesh_spec
from jaxrl_llm.weights.hf_export import save_pretrained, state_dict  # the export side, re-exported
from jaxrl_llm.weights.hf_layout import (
    Index,
    Layout,
    TensorRule,
    expand_rules,
    expert_counts,
    normalise_index,
    tensor_rules,
)
from jaxrl_llm.weights.hf_params import (
    _NP_DTYPES,
    EXPORT_DTYPES,
    SAFE_INDEX,
    SAFE_SINGLE,
    TOKENIZER_FILES,  # noqa: F401 (re-exported)
    CheckpointError,
    _param_variables,
    _per_layer_shapes,
    our_params,
)

# Non-parameter buffers some exporters include; they carry no learned state.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_FLOAT_KINDS = ("float32", "bfloat16", "float16", "float64")


Placer = Callable[[np.ndarray, tuple[str, ...]], jax.Array]
# (our flat per-layer path, normalised index into its per-layer shape) -> that slice, on host
SliceReader = Callable[[str, Index], np.ndarray]
# (logical axes, shape) -> where the parameter lives
ShardingFn = Callable[[tuple[str | None, ...], tuple[int, ...]], jax.sharding.Sharding]


def _stacked_slice(read: SliceReader, path: str, index: Index, scanned: bool) -> np.ndarray:
    """Slice `index` of our (possibly layer-stacked) parameter `path`."""
    if scanned and path.startswith("layers."):
        rest = path[len("layers."):]
        layers, inner = index[0], index[1:]
        return np.stack([read(f"layers.{i}.{rest}", inner)
                         for i in range(layers.start, layers.stop)])
    return read(path, index)


def _assign_params(model: Decoder, read: SliceReader, place: Placer | None = None,
                   sharding: ShardingFn | None = None) -> None:
    """Set every parameter of (an abstract) `model` from `read(flat per-layer path, index)`.

    sharding(logical_axes, shape): each parameter is built shard by shard with
    `jax.make_array_from_callback`, so a device only ever receives its own slice and the host
    reads only the slices its devices hold. Else `place(array, logical_axes)` puts each whole
    (stacked) array on devices; default: `jnp.asarray` (the default device).
    """
    scanned = model.config.scan_layers
    for path, var in _param_variables(model).items():
        shape, dtype = tuple(var.shape), var.dtype
        axes = tuple(var.get_metadata()["out_sharding"])
        cache: dict[tuple[tuple[int, int], ...], np.ndarray] = {}

        def host(index: Index | None, path: str = path, shape: tuple[int, ...] = shape,
                 dtype: Any = dtype, cache: dict = cache) -> np.ndarray:
            index = normalise_index(index, shape)
            key = tuple((sl.start, sl.stop) for sl in index)
            if key not in cache:  # replicas of one shard (e.g. over "data") read it once
                value = _stacked_slice(read, path, index, scanned).astype(dtype)
                want = tuple(sl.stop - sl.start for sl in index)
                if value.shape != want:
                    raise CheckpointError(f"internal: {path}{list(key)} has shape "
                                          f"{value.shape}, want {want}")
                cache[key] = value
            return cache[key]

        if sharding is not None:
            value = jax.make_array_from_callback(shape, sharding(axes, shape), host, dtype=dtype)
        elif place is not None:
            value = place(host(None), axes)
        else:
            value = jnp.asarray(host(None))
        var.set_value(value)


def mesh_sharding(mesh: jax.sharding.Mesh, rules: Mapping[str, Any] | None = None) -> ShardingFn:
    """The `NamedSharding` of each parameter on `mesh` by the logical-axis `rules`
    (default: the trainer's, `parallel.rules.DEFAULT_PARAM_RULES`)."""
    table = DEFAULT_PARAM_RULES if rules is None else rules

    def sharding(axes: tuple[str | None, ...], shape: tuple[int, ...]) -> jax.sharding.Sharding:
        return jax.sharding.NamedSharding(mesh, logical_to_mesh_spec(axes, shape, mesh, table))

    return sharding


# ---- import --------------------------------------------------------------------------------


class _LazySafetensors(Mapping[str, np.ndarray]):
    """Tensor name -> array, read on access from (possibly sharded) safetensors files."""

    def __init__(self, files: dict[str, Path]):
        self.files = files  # tensor name -> file
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, str] = {}
        for path in sorted(set(files.values())):
            with safetensors.safe_open(str(path), framework="numpy") as f:
                for name in f.keys():
                    if files.get(name) == path:
                        sl = f.get_slice(name)
                        self._shapes[name] = tuple(sl.get_shape())
                        self._dtypes[name] = sl.get_dtype()

    def __getitem__(self, name: str) -> np.ndarray:
        with safetensors.safe_open(str(self.files[name]), framework="numpy") as f:
            return f.get_tensor(name)

    def read_slice(self, name: str, index: Index) -> np.ndarray:
        """Only `index` of tensor `name` (safetensors reads just those bytes)."""
        with safetensors.safe_open(str(self.files[name]), framework="numpy") as f:
            return f.get_slice(name)[index]

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)

    def shape_of(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def dtype_of(self, name: str) -> str:
        return {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}.get(
            self._dtypes[name], self._dtypes[name])

    def where(self, name: str) -> str:
        return str(self.files[name])


def _shape(tensors: Mapping[str, Any], name: str) -> tuple[int, ...]:
    if isinstance(tensors, _LazySafetensors):
        return tensors.shape_of(name)
    return tuple(np.shape(tensors[name]))


def _dtype(tensors: Mapping[str, Any], name: str) -> str:
    if isinstance(tensors, _LazySafetensors):
        return tensors.dtype_of(name)
    return np.asarray(tensors[name]).dtype.name


def _where(tensors: Mapping[str, Any], name: str, source: str) -> str:
    if isinstance(tensors, _LazySafetensors) and name in tensors.files:
        return tensors.where(name)
    return source


def _checkpoint_dtype(tensors: Mapping[str, Any], names: list[str]) -> str:
    """bfloat16 if every tensor is bf16, else float32 (float16 is upcast exactly)."""
    kinds = {_dtype(tensors, n) for n in names}
    return "bfloat16" if kinds == {"bfloat16"} else "float32"


def _read_slice(tensors: Mapping[str, Any], name: str, index: Index) -> np.ndarray:
    if isinstance(tensors, _LazySafetensors):
        return tensors.read_slice(name, index)
    return np.asarray(tensors[name])[index]


def _check_tensors(tensors: Mapping[str, Any], rules: list[tuple[str, str, Layout]],
                   shapes: dict[str, tuple[int, ...]], tied: bool, source: str) -> None:
    """Every tensor is float and has the shape the config implies (names tensor and file)."""
    for hf_name, ours, layout in rules:
        where = _where(tensors, hf_name, source)
        kind = _dtype(tensors, hf_name)
        if kind not in _FLOAT_KINDS:
            raise CheckpointError(f"{where}: tensor {hf_name} has non-float dtype {kind}")
        want = layout.hf_shape(shapes[ours])
        got = _shape(tensors, hf_name)
        if got != want:
            raise CheckpointError(f"{where}: tensor {hf_name} has shape {list(got)}, "
                                  f"config.json implies {list(want)}")
    if tied and "lm_head.weight" in tensors:
        if _shape(tensors, "lm_head.weight") != _shape(tensors, "model.embed_tokens.weight") or \
                not np.array_equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]):
            raise CheckpointError(f"{_where(tensors, 'lm_head.weight', source)}: "
                                  "tie_word_embeddings is true but lm_head.weight differs from "
                                  "model.embed_tokens.weight")


def model_from_state_dict(
    hf_config: Mapping[str, Any],
    tensors: Mapping[str, np.ndarray],
    *,
    dtype: Any = None,
    source: str = "state dict",
    place: Placer | None = None,
    mesh: jax.sharding.Mesh | None = None,
    rules: Mapping[str, Any] | None = None,
    **overrides: Any,
) -> Decoder:
    """Build a `Decoder` from a HF config dict and HF-named tensors ([out, in] linears).

    dtype: parameter dtype ("float32" / "bfloat16" or jnp.float32 / jnp.bfloat16); None keeps
    the checkpoint's (bf16 stays bf16, anything else becomes float32). `overrides` set
    `DecoderConfig` fields (e.g. compute_dtype, remat, scan_layers).
    mesh (+ rules, default the trainer's): every parameter goes straight into its
    `NamedSharding`, each device receiving only its shard and the host reading only the
    slices of its own devices (multi-host ready); no device ever holds the whole model.
    place(array, logical_axes) -> jax.Array: a custom placement of each whole parameter
    instead. Neither: the default device.
    Raises `UnsupportedConfigError` / `CheckpointError` naming the field or tensor (and
    `source`) before anything is built.
    """
    if mesh is not None and place is not None:
        raise ValueError("model_from_state_dict: pass mesh or place, not both")
    if dtype is not None:
        dtype = dtype_name(dtype, field="dtype", choices=PARAM_DTYPES)
    probe = DecoderConfig.from_hf(hf_config, source=source, **overrides)
    _check_expert_count(tensors, probe, source)
    rules_ = list(expand_rules(tensor_rules(probe), probe.num_layers))
    expected = {hf for hf, _, _ in rules_}
    missing = sorted(expected - set(tensors))
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        searched = (f" (not in {sorted({p.name for p in tensors.files.values()})})"
                    if isinstance(tensors, _LazySafetensors) else "")
        raise CheckpointError(f"{source}: missing tensor(s) {missing[:5]}{more}{searched}")
    unexpected = sorted(
        n for n in set(tensors) - expected
        if not n.endswith(_IGNORED_SUFFIXES) and not (n == "lm_head.weight"
                                                      and probe.tie_embeddings)
    )
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        where = _where(tensors, unexpected[0], source)
        raise CheckpointError(f"{where}: unexpected tensor(s) {unexpected[:5]}{more} for "
                              f"model_type={probe.family!r} with this config")
    if dtype is None:
        dtype = _checkpoint_dtype(tensors, sorted(expected))
    config = probe.replace(param_dtype=dtype)
    abstract = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    shapes = _per_layer_shapes(abstract)
    _check_tensors(tensors, rules_, shapes, probe.tie_embeddings, source)
    np_dtype = _NP_DTYPES[dtype]
    by_ours: dict[str, list[tuple[str, Layout]]] = {}
    for hf_name, ours, layout in rules_:  # experts: one HF tensor per expert, in order
        by_ours.setdefault(ours, []).append((hf_name, layout))

    def read(ours: str, index: Index) -> np.ndarray:
        # One tensor (slice) at a time, so host memory holds ~one parameter extra.
        sources = by_ours[ours]
        if sources[0][1].expert is None:
            hf_name, layout = sources[0]
            value = layout.read_ours(lambda i: _read_slice(tensors, hf_name, i), shapes[ours],
                                     index)
        else:  # stacked experts [E, ...]: the experts of index[0], each its own HF tensor
            value = np.stack([
                layout.read_ours(lambda i, name=hf_name: _read_slice(tensors, name, i),
                                 shapes[ours][1:], index[1:])
                for hf_name, layout in sources[index[0].start:index[0].stop]])
        return np.ascontiguousarray(value).astype(np_dtype)

    sharding = None if mesh is None else mesh_sharding(mesh, rules)
    _assign_params(abstract, read, place, sharding)
    return abstract


def _check_expert_count(tensors: Mapping[str, Any], config: DecoderConfig, source: str) -> None:
    """A `CheckpointError` when a MoE checkpoint's experts per layer differ from its config's
    `num_experts` (before the missing/unexpected tensor lists, which would bury it)."""
    counts = expert_counts(tensors, config)
    wrong = {layer: n for layer, n in counts.items() if n != config.num_experts}
    if wrong:
        layer, n = next(iter(wrong.items()))
        key = "num_local_experts" if config.family == "mixtral" else "num_experts"
        raise CheckpointError(
            f"{source}: the checkpoint holds {n} experts in layer {layer} but its config says "
            f"{key}={config.num_experts}: the weights and config.json are of different models")


def _safetensors_files(hf_dir: Path) -> dict[str, Path]:
    index = hf_dir / SAFE_INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise CheckpointError(f"{index}: not a safetensors index ({err})") from err
        files = {name: hf_dir / file for name, file in weight_map.items()}
        for path in set(files.values()):
            if not path.exists():
                raise CheckpointError(f"{index}: lists shard {path.name}, which does not exist")
        return files
    single = hf_dir / SAFE_SINGLE
    candidates = [single] if single.exists() else sorted(hf_dir.glob("*.safetensors"))
    if not candidates:
        found = sorted(p.name for p in hf_dir.iterdir())
        raise CheckpointError(f"{hf_dir}: no *.safetensors weights (found {found}); "
                              "PyTorch .bin checkpoints are not read (convert to safetensors)")
    files: dict[str, Path] = {}
    for path in candidates:
        with safetensors.safe_open(str(path), framework="numpy") as f:
            for name in f.keys():
                if name in files:
                    raise CheckpointError(f"{path}: tensor {name} also in {files[name]}")
                files[name] = path
    return files


def read_hf_config(hf_dir: str | Path) -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not path.exists():
        raise CheckpointError(f"{hf_dir}: no config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: invalid JSON ({err})") from err


def load_pretrained(hf_dir: str | Path, *, dtype: Any = None, place: Placer | None = None,
                    mesh: jax.sharding.Mesh | None = None, rules: Mapping[str, Any] | None = None,
                    **overrides: Any) -> Decoder:
    """A `Decoder` from a local HF directory (`config.json` + safetensors, sharded or not).

    dtype: parameter dtype, None = the checkpoint's own (bf16 stays bf16, else float32).
    mesh / rules / place: see `model_from_state_dict` (with a mesh, each device receives only
    its shard). overrides: `DecoderConfig` fields such as compute_dtype="bfloat16",
    remat="full", scan_layers=True.
    """
    if hf_dir is None:
        raise TypeError("load_pretrained: hf_dir is None; pass a Hugging Face directory "
                        "(config.json + *.safetensors)")
    hf_dir = Path(hf_dir)
    hf_config = read_hf_config(hf_dir)
    DecoderConfig.from_hf(hf_config, source=str(hf_dir / "config.json"), **overrides)
    tensors = _LazySafetensors(_safetensors_files(hf_dir))
    return model_from_state_dict(hf_config, tensors, dtype=dtype, source=str(hf_dir),
                                 place=place, mesh=mesh, rules=rules, **overrides)


__all__ = [
    "EXPORT_DTYPES", "CheckpointError", "Layout", "TensorRule", "UnsupportedConfigError",
    "load_pretrained", "mesh_sharding", "model_from_state_dict",
    "our_params", "read_hf_config", "save_pretrained", "state_dict", "tensor_rules",
]
