"""The weights loader: what `opener.open_model` (every command and the API) and
`train.state.build_model` (train, plan, checkpoint restores) call to turn a `model:` config
section into a policy and its tokenizer.

This module is the one translator of the `model:` section: `weights_path` (where the files
are), `numerics` (`param_dtype`, `compute_dtype`, `remat`, `scan_layers`, `attention` and, when
set, `rope_scaling`, the same for every source) and `decoder_config` (the architecture). `load_model` reads the weights,
`load_tokenizer` picks the tokenizer:

    random   a fresh `Decoder` of the section's architecture, seeded; the char tokenizer
    hf       a Hugging Face directory (`model.path`: config.json + *.safetensors), or a
             Hub id (`org/name`, pinned by `model.revision`) resolved from the HF cache;
             the directory's tokenizer files
    gguf     a llama.cpp GGUF file (`model.path`) and the tokenizer it carries
    smollm2  the packaged SmolLM2-135M-Instruct GGUF (`model.path` overrides the file)

With a `mesh`, each parameter goes straight into its `NamedSharding` by the logical-axis
rules (`parallel.rules`): a random init runs inside one jitted initialiser with out-shardings,
and pretrained weights are read from safetensors slice by slice with
`jax.make_array_from_callback`, so no device ever holds the whole model (an 8B model loads
onto 16 GiB chips).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxrl_llm.core.errors import ConfigError, ModelFileError
from jaxrl_llm.models.config import DecoderConfig, UnsupportedConfigError, resolve_compute_dtype
from jaxrl_llm.models.decoder import Decoder
from jaxrl_llm.models.moe_dispatch import check_expert_axis
from jaxrl_llm.parallel.mesh import expert_shards
from jaxrl_llm.parallel.rules import DEFAULT_PARAM_RULES, state_shardings
from jaxrl_llm.weights.hf import load_pretrained, read_hf_config
from jaxrl_llm.weights.hub import resolve_model_dir
from jaxrl_llm.weights.packaged import smollm2_gguf_path

WEIGHT_SOURCES = ("hf", "gguf", "smollm2")
_PATH_HINT = {"hf": "a Hugging Face directory with config.json and *.safetensors",
              "gguf": "a llama.cpp .gguf file"}


class LoadedModel(NamedTuple):
    """`load_model`'s result."""

    model: Decoder
    tokenizer: Any | None  # the tokenizer the weights file carries (GGUF sources), else None


def numerics(model_config: Any) -> dict[str, Any]:
    """The `DecoderConfig` fields the `model:` section sets for every source."""
    m = model_config

    scaling = getattr(m, "rope_scaling", None)
    aux = getattr(m, "router_aux_loss_coef", None)
    return {"param_dtype": resolve_compute_dtype(m.param_dtype),
            "compute_dtype": resolve_compute_dtype(m.compute_dtype),
            "remat": m.remat,
            "scan_layers": m.scan_layers, "attention": getattr(m, "attention", "auto"),
            "decode_layers": getattr(m, "decode_layers", "auto"),
            # model.rope_scaling replaces the weights file's (Qwen3's YaRN past 32,768)
            **({"rope_scaling": dict(scaling)} if scaling else {}),
            # mixtures of experts (a dense decoder ignores them): null keeps the file's
            **({"router_aux_loss_coef": aux} if aux is not None else {}),
            "router_z_loss_coef": getattr(m, "router_z_loss_coef", 0.0),
            "moe_dispatch": getattr(m, "moe_dispatch", "all_gather")}


def file_overrides(model_config: Any) -> dict[str, Any]:
    """`numerics`, and for a `model.rope_scaling` of YaRN the length it extends to:
    max_position_embeddings = factor × original_max_position_embeddings, as transformers'
    and vLLM's YaRN assume (Qwen3-8B: 4 × 32,768 = 131,072 over its file's 40,960)."""
    overrides = numerics(model_config)
    scaling = overrides.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) == "yarn" and scaling.get("factor"):
        overrides["max_position_embeddings"] = round(
            float(scaling["factor"]) * scaling["original_max_position_embeddings"])
    return overrides


def check_rope_scaling(scaling: Mapping[str, Any], max_position_embeddings: int) -> None:
    """A `ConfigError` naming `model.rope_scaling` when the decoder does not implement it."""
    try:
        DecoderConfig(rope_scaling=scaling, max_position_embeddings=max_position_embeddings)
    except UnsupportedConfigError as err:
        raise ConfigError(f"model.rope_scaling={dict(scaling)!r}: {err}") from None


def weights_path(model_config: Any, *, files: list[str] | None = None) -> str:
    """The file or directory the weights come from; a `ConfigError` naming `model.path`
    when a pretrained source has none."""
    m = model_config
    if m.source not in WEIGHT_SOURCES:
        raise ConfigError(f"model.source={m.source!r} has no weights file (one of "
                          f"{list(WEIGHT_SOURCES)} has)")
    if m.path is not None:
        if m.source == "hf":  # a hub id (org/name) -> its cached snapshot (weights/hub.py)

            return resolve_model_dir(str(m.path), revision=m.revision, files=files)
        return str(m.path)
    if m.source == "smollm2":
        return str(smollm2_gguf_path())
    raise ConfigError(f"model.path is not set, but model.source={m.source!r} loads its weights "
                      f"from it: set model.path to {_PATH_HINT[m.source]} (or use "
                      "model.source=random for a randomly initialised model)")


def check_weights_found(model_config: Any) -> None:
    """A `ConfigError` naming `model.path` when a pretrained source's local file or directory
    does not exist (with what its parent directory holds), before any long work starts."""
    m = model_config
    if m.source == "random":
        return
    path = weights_path(m, files=["config.json"])
    if "://" in path or Path(path).exists():
        return

    parent = Path(path).parent
    near = sorted(p.name for p in parent.iterdir())[:12] if parent.is_dir() else []
    holds = f"; {parent}/ holds: {', '.join(near)}" if near else ""
    raise ConfigError(f"model.path={m.path!r}: no such {'file' if m.source != 'hf' else 'directory'} "
                      f"({Path(path).resolve()}){holds}")


def decoder_config(model_config: Any) -> DecoderConfig:
    """The `DecoderConfig` the policy will have, without reading weights.

    Pretrained sources read their own architecture (HF `config.json`, GGUF metadata); when
    that file is not reachable from this machine (e.g. `plan` for a path that exists only on
    the pod's workers) the section's architecture fields stand in, which the paper configs
    set to the real model's values.
    """
    m = model_config
    if m.source == "random":
        return random_architecture(m)
    path = weights_path(m, files=["config.json"])  # a hub id: its config only
    if m.source == "hf" and (Path(path) / "config.json").is_file():
        return DecoderConfig.from_hf(read_hf_config(path), source=str(Path(path) / "config.json"),
                                     **file_overrides(m))
    if m.source != "hf" and Path(path).is_file():
        from jaxrl_llm.weights.gguf import gguf_hf_config

        return DecoderConfig.from_hf(gguf_hf_config(path), source=path, **file_overrides(m))
    return random_architecture(m)


def random_architecture(model_config: Any) -> DecoderConfig:
    """The `DecoderConfig` the section's own architecture keys describe (source random, or a
    pretrained file not reachable from this machine), with its numerics."""
    m = model_config
    gemma2 = m.family == "gemma2"
    return DecoderConfig(
        family=m.family, vocab_size=m.vocab_size, hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size, num_layers=m.num_layers,
        num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
        rope_theta=m.rope_theta, rms_norm_eps=m.rms_norm_eps,
        tie_embeddings=m.tie_embeddings,
        qkv_bias=m.family in ("qwen2", "qwen2_moe"), qk_norm=m.family in ("qwen3", "qwen3_moe"),
        sliding_window=m.sliding_window,
        # Gemma 2: local (sliding) attention on the even layers, global on the odd ones
        layer_types=(tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                           for i in range(m.num_layers)) if gemma2 and m.sliding_window
                     else None),
        attn_logit_softcap=50.0 if gemma2 else None,
        final_logit_softcap=30.0 if gemma2 else None,
        query_pre_attn_scalar=None, max_position_embeddings=m.max_position_embeddings,
        hidden_act="gelu_tanh" if gemma2 else "silu",
        num_experts=m.num_experts, num_experts_per_tok=m.num_experts_per_tok,
        moe_intermediate_size=m.moe_intermediate_size, norm_topk_prob=m.norm_topk_prob,
        shared_expert_intermediate_size=m.shared_expert_intermediate_size, **numerics(m))


# The `model:` keys that describe the architecture (source random builds it from them).
ARCHITECTURE_KEYS = ("family", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings",
                     "rope_theta", "rms_norm_eps", "sliding_window", "tie_embeddings")


def architecture_of(model_config: Any) -> tuple[dict[str, Any], str] | None:
    """(the architecture keys as a pretrained source's weights have them, the file they were
    read from), or None for source random or a file not reachable from this machine (then
    the section's own keys stand in, see `decoder_config`)."""
    m = model_config
    if m.source == "random":
        return None
    path = weights_path(m, files=["config.json"])
    where = str(Path(path) / "config.json") if m.source == "hf" else path
    if not Path(where).is_file():
        return None
    decoder = decoder_config(m)
    return {key: getattr(decoder, key) for key in ARCHITECTURE_KEYS}, where


def model_context(model_config: Any) -> tuple[int, str] | None:
    """(the policy's context — its max_position_embeddings after `model.rope_scaling` —, where
    that figure comes from), read without weights; None when it is not known here (a
    pretrained file not reachable from this machine whose section does not set
    model.max_position_embeddings: the stand-in default says nothing about the real model)."""
    m = model_config
    if m.source == "random":
        return m.max_position_embeddings, "model.max_position_embeddings"
    found = architecture_of(m)
    if found is not None:
        keys, where = found
        return keys["max_position_embeddings"], where + (
            ", after model.rope_scaling" if m.rope_scaling is not None else "")
    if "max_position_embeddings" in m.model_fields_set:
        return m.max_position_embeddings, "model.max_position_embeddings"
    return None


def check_fits_context(context: tuple[int, str] | None, length: int, *, what: str, fix: str,
                       random: bool = False) -> None:
    """A `ConfigError` when `length` tokens (`what`) exceed `context` (`model_context`'s
    figure and its source), naming both figures, `fix` and the key that extends the context
    (`random`: the section's model.max_position_embeddings, else model.rope_scaling)."""
    if context is None or length <= context[0]:
        return
    extend = ("raise model.max_position_embeddings" if random else
              "extend the context with model.rope_scaling (YaRN: {rope_type: yarn, factor: F, "
              "original_max_position_embeddings: N} gives F × N positions; "
              f"{length} are needed)")
    raise ConfigError(f"{what} is longer than the model's context: max_position_embeddings="
                      f"{context[0]} ({context[1]}); {fix}, or {extend}")


def random_model(config: DecoderConfig, *, seed: int = 0, mesh: Mesh | None = None,
                 rules: Mapping[str, Any] | None = None) -> Decoder:
    """A randomly initialised `Decoder`; with `mesh`, initialised inside one jitted function
    whose out-shardings put every parameter in its place (no device holds the whole model)."""

    def make() -> Decoder:
        return Decoder(config, rngs=nnx.Rngs(seed))

    if mesh is None:
        return make()

    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    shardings = state_shardings(abstract, mesh, DEFAULT_PARAM_RULES if rules is None else rules)
    state = jax.jit(lambda: nnx.state(make()), out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def load_model(model_config: Any, *, seed: int = 0, mesh: Mesh | None = None,
               rules: Mapping[str, Any] | None = None, weights: bool = True) -> LoadedModel:
    """The policy `model_config` (a `config.ModelConfig`) names, with its numerics.

    seed: the random init's seed (source random, or `weights=False`). mesh / rules: place
    every parameter straight into its sharding (default rules: the trainer's); without a
    mesh the model lives on the default device. weights=False: a random model of the same
    architecture (for `nnx.eval_shape` / `plan`; reads no weights).
    """
    m = model_config
    if mesh is not None and expert_shards(mesh) > 1:  # before any weight is read
        found = architecture_of(m)  # the weights' config file, when reachable here
        check_expert_axis(decoder_config(m).num_experts, expert_shards(mesh),
                          where=found[1] if found else f"the model: section (source {m.source})")
    if getattr(m, "routing_replay", "off") != "off" and not decoder_config(m).is_moe:
        raise ConfigError(f"model.routing_replay={m.routing_replay} replays a mixture of "
                          f"experts' routing, but model {m.path or m.source} is dense (no "
                          "experts): set model.routing_replay=off")
    if m.source == "random" or not weights:
        return LoadedModel(random_model(decoder_config(m), seed=seed, mesh=mesh, rules=rules),
                           None)
    path = weights_path(m)
    dtype = numerics(m)["param_dtype"]  # "auto" resolved for this platform
    overrides = {k: v for k, v in file_overrides(m).items() if k != "param_dtype"}
    if m.source == "hf":
        model = load_pretrained(path, dtype=dtype, mesh=mesh, rules=rules, **overrides)
        return LoadedModel(model, None)
    from jaxrl_llm.weights.gguf import load_gguf

    loaded = load_gguf(path, dtype=dtype, mesh=mesh, rules=rules, **overrides)
    return LoadedModel(loaded.model, loaded.tokenizer)


def source_tokenizer(model_config: Any) -> Any | None:
    """The tokenizer a GGUF source carries (read without dequantising any weight); None for
    sources whose tokenizer lives elsewhere (random: the char tokenizer; hf: the directory's
    tokenizer files, see `load_tokenizer`)."""
    if model_config.source not in ("gguf", "smollm2"):
        return None
    from jaxrl_llm.weights.gguf import read_gguf

    return read_gguf(weights_path(model_config))[2]


def load_tokenizer(model_config: Any, name: str | None = None) -> Any:
    """`name` (the config's `data.tokenizer`: "char", a tokenizer directory or Hub id) when
    set; else the source's own: the char tokenizer (random), the GGUF file's (gguf, smollm2;
    read without its weights) or the tokenizer files of `model.path` (hf)."""
    m = model_config
    if name == "char" or (name is None and m.source == "random"):
        from jaxrl_llm.models.tokenizer import char_tokenizer

        tok = char_tokenizer()
        if len(tok) > m.vocab_size:
            raise ConfigError(f"model.vocab_size={m.vocab_size} is smaller than the char tokenizer ({len(tok)})")
        return tok
    if name is None and m.source in ("gguf", "smollm2"):
        return source_tokenizer(m)
    if name is None and m.path is None:
        raise ConfigError("data.tokenizer (or model.path) must name a tokenizer directory")
    if name is None:
        path = weights_path(m)  # a hub id -> its cached snapshot (weights/hub.py)
    else:
        path = resolve_model_dir(str(name), key="data.tokenizer")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def check_tokenizer_fits(tokenizer: Any, vocab_size: int, *, tokenizer_from: str,
                         model_from: str) -> None:
    """A `ModelFileError` naming both files and sizes when `tokenizer` has more tokens than the
    model's embedding table: a prompt id ≥ vocab_size would embed as NaN (`jnp.take` fills
    out-of-range rows) and the model could never emit those tokens (a smaller tokenizer is
    fine: padded vocabularies)."""
    def file(where: str, name: str) -> str:  # a directory's own file, when it has one
        return str(Path(where) / name) if (Path(where) / name).is_file() else where

    size = len(tokenizer)
    if size > vocab_size:
        raise ModelFileError(
            f"tokenizer {file(tokenizer_from, 'tokenizer.json')} has {size} tokens but the "
            f"model {file(model_from, 'config.json')} has vocab_size={vocab_size}: use the "
            "tokenizer the model was trained with (data.tokenizer / --tokenizer)")


__all__ = ["ARCHITECTURE_KEYS", "LoadedModel", "architecture_of", "check_fits_context",
           "check_rope_scaling",
           "check_tokenizer_fits",
           "check_weights_found",
           "decoder_config", "file_overrides", "load_model", "load_tokenizer", "model_context",
           "numerics",
           "random_architecture", "random_model", "source_tokenizer", "weights_path"]
