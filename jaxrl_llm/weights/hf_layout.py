"""How each Hugging Face tensor maps onto one of our `Decoder` parameters.

One mapping table per family (`tensor_rules`) drives import and export: each `TensorRule`
names the HF tensor, our parameter path and the layout change between them (a `Layout`,
which knows the forward and inverse reshape/transpose, and which HF slice holds a given
slice of our parameter, so a sharded load reads only each device's part of a tensor).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from jaxrl_llm.models.config import DecoderConfig

Index = tuple[slice, ...]


def normalise_index(index: tuple[slice, ...] | None, shape: tuple[int, ...]) -> Index:
    """`index` (from `jax.make_array_from_callback`; None = everything) as explicit
    `slice(start, stop)` per dimension; strided slices are refused (shards are contiguous)."""
    index = tuple(index or ())
    index += (slice(None),) * (len(shape) - len(index))
    out = []
    for sl, dim in zip(index, shape, strict=True):
        start, stop, step = sl.indices(dim)
        if step != 1:
            raise ValueError(f"strided index {sl} is not a shard")
        out.append(slice(start, stop))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A reversible layout change. `ours` is our shape; HF shapes follow from it.

    copy        same array                     (embeddings, lm_head, norm scales, o bias)
    linear      ours [in, out]      <-> HF [out, in]    (MLP)
    heads_in    ours [d, H, D]      <-> HF [H*D, d]     (q/k/v projections)
    heads_out   ours [H, D, d]      <-> HF [d, H*D]     (o projection)
    heads_bias  ours [H, D]         <-> HF [H*D]        (q/k/v bias)

    `expert` e: HF stores one tensor per expert and ours stacks them [E, ...]: the layout
    applies to ours[e] (a mixture of experts' expert weights, models/moe.py).
    """

    kind: str
    expert: int | None = None

    def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
        if self.expert is not None:
            ours = ours[1:]
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

    def read_ours(self, read_hf: Callable[[Index], np.ndarray], ours: tuple[int, ...],
                  index: Index) -> np.ndarray:
        """Our parameter's slice `index` (normalised) from the HF tensor, reading only the HF
        rows/columns it covers with `read_hf(hf_index)` (a whole head when `head_dim` is cut).
        """
        if self.kind == "copy":
            return read_hf(index)
        if self.kind == "linear":
            return read_hf((index[1], index[0])).T
        if self.kind == "heads_in":  # ours[i, h, k] = HF[h*D + k, i]
            d_sl, h_sl, k_sl = index
            width = ours[2]
            block = read_hf((_head_rows(h_sl, width), d_sl)).T
            return block.reshape(block.shape[0], -1, width)[:, :, k_sl]
        if self.kind == "heads_out":  # ours[h, k, j] = HF[j, h*D + k]
            h_sl, k_sl, d_sl = index
            width = ours[1]
            block = read_hf((d_sl, _head_rows(h_sl, width))).T
            return block.reshape(-1, width, block.shape[1])[:, k_sl, :]
        if self.kind == "heads_bias":  # ours[h, k] = HF[h*D + k]
            h_sl, k_sl = index
            width = ours[1]
            return read_hf((_head_rows(h_sl, width),)).reshape(-1, width)[:, k_sl]
        raise ValueError(f"unknown layout {self.kind!r}")

    def to_hf(self, ours: np.ndarray) -> np.ndarray:
        if self.expert is not None:  # this expert's slice, in the plain layout
            return dataclasses.replace(self, expert=None).to_hf(ours[self.expert])
        if self.kind == "copy":
            return ours
        if self.kind in ("linear", "heads_in", "heads_out"):
            return ours.reshape(self.hf_shape(ours.shape)[::-1]).T
        if self.kind == "heads_bias":
            return ours.reshape(-1)
        raise ValueError(f"unknown layout {self.kind!r}")


def _head_rows(heads: slice, width: int) -> slice:
    """The HF rows (or columns) of heads `heads` when each head is `width` wide."""
    return slice(heads.start * width, heads.stop * width)


COPY, LINEAR = Layout("copy"), Layout("linear")
HEADS_IN, HEADS_OUT, HEADS_BIAS = Layout("heads_in"), Layout("heads_out"), Layout("heads_bias")


@dataclasses.dataclass(frozen=True)
class TensorRule:
    """HF name (with `{i}` for the layer index, and `{e}` for the expert when `experts` > 0:
    one HF tensor per expert, stacked in ours) <-> our parameter path under the layer/root."""

    hf: str
    ours: str
    layout: Layout
    per_layer: bool
    experts: int = 0


# Per-layer MoE tensors of each family: (HF name, ours, layout, one per expert).
_MOE_TENSORS: dict[str, list[tuple[str, str, Layout, bool]]] = {
    "qwen3_moe": [("mlp.gate.weight", "mlp.router", LINEAR, False),
                  ("mlp.experts.{e}.gate_proj.weight", "mlp.gate", LINEAR, True),
                  ("mlp.experts.{e}.up_proj.weight", "mlp.up", LINEAR, True),
                  ("mlp.experts.{e}.down_proj.weight", "mlp.down", LINEAR, True)],
    "mixtral": [("block_sparse_moe.gate.weight", "mlp.router", LINEAR, False),
                ("block_sparse_moe.experts.{e}.w1.weight", "mlp.gate", LINEAR, True),
                ("block_sparse_moe.experts.{e}.w3.weight", "mlp.up", LINEAR, True),
                ("block_sparse_moe.experts.{e}.w2.weight", "mlp.down", LINEAR, True)],
}
_MOE_TENSORS["qwen2_moe"] = [
    *_MOE_TENSORS["qwen3_moe"],
    ("mlp.shared_expert.gate_proj.weight", "mlp.shared_gate", LINEAR, False),
    ("mlp.shared_expert.up_proj.weight", "mlp.shared_up", LINEAR, False),
    ("mlp.shared_expert.down_proj.weight", "mlp.shared_down", LINEAR, False),
    ("mlp.shared_expert_gate.weight", "mlp.shared_expert_gate", LINEAR, False),
]


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
    ]
    if not config.is_moe:
        per_layer += [("mlp.gate_proj.weight", "mlp.gate", LINEAR),
                      ("mlp.up_proj.weight", "mlp.up", LINEAR),
                      ("mlp.down_proj.weight", "mlp.down", LINEAR)]
    per_layer.append(("input_layernorm.weight", "attn_norm.scale", COPY))
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
    if config.is_moe:
        rules += [TensorRule(layer + hf, ours, layout, True, config.num_experts if stacked else 0)
                  for hf, ours, layout, stacked in _MOE_TENSORS[config.family]]
    return rules


def expand_rules(rules: list[TensorRule], num_layers: int) -> Iterator[tuple[str, str, Layout]]:
    """(HF name, our flat path, layout) with layers numbered: "layers.3.attn.q"; a rule with
    experts gives one entry per expert, each with its `Layout.expert`."""
    for rule in rules:
        layers = range(num_layers) if rule.per_layer else [None]
        for i in layers:
            ours = rule.ours if i is None else f"layers.{i}.{rule.ours}"
            if not rule.experts:
                yield rule.hf.format(i=i), ours, rule.layout
                continue
            for e in range(rule.experts):
                yield (rule.hf.format(i=i, e=e), ours,
                       dataclasses.replace(rule.layout, expert=e))


def expert_counts(names: Iterable[str], config: DecoderConfig) -> dict[int, int]:
    """Layer index -> how many experts a checkpoint's tensor `names` hold for it (distinct
    `{e}` of the family's first per-expert tensor), for a MoE `config`; {} otherwise."""
    if not config.is_moe:
        return {}
    first = next(hf for hf, _, _, stacked in _MOE_TENSORS[config.family] if stacked)
    pattern = re.compile(re.escape("model.layers.{i}." + first).replace(
        re.escape("{i}"), r"(\d+)").replace(re.escape("{e}"), r"(\d+)") + "$")
    seen: dict[int, set[int]] = {}
    for name in names:
        match = pattern.match(name)
        if match:
            seen.setdefault(int(match.group(1)), set()).add(int(match.group(2)))
    return {layer: len(experts) for layer, experts in sorted(seen.items())}
