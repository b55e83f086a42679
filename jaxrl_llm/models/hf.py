"""Hugging Face checkpoints in and out: `config.json` + safetensors <-> `Decoder`.

One mapping table per family (`tensor_rules`) drives both directions: each `TensorRule` names
the HF tensor, our parameter path and the layout change between them (a `Layout`, which knows
both the forward and the inverse reshape/transpose). Loading validates everything — the
architecture, every tensor name (missing and unexpected), every shape — before a model is
built, so a bad checkpoint never yields a half-loaded model. Export writes safetensors shards
(+ index), `config.json`, `generation_config.json` and tokenizer files that
`transformers.AutoModelForCausalLM.from_pretrained` and vLLM read. Weights are only ever read and written as safetensors.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy
from flax import nnx

from jaxrl_llm.models.config import DecoderConfig, UnsupportedConfigError
from jaxrl_llm.models.decoder import Decoder

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
    "chat_template.json",
)
# Non-parameter buffers some exporters include; they carry no learned state.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


class CheckpointError(ValueError):
    """A Hugging Face checkpoint that does not match what the config says (names the tensor)."""


# ---- layouts: how one HF tensor maps onto one of our parameters ------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """A reversible layout change. `ours` is our shape; HF shapes follow from it.

    copy        same array                     (embeddings, lm_head, norm scales, o bias)
    linear      ours [in, out]      <-> HF [out, in]    (MLP)
    heads_in    ours [d, H, D]      <-> HF [H*D, d]     (q/k/v projections)
    heads_out   ours [H, D, d]      <-> HF [d, H*D]     (o projection)
    heads_bias  ours [H, D]         <-> HF [H*D]        (q/k/v bias)
    """

    kind: str

    def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
        if self.kind == "copy":
            return ours
        if self.kind == "linear":
            return (ours[1], ours[0])
        if self.kind == "heads_in":
            return (ours[1] * ours[2], ours[0])
        if self.kind == "heads_out":
            return (ours[2], ours[0] * ours[1])
        if self.kind == "heads_bias":
            return (ours[0] * ours[1],)
        raise ValueError(f"unknown layout {self.kind!r}")

    def to_ours(self, hf: np.ndarray, ours: tuple[int, ...]) -> np.ndarray:
        if self.kind == "copy":
            return hf
        if self.kind == "linear":
            return hf.T
        if self.kind == "heads_in":
            return hf.T.reshape(ours)
        if self.kind == "heads_out":
            return hf.T.reshape(ours)
        if self.kind == "heads_bias":
            return hf.reshape(ours)
        raise ValueError(f"unknown layout {self.kind!r}")

    def to_hf(self, ours: np.ndarray) -> np.ndarray:
        if self.kind == "copy":
            return ours
        if self.kind in ("linear", "heads_in", "heads_out"):
            return ours.reshape(self.hf_shape(ours.shape)[::-1]).T
        if self.kind == "heads_bias":
            return ours.reshape(-1)
        raise ValueError(f"unknown layout {self.kind!r}")


COPY, LINEAR = Layout("copy"), Layout("linear")
HEADS_IN, HEADS_OUT, HEADS_BIAS = Layout("heads_in"), Layout("heads_out"), Layout("heads_bias")


@dataclasses.dataclass(frozen=True)
class TensorRule:
    """HF name (with `{i}` for the layer index) <-> our parameter path under the layer/root."""

    hf: str
    ours: str
    layout: Layout
    per_layer: bool


def tensor_rules(config: DecoderConfig) -> list[TensorRule]:
    """The mapping table of `config.family` (with its optional tensors per config flags)."""
    layer = "model.layers.{i}."
    rules = [TensorRule("model.embed_tokens.weight", "embed", COPY, False),
             TensorRule("model.norm.weight", "final_norm.scale", COPY, False)]
    if not config.tie_embeddings:
        rules.append(TensorRule("lm_head.weight", "lm_head", COPY, False))
    per_layer = [
        ("self_attn.q_proj.weight", "attn.q", HEADS_IN),
        ("self_attn.k_proj.weight", "attn.k", HEADS_IN),
        ("self_attn.v_proj.weight", "attn.v", HEADS_IN),
        ("self_attn.o_proj.weight", "attn.o", HEADS_OUT),
        ("mlp.gate_proj.weight", "mlp.gate", LINEAR),
        ("mlp.up_proj.weight", "mlp.up", LINEAR),
        ("mlp.down_proj.weight", "mlp.down", LINEAR),
        ("input_layernorm.weight", "attn_norm.scale", COPY),
    ]
    if config.is_gemma:
        per_layer += [
            ("post_attention_layernorm.weight", "post_attn_norm.scale", COPY),
            ("pre_feedforward_layernorm.weight", "mlp_norm.scale", COPY),
            ("post_feedforward_layernorm.weight", "post_mlp_norm.scale", COPY),
        ]
    else:
        # In Llama-style checkpoints "post_attention_layernorm" is the pre-MLP norm.
        per_layer.append(("post_attention_layernorm.weight", "mlp_norm.scale", COPY))
    if config.qkv_bias:
        per_layer += [
            ("self_attn.q_proj.bias", "attn.q_bias", HEADS_BIAS),
            ("self_attn.k_proj.bias", "attn.k_bias", HEADS_BIAS),
            ("self_attn.v_proj.bias", "attn.v_bias", HEADS_BIAS),
        ]
    if config.o_bias:
        per_layer.append(("self_attn.o_proj.bias", "attn.o_bias", COPY))
    if config.qk_norm:
        per_layer += [
            ("self_attn.q_norm.weight", "attn.q_norm.scale", COPY),
            ("self_attn.k_norm.weight", "attn.k_norm.scale", COPY),
        ]
    rules += [TensorRule(layer + hf, ours, layout, True) for hf, ours, layout in per_layer]
    return rules


def _expand(rules: list[TensorRule], num_layers: int) -> Iterator[tuple[str, str, Layout]]:
    """(HF name, our flat path, layout) with layers numbered: "layers.3.attn.q"."""
    for rule in rules:
        if rule.per_layer:
            for i in range(num_layers):
                yield rule.hf.format(i=i), f"layers.{i}.{rule.ours}", rule.layout
        else:
            yield rule.hf, rule.ours, rule.layout


# ---- our parameters as a flat, per-layer dict ------------------------------------------------


def _param_variables(model: Decoder) -> dict[str, nnx.Variable]:
    """Our dotted parameter path (as in the model tree) -> its Variable."""
    out = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param):
            out[".".join(str(p) for p in path)] = node
    return out


def _per_layer_shapes(model: Decoder) -> dict[str, tuple[int, ...]]:
    """Flat per-layer path -> shape, unstacking scanned layer parameters."""
    c: DecoderConfig = model.config
    shapes = {}
    for path, var in _param_variables(model).items():
        shape = tuple(var.shape)
        if c.scan_layers and path.startswith("layers."):
            rest = path[len("layers."):]
            for i in range(c.num_layers):
                shapes[f"layers.{i}.{rest}"] = shape[1:]
        else:
            shapes[path] = shape
    return shapes


def _to_host(value: jax.Array) -> np.ndarray:
    """A (possibly sharded, possibly multi-host) array as one numpy array on this host.

    Arrays spread over several processes are all-gathered, so every process must call this
    (as every process runs the same export code in a multi-controller job)."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(value, tiled=True))
    return np.asarray(jax.device_get(value))


class _ParamReader:
    """Flat per-layer path ("layers.3.attn.q") -> numpy array, fetching one Variable at a
    time from devices (a scanned Variable holds every layer: it is kept until the next one)."""

    def __init__(self, model: Decoder):
        self.scanned = model.config.scan_layers
        self.variables = _param_variables(model)
        self._cached: tuple[str, np.ndarray] | None = None

    def __call__(self, path: str) -> np.ndarray:
        layer = None
        if self.scanned and path.startswith("layers."):
            _, index, rest = path.split(".", 2)
            path, layer = f"layers.{rest}", int(index)
        if self._cached is None or self._cached[0] != path:
            self._cached = (path, _to_host(self.variables[path][...]))
        value = self._cached[1]
        return value if layer is None else value[layer]


def our_params(model: Decoder) -> dict[str, np.ndarray]:
    """Flat per-layer numpy parameters ("layers.{i}.attn.q", ...), unstacking a scan."""
    read = _ParamReader(model)
    return {path: read(path) for path in _per_layer_shapes(model)}


Placer = Callable[[np.ndarray, tuple[str, ...]], jax.Array]


def _assign_params(model: Decoder, read: Callable[[str], np.ndarray],
                   place: Placer | None = None) -> None:
    """Set every parameter of (an abstract) `model` from `read(flat per-layer path)`.

    `place(array, logical_axes)` puts each (stacked) array on devices; default: jnp.asarray.
    """
    c: DecoderConfig = model.config
    for path, var in _param_variables(model).items():
        if c.scan_layers and path.startswith("layers."):
            rest = path[len("layers."):]
            value = np.stack([read(f"layers.{i}.{rest}") for i in range(c.num_layers)])
        else:
            value = read(path)
        if tuple(value.shape) != tuple(var.shape):
            raise CheckpointError(f"internal: {path} has shape {value.shape}, want {var.shape}")
        value = value.astype(var.dtype)
        if place is None:
            var.set_value(jnp.asarray(value))
        else:
            var.set_value(place(value, tuple(var.get_metadata()["out_sharding"])))


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

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)

    def shape_of(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def dtype_of(self, name: str) -> str:
        return {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}.get(
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


def model_from_state_dict(
    hf_config: Mapping[str, Any],
    tensors: Mapping[str, np.ndarray],
    *,
    dtype: str | None = None,
    source: str = "state dict",
    place: Placer | None = None,
    **overrides: Any,
) -> Decoder:
    """Build a `Decoder` from a HF config dict and HF-named tensors ([out, in] linears).

    dtype: parameter dtype ("float32" / "bfloat16"); None keeps the checkpoint's (bf16 stays
    bf16, anything else becomes float32). `overrides` set `DecoderConfig` fields (e.g.
    compute_dtype, remat, scan_layers). `place(array, logical_axes) -> jax.Array` puts each
    parameter on devices as it is converted (e.g. `jax.device_put` with a `NamedSharding`,
    or `jax.make_array_from_callback` on multi-host meshes); default: the default device.
    Raises `UnsupportedConfigError` / `CheckpointError` naming the field or tensor (and
    `source`) before anything is built.
    """
    probe = DecoderConfig.from_hf(hf_config, source=source, **overrides)
    rules = list(_expand(tensor_rules(probe), probe.num_layers))
    expected = {hf for hf, _, _ in rules}
    missing = sorted(expected - set(tensors))
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{source}: missing tensor(s) {missing[:5]}{more}")
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
    for hf_name, ours, layout in rules:
        want = layout.hf_shape(shapes[ours])
        got = _shape(tensors, hf_name)
        if got != want:
            raise CheckpointError(f"{_where(tensors, hf_name, source)}: tensor {hf_name} has "
                                  f"shape {list(got)}, config.json implies {list(want)}")
    if probe.tie_embeddings and "lm_head.weight" in tensors:
        if _shape(tensors, "lm_head.weight") != _shape(tensors, "model.embed_tokens.weight") or \
                not np.array_equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]):
            raise CheckpointError(f"{_where(tensors, 'lm_head.weight', source)}: "
                                  "tie_word_embeddings is true but lm_head.weight differs from "
                                  "model.embed_tokens.weight")
    np_dtype = _NP_DTYPES[dtype]
    by_ours = {ours: (hf_name, layout) for hf_name, ours, layout in rules}

    def read(ours: str) -> np.ndarray:
        # Read and convert one tensor at a time, so host memory holds ~one parameter extra.
        hf_name, layout = by_ours[ours]
        array = np.asarray(tensors[hf_name])
        if not np.issubdtype(array.dtype, np.floating) and array.dtype != ml_dtypes.bfloat16:
            raise CheckpointError(f"{_where(tensors, hf_name, source)}: tensor {hf_name} has "
                                  f"non-float dtype {array.dtype}")
        return np.ascontiguousarray(layout.to_ours(array, shapes[ours])).astype(np_dtype)

    _assign_params(abstract, read, place)
    return abstract


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


def load_pretrained(hf_dir: str | Path, *, dtype: str | None = None,
                    place: Placer | None = None, **overrides: Any) -> Decoder:
    """A `Decoder` from a local HF directory (`config.json` + safetensors, sharded or not).

    dtype: parameter dtype, None = the checkpoint's own (bf16 stays bf16, else float32).
    place: see `model_from_state_dict`. overrides: `DecoderConfig` fields such as
    compute_dtype="bfloat16", remat="full", scan_layers=True.
    """
    hf_dir = Path(hf_dir)
    hf_config = read_hf_config(hf_dir)
    DecoderConfig.from_hf(hf_config, source=str(hf_dir / "config.json"), **overrides)
    tensors = _LazySafetensors(_safetensors_files(hf_dir))
    return model_from_state_dict(hf_config, tensors, dtype=dtype, source=str(hf_dir),
                                 place=place, **overrides)


# ---- export --------------------------------------------------------------------------------


def _hf_tensors(model: Decoder, dtype: str | None) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array) in mapping-table order, converted one at a time."""
    c: DecoderConfig = model.config
    read = _ParamReader(model)
    for hf_name, ours, layout in _expand(tensor_rules(c), c.num_layers):
        array = np.ascontiguousarray(layout.to_hf(read(ours)))
        yield hf_name, array if dtype is None else array.astype(_NP_DTYPES[dtype])


def state_dict(model: Decoder, *, dtype: str | None = None) -> dict[str, np.ndarray]:
    """HF-named numpy tensors of `model` (in `dtype`, default the params' dtype)."""
    return dict(_hf_tensors(model, dtype))


def _plan_shards(model: Decoder, dtype: str, max_shard_bytes: int) -> list[list[str]]:
    """HF tensor names per shard, from shapes alone (so shard count is known up front)."""
    c: DecoderConfig = model.config
    shapes = _per_layer_shapes(model)
    itemsize = np.dtype(_NP_DTYPES[dtype]).itemsize
    shards: list[list[str]] = [[]]
    size = 0
    for hf_name, ours, layout in _expand(tensor_rules(c), c.num_layers):
        nbytes = int(np.prod(layout.hf_shape(shapes[ours]))) * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(hf_name)
        size += nbytes
    return shards


def save_pretrained(
    model: Decoder,
    out_dir: str | Path,
    *,
    tokenizer: Any = None,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 1024**3,
    generation_config: Mapping[str, Any] | None = None,
) -> Path:
    """Write a HF directory that transformers and vLLM load.

    Files: `model.safetensors` (or `model-0000k-of-0000n.safetensors` + index when larger than
    `max_shard_bytes`), `config.json`, `generation_config.json` (token ids from the config,
    updated by `generation_config`), and tokenizer files: `tokenizer` is an object with
    `save_pretrained(dir)` (e.g. `PreTrainedTokenizerFast`) or a directory to copy them from.
    dtype: "float32" / "bfloat16" / "float16"; None = the parameters' dtype.
    """
    c: DecoderConfig = model.config
    # Check the tokenizer argument before writing anything.
    copied: list[str] = []
    if isinstance(tokenizer, str | Path):
        copied = [n for n in TOKENIZER_FILES if (Path(tokenizer) / n).exists()]
        if not copied:
            raise CheckpointError(f"tokenizer directory {tokenizer} has none of "
                                  f"{TOKENIZER_FILES}")
    elif tokenizer is not None and not hasattr(tokenizer, "save_pretrained"):
        raise TypeError(f"tokenizer must be a directory or have save_pretrained(); got "
                        f"{type(tokenizer).__name__}")
    if dtype is not None and dtype not in _NP_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(_NP_DTYPES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype_name = dtype or c.param_dtype
    for stale in list(out.glob("model*.safetensors")) + [out / SAFE_INDEX]:
        stale.unlink(missing_ok=True)
    plan = _plan_shards(model, dtype_name, max_shard_bytes)
    names = [SAFE_SINGLE] if len(plan) == 1 else [
        f"model-{k:05d}-of-{len(plan):05d}.safetensors" for k in range(1, len(plan) + 1)]
    shard_of = {tensor: k for k, shard in enumerate(plan) for tensor in shard}
    meta = {"format": "pt"}
    pending: dict[str, np.ndarray] = {}
    total = 0
    # Host memory holds one shard at a time (plus the Variable being read).
    for hf_name, array in _hf_tensors(model, dtype_name):
        pending[hf_name] = array
        total += array.nbytes
        k = shard_of[hf_name]
        if hf_name == plan[k][-1]:
            safetensors.numpy.save_file(pending, str(out / names[k]), metadata=meta)
            pending = {}
    if len(plan) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {t: names[shard_of[t]] for shard in plan for t in shard}}
        (out / SAFE_INDEX).write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(c.to_hf(dtype=dtype_name), indent=2))
    gen = {k: v for k, v in (("bos_token_id", c.bos_token_id),
                             ("eos_token_id", c.eos_token_id),
                             ("pad_token_id", c.pad_token_id)) if v is not None}
    if isinstance(gen.get("eos_token_id"), tuple):
        gen["eos_token_id"] = list(gen["eos_token_id"])
    if isinstance(tokenizer, str | Path):
        src = Path(tokenizer)
        for name in copied:
            shutil.copyfile(src / name, out / name)
        if (src / "generation_config.json").exists() and generation_config is None:
            gen.update(json.loads((src / "generation_config.json").read_text()))
    elif tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    gen.update(generation_config or {})
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out


__all__ = [
    "CheckpointError", "UnsupportedConfigError", "load_pretrained", "model_from_state_dict",
    "our_params", "read_hf_config", "save_pretrained", "state_dict", "tensor_rules",
]
