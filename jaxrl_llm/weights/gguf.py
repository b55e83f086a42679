"""Load a llama.cpp GGUF file into our NNX decoder, with its tokenizer and chat template.

Steps (facts measured in the project's STACK notes):
1. `gguf.GGUFReader` memory-maps the file; `gguf.quants.dequantize` turns every tensor
   (Q8_0, Q4_1, F16, BF16, F32, K-quants, ...) into float32 in numpy order, which for 2-D
   weights is Hugging Face's (out_features, in_features).
2. GGUF tensor names map to Hugging Face Llama names (`blk.N.attn_q.weight` ->
   `model.layers.N.self_attn.q_proj.weight`, ...).
3. llama.cpp's converter permutes the rows of Q and K so its interleaved RoPE matches HF's
   rotate-half RoPE; we apply the inverse permutation (`unpermute_qk_rows`), otherwise the
   model produces garbage.
4. The HF `config.json` dict is rebuilt from `llama.*` metadata and handed, with the HF-named
   tensors, to `jaxrl_llm.weights.hf.model_from_state_dict` -- the same path as safetensors.

Only the `llama` architecture (Llama 1-3 without rope-frequency tensors, Mistral, SmolLM2) is
supported; anything else is a clear `GGUFError`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize
from transformers import PreTrainedTokenizerFast

from jaxrl_llm.core.errors import ModelFileError
from jaxrl_llm.models.tokenizer import (
    GGUFTokenizerMetadata,
    TokenizerMetadataError,
    tokenizer_from_gguf_metadata,
)

SUPPORTED_ARCHITECTURES = ("llama",)


class GGUFError(ModelFileError):
    """A GGUF file that we cannot load faithfully (names the file and the field or tensor)."""


@dataclass(frozen=True)
class GGUFInfo:
    """What a GGUF file says about itself besides the weights."""

    path: Path
    architecture: str
    name: str | None
    hf_config: dict[str, Any]
    chat_template: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    tensor_types: dict[str, str]  # GGUF tensor name -> quantisation type name ("Q4_1", ...)
    metadata: dict[str, Any]  # every scalar / short-array key, tokenizer vocabulary excluded


@dataclass(frozen=True)
class GGUFModel:
    """`load_gguf`'s result: an NNX `Decoder`, its tokenizer and the file's metadata."""

    model: Any  # jaxrl_llm.models.decoder.Decoder
    tokenizer: PreTrainedTokenizerFast
    info: GGUFInfo


# Keys too large to keep in `GGUFInfo.metadata` (they are used for the tokenizer instead).
_BULK_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
              "tokenizer.ggml.scores")


def open_gguf(path: str | Path) -> GGUFReader:
    """Memory-map a GGUF file; a clear error if it is missing or not GGUF."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return GGUFReader(path, "r")
    except (ValueError, OSError) as err:
        raise GGUFError(f"{path}: not a readable GGUF file ({err})") from err


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All key/value metadata as Python values (strings, numbers, lists)."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if field.types and field.types[0] == GGUFValueType.ARRAY and not isinstance(value, list):
            value = list(value)
        out[key] = value
    return out


def _require(meta: dict[str, Any], key: str, path: Path) -> Any:
    if key not in meta:
        raise GGUFError(f"{path}: metadata key {key!r} is missing")
    return meta[key]


def tokenizer_metadata(meta: dict[str, Any], path: Path) -> GGUFTokenizerMetadata:
    """The `tokenizer.*` keys as a `GGUFTokenizerMetadata`."""
    arch = meta.get("general.architecture", "llama")

    def optional_int(key: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{key}")
        return None if value is None else int(value)

    context = meta.get(f"{arch}.context_length")
    return GGUFTokenizerMetadata(
        model=str(_require(meta, "tokenizer.ggml.model", path)),
        pre=str(meta.get("tokenizer.ggml.pre", "default")),
        tokens=list(_require(meta, "tokenizer.ggml.tokens", path)),
        merges=list(meta.get("tokenizer.ggml.merges", [])),
        token_types=[int(t) for t in meta.get("tokenizer.ggml.token_type", [])],
        bos_token_id=optional_int("bos_token_id"),
        eos_token_id=optional_int("eos_token_id"),
        unk_token_id=optional_int("unknown_token_id"),
        pad_token_id=optional_int("padding_token_id"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"),
        model_max_length=None if context is None else int(context),
    )


def _float32_value(value: float) -> float:
    """The shortest decimal of a float32 metadata value (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def hf_config_from_metadata(
    meta: dict[str, Any], tensor_names: set[str], path: Path
) -> dict[str, Any]:
    """The Hugging Face `config.json` dict of a `llama` GGUF (LlamaForCausalLM)."""
    arch = _require(meta, "general.architecture", path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"{path}: general.architecture={arch!r} is not supported; supported: "
            f"{list(SUPPORTED_ARCHITECTURES)} (convert other models to Hugging Face safetensors "
            "and use jaxrl_llm.weights.hf.load_pretrained)"
        )
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in tensor_names:
        raise GGUFError(
            f"{path}: RoPE scaling ({arch}.rope.scaling.type={scaling!r}, rope_freqs.weight "
            f"present={'rope_freqs.weight' in tensor_names}) is not supported from GGUF; load "
            "the Hugging Face checkpoint instead"
        )
    if meta.get(f"{arch}.expert_count", 0):
        raise GGUFError(f"{path}: mixture-of-experts GGUF ({arch}.expert_count) is not supported")

    hidden = int(_require(meta, f"{arch}.embedding_length", path))
    heads = int(_require(meta, f"{arch}.attention.head_count", path))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    value_dim = int(meta.get(f"{arch}.attention.value_length", head_dim))
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if value_dim != head_dim or rope_dim != head_dim:
        raise GGUFError(
            f"{path}: key_length={head_dim}, value_length={value_dim}, "
            f"rope.dimension_count={rope_dim} differ; only full-head RoPE with equal K/V "
            "head sizes is supported"
        )
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(_require(meta, "tokenizer.ggml.tokens", path))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_require(meta, f"{arch}.feed_forward_length", path)),
        "num_hidden_layers": int(_require(meta, f"{arch}.block_count", path)),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
        "rms_norm_eps": _float32_value(
            _require(meta, f"{arch}.attention.layer_norm_rms_epsilon", path)
        ),
        "rope_theta": _float32_value(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "float32",
    }
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None:
            config[key.replace("padding", "pad")] = int(value)
    return config


_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def hf_tensor_name(gguf_name: str) -> str | None:
    """Hugging Face Llama name of a GGUF tensor, or None if we do not know it."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_RE.match(gguf_name)
    if match and match.group(2) in _BLOCK_NAMES:
        return f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}"
    return None


def unpermute_qk_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (works for weights [rows, in] and biases [rows]).

    llama.cpp's converter reorders each head's rows from rotate-half order (first half, second
    half) to interleaved pairs: `w.reshape(h, 2, r // h // 2, ...).swapaxes(1, 2)`. The inverse
    swaps the same axes on the (h, r // h // 2, 2) view.
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise GGUFError(f"cannot un-permute {rows} rows over {n_heads} heads (odd head size)")
    rest = weight.shape[1:]
    return (
        weight.reshape(n_heads, rows // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(weight.shape)
    )


def dequantize_tensor(tensor) -> np.ndarray:
    """A GGUF tensor as float32 in numpy (= Hugging Face) axis order."""
    array = dequantize(tensor.data, tensor.tensor_type)
    expected = tuple(int(d) for d in reversed(tensor.shape))  # ggml lists the fastest dim first
    return np.asarray(array, dtype=np.float32).reshape(expected)


def hf_state_dict(
    reader: GGUFReader, hf_config: dict[str, Any], path: Path
) -> dict[str, np.ndarray]:
    """All tensors, dequantised, un-permuted and renamed to Hugging Face Llama names."""
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config["num_key_value_heads"]
    layers = hf_config["num_hidden_layers"]
    tensors: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            raise GGUFError(f"{path}: tensor {tensor.name!r} has no Hugging Face Llama equivalent")
        layer = _BLOCK_RE.match(tensor.name)
        if layer and int(layer.group(1)) >= layers:
            raise GGUFError(f"{path}: tensor {tensor.name!r} beyond block_count={layers}")
        try:
            array = dequantize_tensor(tensor)
        except (RuntimeError, ValueError) as err:  # unknown quant types raise a RuntimeError subclass
            raise GGUFError(
                f"{path}: cannot dequantise tensor {tensor.name!r} of type "
                f"{tensor.tensor_type.name}: {err}"
            ) from err
        if ".attn_q." in tensor.name:
            array = unpermute_qk_rows(array, heads)
        elif ".attn_k." in tensor.name:
            array = unpermute_qk_rows(array, kv_heads)
        tensors[name] = array
    return tensors


def read_gguf(path: str | Path) -> tuple[GGUFReader, GGUFInfo, PreTrainedTokenizerFast]:
    """Metadata, HF config and tokenizer of a GGUF file, without dequantising the weights."""
    path = Path(path)
    reader = open_gguf(path)
    meta = read_metadata(reader)
    tensor_names = {t.name for t in reader.tensors}
    hf_config = hf_config_from_metadata(meta, tensor_names, path)
    try:
        tokenizer = tokenizer_from_gguf_metadata(tokenizer_metadata(meta, path))
    except TokenizerMetadataError as err:  # its messages name the key, not the file
        raise GGUFError(f"{path}: {err}") from err
    if len(tokenizer) > hf_config["vocab_size"]:
        raise GGUFError(
            f"{path}: tokenizer (tokenizer.ggml.tokens) has {len(tokenizer)} tokens but the "
            f"model's vocab_size is {hf_config['vocab_size']}"
        )
    info = GGUFInfo(
        path=path,
        architecture=meta["general.architecture"],
        name=meta.get("general.name"),
        hf_config=hf_config,
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token_id=hf_config.get("bos_token_id"),
        eos_token_id=hf_config.get("eos_token_id"),
        tensor_types={t.name: t.tensor_type.name for t in reader.tensors},
        metadata={k: v for k, v in meta.items() if k not in _BULK_KEYS},
    )
    return reader, info, tokenizer


def gguf_hf_config(path: str | Path) -> dict[str, Any]:
    """The HF `config.json` dict of a GGUF file, from its metadata alone (no weights read)."""
    path = Path(path)
    reader = open_gguf(path)
    return hf_config_from_metadata(read_metadata(reader), {t.name for t in reader.tensors}, path)


def load_gguf(path: str | Path, *, dtype: Any = None, mesh: Any = None, rules: Any = None,
              **overrides: Any) -> GGUFModel:
    """Build our `Decoder` from a GGUF file (dequantised to float32, then cast to `dtype`).

    `overrides` are `DecoderConfig` fields (compute_dtype, scan_layers, remat, ...); `mesh`
    and `rules` place each parameter straight into its sharding (see
    `hf.model_from_state_dict`; the file is dequantised on the host first).
    Returns the model, a `PreTrainedTokenizerFast` carrying the file's chat template, and a
    `GGUFInfo` (HF config, bos/eos ids, per-tensor quantisation types, raw metadata).
    """
    # Imported here so reading metadata/tokenizers does not pull in the model code.
    from jaxrl_llm.weights.hf import model_from_state_dict

    reader, info, tokenizer = read_gguf(path)
    tensors = hf_state_dict(reader, info.hf_config, info.path)
    model = model_from_state_dict(info.hf_config, tensors, dtype=dtype, source=str(info.path),
                                  mesh=mesh, rules=rules, **overrides)
    return GGUFModel(model=model, tokenizer=tokenizer, info=info)
