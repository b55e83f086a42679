"""Write a `Decoder` (and its tokenizer) as a llama.cpp GGUF file: `export --format gguf`.

The inverse of `weights/gguf.py`, with the `gguf` package's `GGUFWriter`:
1. metadata: `general.*`, the `llama.*` architecture keys (blocks, widths, GQA head counts,
   RoPE base and dimension, RMSNorm epsilon, context length, vocabulary size) and
   `tokenizer.ggml.*` built from our tokenizer (byte-level BPE vocabulary, merges, token
   types, special ids, pre-tokenizer name, chat template), padded with `[PAD{i}]` tokens of
   type UNUSED up to the model's vocabulary as llama.cpp's own converter does;
2. tensors renamed to GGUF names (`model.layers.N.self_attn.q_proj.weight` ->
   `blk.N.attn_q.weight`), Q and K rows permuted into llama.cpp's interleaved-RoPE order
   (the forward permutation that `gguf.unpermute_qk_rows` undoes);
3. storage type: norms stay F32 (as llama.cpp does); every matrix is F32, F16 or Q8_0
   (blocks of 32 values with one f16 scale, `gguf.quants.quantize`).
Tensor infos are written first and the data one tensor at a time, so host memory holds one
tensor (not the whole model) however large the model is.

Only what llama.cpp computes exactly is written: its `llama` architecture for Llama, SmolLM2,
Mistral without a sliding window and Mixtral (whose experts llama.cpp's `llama` runs:
`{arch}.expert_count` / `expert_used_count`, renormalised top-k weights), and its `qwen3moe`
for Qwen3-MoE (q/k norms, no Q/K permutation: NEOX RoPE is rotate-half; top-k weights always
renormalised, so norm_topk_prob must be true). A mixture of experts' per-expert HF tensors
are stacked into llama.cpp's [E, out, in] `ffn_{gate,up,down}_exps`, and the router is
`ffn_gate_inp`, kept F32 as llama.cpp's converter does. No RoPE scaling, no attention biases;
anything else is a `GGUFExportError` naming the family or field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType
from gguf.quants import quantize

from jaxrl_llm.models.config import DecoderConfig
from jaxrl_llm.models.tokenizer import _REGEX_PRE_TYPES
from jaxrl_llm.weights.gguf import _BLOCK_NAMES, _GLOBAL_NAMES
from jaxrl_llm.weights.hf_export import _hf_tensors
from jaxrl_llm.weights.hf_layout import expand_rules, tensor_rules
from jaxrl_llm.weights.hf_params import _per_layer_shapes

# --gguf-type -> (storage of matrices, general.file_type)
GGUF_TYPES: dict[str, tuple[GGMLQuantizationType, LlamaFileType]] = {
    "f32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
    "f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
}
# Our families and the llama.cpp architecture that runs each unchanged.
GGUF_FAMILIES: dict[str, str] = {"llama": "llama", "mistral": "llama", "mixtral": "llama",
                                 "qwen3_moe": "qwen3moe"}
# HF per-layer names of the tensors only a mixture of experts (or Qwen3's q/k norms) has ->
# their GGUF names; an expert's index is dropped: its tensors are stacked (gguf MODEL_TENSORS).
_MOE_NAMES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), name) for pattern, name in (
        (r"(mlp|block_sparse_moe)\.gate\.weight", "ffn_gate_inp.weight"),
        (r"(mlp|block_sparse_moe)\.experts\.\d+\.(gate_proj|w1)\.weight", "ffn_gate_exps.weight"),
        (r"(mlp|block_sparse_moe)\.experts\.\d+\.(up_proj|w3)\.weight", "ffn_up_exps.weight"),
        (r"(mlp|block_sparse_moe)\.experts\.\d+\.(down_proj|w2)\.weight", "ffn_down_exps.weight"),
        (r"self_attn\.q_norm\.weight", "attn_q_norm.weight"),
        (r"self_attn\.k_norm\.weight", "attn_k_norm.weight")))
_Q8_BLOCK = 32


class GGUFExportError(ValueError):
    """A model, tokenizer or type that cannot be written faithfully as GGUF (names it)."""


def check_exportable(config: DecoderConfig, gguf_type: str) -> str:
    """The GGUF architecture name for `config`, or a `GGUFExportError` naming what is not
    supported (family, field or `gguf_type`)."""
    if gguf_type not in GGUF_TYPES:
        raise GGUFExportError(f"GGUF type {gguf_type!r} is not supported for export; "
                              f"supported: {list(GGUF_TYPES)}")
    arch = GGUF_FAMILIES.get(config.family)
    if arch is None:
        raise GGUFExportError(
            f"GGUF type {gguf_type!r} is not supported for architecture {config.family!r}: "
            f"GGUF export writes {sorted(GGUF_FAMILIES)} (llama.cpp's 'llama' and 'qwen3moe' "
            "architectures); "
            "export --format hf instead")
    unsupported = {
        "rope_scaling": config.rope_scaling is not None,
        "sliding_window": config.sliding_window is not None,
        "qkv_bias/o_bias (attention_bias)": config.qkv_bias or config.o_bias,
        "qk_norm": config.qk_norm != (arch == "qwen3moe"),  # qwen3moe has them, llama not
        "norm_topk_prob=false (llama.cpp renormalises the top-k weights)":
            config.is_moe and not config.norm_topk_prob,
    }
    bad = [name for name, is_set in unsupported.items() if is_set]
    if bad:
        raise GGUFExportError(f"GGUF export of {config.family!r} with {bad} is not supported "
                              "(the loader reads plain Llama blocks); export --format hf instead")
    if gguf_type == "q8_0":
        widths = {"hidden_size": config.hidden_size, "intermediate_size":
                  config.moe_intermediate_size if config.is_moe else config.intermediate_size,
                  "num_heads*head_dim": config.num_heads * config.head_dim}
        odd = {k: v for k, v in widths.items() if v % _Q8_BLOCK}
        if odd:
            raise GGUFExportError(f"GGUF type 'q8_0' quantises rows in blocks of {_Q8_BLOCK}; "
                                  f"{odd} are not multiples of {_Q8_BLOCK} (use f16)")
    return arch


def gguf_tensor_name(hf_name: str) -> str:
    """GGUF name of a Hugging Face tensor (inverse of `gguf.hf_tensor_name`); every expert's
    tensor of one kind gets its stacked tensor's name."""
    for ours, theirs in _GLOBAL_NAMES.items():
        if theirs == hf_name:
            return ours
    prefix, _, rest = hf_name.partition("model.layers.")
    index, _, suffix = rest.partition(".")
    for ours, theirs in _BLOCK_NAMES.items():
        if not prefix and theirs == suffix:
            return f"blk.{index}.{ours}"
    for pattern, ours in _MOE_NAMES:
        if not prefix and pattern.fullmatch(suffix):
            return f"blk.{index}.{ours}"
    raise GGUFExportError(f"tensor {hf_name!r} has no GGUF name")


def permute_qk_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order: each head's rotate-half halves interleaved in pairs."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:]).swapaxes(
        1, 2).reshape(weight.shape)


def _storage(name: str, shape: tuple[int, ...], gguf_type: str) -> GGMLQuantizationType:
    """Norms (1-D) and a router (`ffn_gate_inp`) stay F32 as in llama.cpp's converter;
    matrices take the requested type."""
    if len(shape) == 1 or name.endswith("ffn_gate_inp.weight"):
        return GGMLQuantizationType.F32
    return GGUF_TYPES[gguf_type][0]


def _nbytes(shape: tuple[int, ...], kind: GGMLQuantizationType) -> int:
    count = int(np.prod(shape))
    if kind == GGMLQuantizationType.Q8_0:
        return count // _Q8_BLOCK * (2 + _Q8_BLOCK)  # one f16 scale + 32 int8 per block
    return count * (2 if kind == GGMLQuantizationType.F16 else 4)


def _encode(array: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    array = np.ascontiguousarray(array, dtype=np.float32)
    if kind == GGMLQuantizationType.F32:
        return array
    if kind == GGMLQuantizationType.F16:
        return array.astype(np.float16)
    return quantize(array, kind)


# ---- tokenizer -------------------------------------------------------------------------------


def _pre_tokenizer_name(pre: dict[str, Any] | None, where: str) -> str:
    """llama.cpp's `tokenizer.ggml.pre` for a `tokenizers` pre-tokenizer (byte-level BPE)."""
    parts = [] if pre is None else pre.get("pretokenizers", [pre]) if pre["type"] == "Sequence" \
        else [pre]
    kinds = [p["type"] for p in parts]
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt2"
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits"):
        return "smollm"
    if kinds == ["Split", "ByteLevel"]:
        regex = parts[0].get("pattern", {}).get("Regex")
        for name, pattern in _REGEX_PRE_TYPES.items():
            if pattern == regex:
                return name
    raise GGUFExportError(
        f"{where}: pre-tokenizer {kinds} has no llama.cpp equivalent (supported: GPT-2 "
        "byte-level, SmolLM2 digits + byte-level, Llama 3 / Qwen2 regex + byte-level)")


def tokenizer_fields(tokenizer: Any, vocab_size: int) -> dict[str, Any]:
    """The `tokenizer.ggml.*` values of a byte-level BPE `PreTrainedTokenizerFast`."""
    where = f"tokenizer {type(tokenizer).__name__}"
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise GGUFExportError(f"{where}: GGUF export needs a fast (tokenizers) tokenizer")
    spec = json.loads(backend.to_str())
    model, decoder = spec["model"], spec.get("decoder") or {}
    if model.get("type") != "BPE" or decoder.get("type") != "ByteLevel":
        raise GGUFExportError(
            f"{where}: model {model.get('type')!r} with decoder {decoder.get('type')!r} is not "
            "byte-level BPE, the one tokenizer GGUF 'gpt2' stores (a char tokenizer is not): "
            "pass --tokenizer DIR of a byte-level BPE tokenizer")
    pre = _pre_tokenizer_name(spec.get("pre_tokenizer"), where)
    size = len(tokenizer)
    if size > vocab_size:
        raise GGUFExportError(f"{where} has {size} tokens, more than the model's vocab_size "
                              f"{vocab_size}")
    tokens = tokenizer.convert_ids_to_tokens(list(range(size)))
    if any(t is None for t in tokens):
        raise GGUFExportError(f"{where}: token ids are not contiguous 0..{size - 1}")
    added = tokenizer.added_tokens_decoder
    types = [int(TokenType.NORMAL)] * size
    for index, token in added.items():
        types[index] = int(TokenType.CONTROL if token.special else TokenType.USER_DEFINED)
    # llama.cpp needs one token per embedding row: its converter pads with unused tokens.
    tokens += [f"[PAD{i}]" for i in range(size, vocab_size)]
    types += [int(TokenType.UNUSED)] * (vocab_size - size)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    empty = tokenizer("")["input_ids"]  # what encode adds around any text
    fields: dict[str, Any] = {"model": "gpt2", "pre": pre, "tokens": tokens, "merges": merges,
                              "token_types": types}
    for role in ("bos", "eos", "unk", "pad"):
        value = getattr(tokenizer, f"{role}_token_id", None)
        if isinstance(value, int):
            fields[f"{role}_token_id"] = value
    fields["add_bos_token"] = fields.get("bos_token_id") in empty
    fields["add_eos_token"] = fields.get("eos_token_id") in empty
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        fields["chat_template"] = template
    return fields


def _add_tokenizer(writer: GGUFWriter, fields: dict[str, Any]) -> None:
    writer.add_tokenizer_model(fields["model"])
    writer.add_tokenizer_pre(fields["pre"])
    writer.add_token_list(fields["tokens"])
    writer.add_token_types(fields["token_types"])
    if fields["merges"]:
        writer.add_token_merges(fields["merges"])
    adders = {"bos_token_id": writer.add_bos_token_id, "eos_token_id": writer.add_eos_token_id,
              "unk_token_id": writer.add_unk_token_id, "pad_token_id": writer.add_pad_token_id}
    for key, add in adders.items():
        if key in fields:
            add(fields[key])
    writer.add_add_bos_token(bool(fields["add_bos_token"]))
    writer.add_add_eos_token(bool(fields["add_eos_token"]))
    if "chat_template" in fields:
        writer.add_chat_template(fields["chat_template"])


# ---- the file --------------------------------------------------------------------------------


def _add_architecture(writer: GGUFWriter, c: DecoderConfig, name: str, gguf_type: str) -> None:
    writer.add_name(name)
    writer.add_file_type(int(GGUF_TYPES[gguf_type][1]))
    if gguf_type == "q8_0":
        writer.add_quantization_version(2)  # gguf.GGML_QUANT_VERSION, what llama.cpp expects
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_layers)
    # Mixtral's experts are its MLP (llama.cpp reads their width here); Qwen3-MoE keeps
    # intermediate_size and gives the experts' width its own key
    writer.add_feed_forward_length(c.moe_intermediate_size if c.family == "mixtral"
                                   else c.intermediate_size)
    if c.is_moe:
        writer.add_expert_count(c.num_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        if c.family == "qwen3_moe":
            writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    writer.add_head_count(c.num_heads)
    writer.add_head_count_kv(c.num_kv_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_rope_freq_base(float(c.rope_theta))
    writer.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    writer.add_vocab_size(c.vocab_size)


def _tensor_plan(model: Any) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, shape) of every tensor in file order: the HF mapping table's, with each
    run of per-expert tensors stacked into one [E, ...] tensor."""
    c: DecoderConfig = model.config
    shapes = _per_layer_shapes(model)
    plan: list[tuple[str, tuple[int, ...]]] = []
    for hf_name, ours, layout in expand_rules(tensor_rules(c), c.num_layers):
        name, shape = gguf_tensor_name(hf_name), layout.hf_shape(shapes[ours])
        if layout.expert is None:
            plan.append((name, shape))
        elif layout.expert == 0:
            plan.append((name, (c.num_experts, *shape)))
    return plan


def _gguf_tensors(model: Any, gguf_type: str) -> Iterator[tuple[str, np.ndarray, Any]]:
    """(GGUF name, encoded array, storage type) in `_tensor_plan` order, one at a time (a
    stacked expert tensor is assembled from its experts' HF tensors first)."""
    c: DecoderConfig = model.config
    permute = GGUF_FAMILIES[c.family] == "llama"  # llama.cpp's interleaved RoPE
    experts: list[np.ndarray] = []
    for hf_name, array in _hf_tensors(model, "float32"):
        if permute and ".self_attn.q_proj." in hf_name:
            array = permute_qk_rows(array, c.num_heads)
        elif permute and ".self_attn.k_proj." in hf_name:
            array = permute_qk_rows(array, c.num_kv_heads)
        name = gguf_tensor_name(hf_name)
        if name.endswith("_exps.weight"):
            experts.append(array)
            if len(experts) < c.num_experts:
                continue
            array, experts = np.stack(experts), []
        kind = _storage(name, array.shape, gguf_type)
        yield name, _encode(array, kind), kind


def write_gguf(model: Any, path: str | Path, *, tokenizer: Any, gguf_type: str = "f16",
               name: str = "jaxrl-llm export") -> Path:
    """Write `model` (a `Decoder`) and `tokenizer` as one GGUF file at `path`.

    gguf_type: "f32", "f16" or "q8_0" for every matrix (norms stay F32). Checks the model
    and the tokenizer before the file is opened; a failure leaves no file behind.
    """
    c: DecoderConfig = model.config
    arch = check_exportable(c, gguf_type)
    if tokenizer is None:
        raise GGUFExportError("GGUF export needs a tokenizer (llama.cpp reads it from the file)")
    fields = tokenizer_fields(tokenizer, c.vocab_size)
    path = Path(path)
    writer = GGUFWriter(None, arch)
    _add_architecture(writer, c, name, gguf_type)
    _add_tokenizer(writer, fields)
    for name, shape in _tensor_plan(model):
        kind = _storage(name, shape, gguf_type)
        dummy = np.dtype(np.float16 if kind == GGMLQuantizationType.F16 else np.float32)
        writer.add_tensor_info(name, shape, dummy, _nbytes(shape, kind), raw_dtype=kind)
    try:
        writer.write_header_to_file(path)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for _, data, _ in _gguf_tensors(model, gguf_type):
            writer.write_tensor_data(data)
    except BaseException:
        writer.close()
        path.unlink(missing_ok=True)
        raise
    writer.close()
    return path


__all__ = ["GGUF_FAMILIES", "GGUF_TYPES", "GGUFExportError", "check_exportable",
           "gguf_tensor_name", "permute_qk_rows", "tokenizer_fields", "write_gguf"]
