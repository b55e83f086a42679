"""Hugging Face export: `Decoder` -> safetensors shards (+ index), `config.json`,
`generation_config.json` and tokenizer files that `transformers` and vLLM load.

Driven by the same mapping table as the import (`hf_layout.tensor_rules`), in the inverse
direction; re-exported by `weights.hf` (`hf.save_pretrained`, `hf.state_dict`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy

from jaxrl_llm.models.config import DecoderConfig, dtype_name
from jaxrl_llm.models.decoder import Decoder
from jaxrl_llm.weights.hf_layout import expand_rules, tensor_rules
from jaxrl_llm.weights.hf_params import (
    _NP_DTYPES,
    EXPORT_DTYPES,
    SAFE_INDEX,
    SAFE_SINGLE,
    TOKENIZER_FILES,
    CheckpointError,
    _ParamReader,
    _per_layer_shapes,
)
from jaxrl_llm.weights.lora_export import merge_lora

__all__ = ["save_pretrained", "state_dict"]


def _hf_tensors(model: Decoder, dtype: str | None) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array) in mapping-table order, converted one at a time."""
    model = merge_lora(model)  # LoRA adapters folded in: W + (α/r)·A·B (a no-op without)
    c: DecoderConfig = model.config
    read = _ParamReader(model)
    for hf_name, ours, layout in expand_rules(tensor_rules(c), c.num_layers):
        array = np.ascontiguousarray(layout.to_hf(read(ours)))
        yield hf_name, array if dtype is None else array.astype(_NP_DTYPES[dtype])


def state_dict(model: Decoder, *, dtype: Any = None) -> dict[str, np.ndarray]:
    """HF-named numpy tensors of `model` (in `dtype`, default the params' dtype)."""
    if dtype is not None:
        dtype = dtype_name(dtype, field="dtype", choices=EXPORT_DTYPES)
    return dict(_hf_tensors(model, dtype))


def _plan_shards(model: Decoder, dtype: str, max_shard_bytes: int) -> list[list[str]]:
    """HF tensor names per shard, from shapes alone (so shard count is known up front)."""
    c: DecoderConfig = model.config
    shapes = _per_layer_shapes(model)
    itemsize = np.dtype(_NP_DTYPES[dtype]).itemsize
    shards: list[list[str]] = [[]]
    size = 0
    for hf_name, ours, layout in expand_rules(tensor_rules(c), c.num_layers):
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
    dtype: Any = None,
    max_shard_bytes: int = 5 * 1024**3,
    generation_config: Mapping[str, Any] | None = None,
    on_tensor: Callable[[int, int], None] | None = None,
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
    if dtype is not None:
        dtype = dtype_name(dtype, field="dtype", choices=EXPORT_DTYPES)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    out_dtype = dtype or c.param_dtype
    for stale in list(out.glob("model*.safetensors")) + [out / SAFE_INDEX]:
        stale.unlink(missing_ok=True)
    plan = _plan_shards(model, out_dtype, max_shard_bytes)
    names = [SAFE_SINGLE] if len(plan) == 1 else [
        f"model-{k:05d}-of-{len(plan):05d}.safetensors" for k in range(1, len(plan) + 1)]
    shard_of = {tensor: k for k, shard in enumerate(plan) for tensor in shard}
    meta = {"format": "pt"}
    pending: dict[str, np.ndarray] = {}
    total = 0
    # Host memory holds one shard at a time (plus the Variable being read).
    count = sum(len(shard) for shard in plan)
    for hf_name, array in _hf_tensors(model, out_dtype):
        if on_tensor is not None:  # progress: (tensors done, of how many)
            on_tensor(1, count)
        pending[hf_name] = array
        total += array.nbytes
        k = shard_of[hf_name]
        if hf_name == plan[k][-1]:
            safetensors.numpy.save_file(pending, str(out / names[k]), metadata=meta)
            _usual_mode(out / names[k])
            pending = {}
    if len(plan) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {t: names[shard_of[t]] for shard in plan for t in shard}}
        (out / SAFE_INDEX).write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(c.to_hf(dtype=out_dtype), indent=2))
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


def _usual_mode(path: Path) -> None:
    """safetensors writes its file 0600 (readable by its owner only); give it the mode any
    other file gets here (0666 less the umask), as transformers' own exports have."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)
