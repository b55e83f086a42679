"""Our parameters as a flat per-layer dict, and the names both HF directions share.

`hf.py` (import) and `hf_export.py` (export) both read parameters through `_ParamReader` and
name files with these constants; they live here so neither of those modules imports the other.
"""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from jaxrl_llm.core.errors import ModelFileError
from jaxrl_llm.models.config import DecoderConfig
from jaxrl_llm.models.decoder import Decoder

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
    "chat_template.json",
)
_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
EXPORT_DTYPES: tuple[str, ...] = tuple(_NP_DTYPES)


class CheckpointError(ModelFileError):
    """A Hugging Face checkpoint that does not match what the config says (names the tensor)."""


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
