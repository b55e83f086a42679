"""LoRA adapters out of the model: merged into the base weights (W + (α/r)·A·B, what the HF
export writes) and as a PEFT adapter directory (`adapter_config.json` +
`adapter_model.safetensors`) that `peft.PeftModel.from_pretrained(base, dir)` loads.

PEFT stores, per targeted module, `lora_A.weight` [r, in] and `lora_B.weight` [out, r] with
ΔW = (α/r)·lora_B·lora_A in HF's [out, in] orientation. Every HF layout of a projection is
`W_hf = W_ours.reshape(in, out).T` (`hf_layout.Layout.to_hf`), so lora_A = A.reshape(in, r).T
and lora_B = B.reshape(r, out).T; the module names come from the one mapping table
(`hf_layout.tensor_rules`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx

from jaxrl_llm.core.atomic import atomic_file, atomic_write_text
from jaxrl_llm.models.decoder import Decoder
from jaxrl_llm.models.lora import ADAPTER_SUFFIX, LORA_TARGETS, delta_weight, has_adapters
from jaxrl_llm.weights.hf_layout import tensor_rules
from jaxrl_llm.weights.hf_params import _NP_DTYPES, _to_host

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the HF CausalLM


def _blocks(model: Decoder) -> list[tuple[int | None, Any]]:
    """(layer index or None for the stacked block, block module)."""
    if model.config.scan_layers:
        return [(None, model.layers)]
    return list(enumerate(model.layers))


def merge_lora(model: Decoder) -> Decoder:
    """A `Decoder` without adapters whose targeted weights are W + (α/r)·A·B (computed in
    float32, stored in W's dtype). Untargeted arrays are shared with `model`, not copied;
    a model without adapters is returned as is."""
    if not has_adapters(model):
        return model
    c = model.config
    spec = c.lora
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    layers = pure["layers"]
    blocks = [layers] if c.scan_layers else [layers[i] for i in sorted(layers)]

    def add_delta(w: jax.Array, adapter: dict[str, jax.Array], in_dims: int) -> jax.Array:
        return (w.astype(jnp.float32) + delta_weight(adapter, in_dims, spec.scale)).astype(w.dtype)

    merged = jax.jit(add_delta, static_argnums=2)  # one fused op per weight, sharding kept
    for block in blocks:
        for module in ("attn", "mlp"):
            for name, in_dims in spec.weights_of(module):
                adapter = block[module].pop(name + ADAPTER_SUFFIX)
                block[module][name] = merged(block[module][name], adapter, in_dims)
    base = c.replace(lora=None)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Decoder(base, rngs=nnx.Rngs(0))))
    nnx.replace_by_pure_dict(abstract, pure)
    return nnx.merge(graphdef, abstract)


def peft_module_names(config: Any) -> dict[tuple[str, str], str]:
    """(our module, weight) -> the HF module path with `{i}` for the layer, e.g.
    ("attn", "q") -> "model.layers.{i}.self_attn.q_proj" (from `hf_layout.tensor_rules`)."""
    by_ours = {rule.ours: rule.hf for rule in tensor_rules(config) if rule.per_layer}
    out = {}
    for module, weight, _ in LORA_TARGETS.values():
        hf = by_ours[f"{module}.{weight}"]
        out[(module, weight)] = hf.removesuffix(".weight")
    return out


def peft_tensors(model: Decoder, dtype: str | None = None
                 ) -> Iterator[tuple[str, np.ndarray]]:
    """(PEFT key, array) for every adapter: `lora_A.weight` [r, in], `lora_B.weight` [out, r]."""
    c = model.config
    spec = c.lora
    names = peft_module_names(c)
    for index, block in _blocks(model):
        for module in ("attn", "mlp"):
            for weight, _ in spec.weights_of(module):
                adapter = getattr(getattr(block, module), weight + ADAPTER_SUFFIX)
                a, b = _to_host(adapter.lora_a[...]), _to_host(adapter.lora_b[...])
                layers = range(c.num_layers) if index is None else [index]
                for i in layers:
                    ai, bi = (a[i], b[i]) if index is None else (a, b)
                    rank = ai.shape[-1]
                    key = PEFT_PREFIX + names[(module, weight)].format(i=i)
                    for part, array in (("lora_A", ai.reshape(-1, rank).T),
                                        ("lora_B", bi.reshape(rank, -1).T)):
                        array = np.ascontiguousarray(array)
                        if dtype is not None:
                            array = array.astype(_NP_DTYPES[dtype])
                        yield f"{key}.{part}.weight", array


def adapter_config(model: Decoder, base_model: str | None = None) -> dict[str, Any]:
    """PEFT's `adapter_config.json` for plain LoRA (no dropout, biases, rsLoRA or DoRA)."""
    spec = model.config.lora
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "target_modules": sorted(spec.targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


def save_peft_adapter(model: Decoder, out_dir: str | Path, *, base_model: str | None = None,
                      dtype: str | None = None) -> Path:
    """Write `adapter_config.json` + `adapter_model.safetensors` for `model`'s adapters."""
    if not has_adapters(model):
        raise ValueError("the model has no LoRA adapters to export (model.lora is not set)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = dict(peft_tensors(model, dtype))
    # safetensors creates its file 0600; atomic_file gives it the usual mode (0644 under
    # umask 022) like every other output, and renames it in whole
    with atomic_file(out / ADAPTER_WEIGHTS) as tmp:
        safetensors.numpy.save_file(tensors, str(tmp), metadata={"format": "pt"})
    config = adapter_config(model, base_model)
    atomic_write_text(out / ADAPTER_CONFIG, json.dumps(config, indent=2))
    return out


__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "adapter_config", "merge_lora",
           "peft_module_names", "peft_tensors", "save_peft_adapter"]
