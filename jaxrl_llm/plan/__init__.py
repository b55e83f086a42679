"""`jaxrl-llm plan --config X`: compile the train step for the config's full model and mesh
without weights or devices, and report what each device would hold.

The step is lowered on abstract inputs (`jax.ShapeDtypeStruct`s carrying NamedShardings, the
model from `nnx.eval_shape`, so no 8B weights are ever created) and compiled by the target's
real compiler: with `plan.platform: tpu` and the PyPI `libtpu` package (the `tpu` extra),
`jax.experimental.topologies.get_topology_desc("v5e:16x16")` gives the 256 chips of a v5e pod
to compile against from this CPU machine; otherwise `plan.num_devices` fake CPU devices stand
in (and the report says so). Numbers come from the compiled executable's
`memory_analysis()` (per-device argument / output / temp bytes) and `cost_analysis()` (FLOPs).
"""

from __future__ import annotations

import importlib.util
import math
import os
import time
from typing import Any

import jax
import numpy as np

from jaxrl_llm.config import ConfigError, ExperimentConfig
from jaxrl_llm.data.batch import Batch
from jaxrl_llm.models.attention import attention_mesh
from jaxrl_llm.models.attention import resolve as resolve_attention
from jaxrl_llm.models.config import resolve_compute_dtype
from jaxrl_llm.parallel.mesh import batch_shards, context_shards, make_mesh
from jaxrl_llm.parallel.rules import batch_sharding_tree
from jaxrl_llm.plan.report import (  # noqa: F401  (re-exported: `plan.GIB`, `plan.format_report`)
    CHIP_ICI,
    CHIP_MEMORY_GIB,
    CHIP_PEAK,
    GIB,
    ArrayInfo,
    ContextSplit,
    PlanReport,
    format_report,
)
from jaxrl_llm.train.preflight import check_rows_fit_model
from jaxrl_llm.train.state import abstract_train_state, count_params
from jaxrl_llm.train.step import make_train_step
from jaxrl_llm.weights.loading import decoder_config


class PlanOutOfMemory(RuntimeError):
    """The compiler refused the step: it needs more memory than a chip has."""


def _chip_memory(config: ExperimentConfig) -> int | None:
    if config.plan.chip_memory_gib is not None:
        return int(config.plan.chip_memory_gib * GIB)
    if config.plan.platform == "tpu" and config.plan.topology:
        gen = config.plan.topology.split(":")[0].lower()
        if gen in CHIP_MEMORY_GIB:
            return int(CHIP_MEMORY_GIB[gen] * GIB)
    return None


def _chip_peak(config: ExperimentConfig) -> tuple[float, float] | None:
    if config.plan.platform == "tpu" and config.plan.topology:
        return CHIP_PEAK.get(config.plan.topology.split(":")[0].lower())
    return None


def attention_flops(decoder: Any, batch_size: int, seq_len: int) -> float:
    """Causal self-attention matmuls of one step, forward + backward (3× forward): per layer
    and token 2 matmuls × 2·Hq·D·(keys seen), keys seen ≈ T/2 (causal) or the window."""
    c, tokens = decoder, batch_size * seq_len
    seen = [min(seq_len / 2, c.sliding_window) if local else seq_len / 2
            for local in c.sliding_layers]
    return 3.0 * sum(4.0 * c.num_heads * c.head_dim * k * tokens for k in seen)


def context_split(config: ExperimentConfig, decoder: Any, mesh: Any) -> ContextSplit | None:
    """Context parallelism's K/V traffic per chip and step (None without a "context" axis).

    Each layer all-gathers its keys and values over "context" (the chip receives (c−1)/c of
    its rows' T·Hkv·D·2 values), once in the forward pass and once more in remat's recomputed
    forward, and reduce-scatters their gradients (the same bytes) in the backward pass."""
    c = context_shards(mesh)
    if c == 1:
        return None
    rows = config.train.batch_size / batch_shards(mesh)
    t = config.train.max_seq_len
    kv = rows * t * decoder.num_kv_heads * decoder.head_dim * 2  # keys + values
    passes = 3 if config.model.remat != "none" else 2
    nbytes = decoder.num_layers * passes * kv * (c - 1) / c * np.dtype(
        decoder.compute_jnp_dtype).itemsize
    ici = CHIP_ICI.get((config.plan.topology or "").split(":")[0].lower()) \
        if config.plan.platform == "tpu" else None
    return ContextSplit(shards=c, tokens_per_chip=int(rows * t // c), collective_bytes=nbytes,
                        collective_seconds=None if ici is None else nbytes / ici)


def saved_layer_inputs(config: ExperimentConfig, decoder: Any, mesh: Any) -> float:
    """Per-device bytes of the layer inputs the backward pass needs, a lower bound on the
    activations: every layer's [rows, T/context, d] input in the compute dtype (what
    `remat: full` keeps; without remat the step keeps more), for one micro-batch."""
    micro = config.train.micro_batch_size or config.train.batch_size
    rows = max(micro // batch_shards(mesh), 1)
    tokens = rows * config.train.max_seq_len / context_shards(mesh)
    return decoder.num_layers * tokens * decoder.hidden_size * np.dtype(
        decoder.compute_jnp_dtype).itemsize


def refuse_before_compiling(config: ExperimentConfig, decoder: Any, mesh: Any,
                            state_bytes: int, topology: str) -> None:
    """`PlanOutOfMemory` without compiling when the state plus `saved_layer_inputs` (both
    lower bounds of the peak) already exceed a chip, with the figures and the keys."""
    chip = _chip_memory(config)
    floor = saved_layer_inputs(config, decoder, mesh)
    if chip is None or state_bytes + floor <= chip:
        return
    c = context_shards(mesh)
    raise PlanOutOfMemory(
        f"{config.name}: the train step cannot fit on {topology} (mesh {dict(mesh.shape)}), "
        f"refused before compiling: the state alone is {state_bytes / GIB:.2f} GiB per chip "
        f"and the {decoder.num_layers} layer inputs the backward pass keeps "
        f"({config.train.max_seq_len:,} tokens per row / mesh.context={c}, "
        f"{max((config.train.micro_batch_size or config.train.batch_size) // batch_shards(mesh), 1)} "
        f"row(s) per chip per micro-batch) {floor / GIB:.2f} GiB, over the chip's "
        f"{chip / GIB:.2f} GiB. Raise mesh.context (splits each row's tokens; 2 × context "
        "must divide train.max_seq_len), lower train.micro_batch_size or train.max_seq_len, "
        "or raise mesh.fsdp.")


def inactive_expert_params(decoder: Any) -> int:
    """Parameters a token does not use: the experts it is not routed to (E − k of each
    layer's E SwiGLU experts, 3·d·F each); 0 for a dense decoder."""
    if not decoder.is_moe:
        return 0
    per_expert = 3 * decoder.hidden_size * decoder.moe_intermediate_size
    return decoder.num_layers * per_expert * (decoder.num_experts - decoder.num_experts_per_tok)


def libtpu_available() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def _tpu_devices(topology: str) -> list[Any]:
    # libtpu looks for a TPU VM's metadata; these two variables tell it there is none to find.
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # Compiling needs no TPU, so do not wait for /tmp/libtpu_lockfile, which any other JAX
    # process on this machine started without JAX_PLATFORMS=cpu holds.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    except Exception as err:  # libtpu raises plain RuntimeErrors for unknown names
        raise ConfigError(f"plan.topology={topology!r}: libtpu rejected it: {err}") from err
    return list(topo.devices)


def _needed_devices(config: ExperimentConfig) -> int:
    if config.plan.num_devices is not None:
        return config.plan.num_devices
    sizes = [config.mesh.data, config.mesh.fsdp, config.mesh.tensor, config.mesh.context,
             config.mesh.expert]
    if -1 in sizes:
        raise ConfigError(
            "plan on CPU: mesh has a -1 axis, so set plan.num_devices to say how many devices "
            "to plan for"
        )
    online = getattr(config, "online", None)
    extra = online.sampler_devices if online is not None else 0  # the sampler's own devices
    return math.prod(sizes) + extra


def select_devices(config: ExperimentConfig) -> tuple[list[Any], str, str | None]:
    """(devices, topology label, fallback note)."""
    pc = config.plan
    if pc.platform == "tpu":
        if not pc.topology:
            raise ConfigError("plan.platform=tpu needs plan.topology, e.g. v5e:16x16")
        if libtpu_available():
            return _tpu_devices(pc.topology), pc.topology, None
        note = (f"libtpu is not installed (pip install 'jaxrl_llm[tpu]'): compiled for fake "
                f"CPU devices instead of {pc.topology}; memory and FLOPs are the CPU "
                "compiler's estimates")
    else:
        note = None
    need = _needed_devices(config) if pc.platform == "cpu" or not pc.topology else _tpu_count(
        pc.topology)
    cpus = jax.devices("cpu")
    if len(cpus) < need:
        raise ConfigError(
            f"plan needs {need} devices but this process has {len(cpus)} CPU devices; run "
            f"`jaxrl-llm plan` in a fresh process (it sets XLA_FLAGS="
            f"--xla_force_host_platform_device_count={need}) or lower plan.num_devices"
        )
    return cpus[:need], f"cpu×{need}", note


def _tpu_count(topology: str) -> int:
    dims = topology.split(":")[-1].split("x")
    try:
        return math.prod(int(d) for d in dims)
    except ValueError:
        raise ConfigError(f"plan.topology={topology!r} is not of the form v5e:16x16") from None


def abstract_batch(config: ExperimentConfig, mesh: Any) -> Any:
    """The global batch as ShapeDtypeStructs with the step's batch shardings and token order."""
    b, t = config.train.batch_size, config.train.max_seq_len
    pairs = b // 2 if config.loss.spec.needs_pairs else 0
    # Packed rows (data.pack) carry k record slots each: per-record arrays are [B·k].
    r = b * config.data.records_per_row if config.data.pack else b
    shapes: dict[str, tuple[tuple[int, ...], Any]] = {
        "inputs": ((b, t), np.int32), "targets": ((b, t), np.int32),
        "positions": ((b, t), np.int32), "segment_ids": ((b, t), np.int32),
        "loss_mask": ((b, t), np.float32), "behavior_logprobs": ((b, t), np.float32),
        "mu_logprobs": ((b, t), np.float32), "ref_logprobs": ((b, t), np.float32),
        "rewards": ((r,), np.float32), "correct": ((r,), np.bool_),
        "group_ids": ((r,), np.int32), "record_mask": ((r,), np.float32),
        "pair_index": ((pairs, 2), np.int32),
    }
    shardings = batch_sharding_tree(mesh)
    return Batch(**{
        name: jax.ShapeDtypeStruct(shape, dtype, sharding=getattr(shardings, name))
        for name, (shape, dtype) in shapes.items()
    }, context_order=shardings.context_order)  # the mesh's token order


def _path_str(path: Any) -> str:
    parts = []
    for k in path:
        key = getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
        if key == "value":
            continue
        parts.append(str(key))
    return ".".join(parts)


def _array_infos(state: Any) -> tuple[list[ArrayInfo], dict[str, int]]:
    """(every state array, largest first; per-device bytes of each state section)."""
    infos = []
    sections: dict[str, int] = {}
    for section in ("params", "opt_state", "ref_params", "model_state"):
        tree = getattr(state, section)
        if tree is None:
            continue
        total_device = 0
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            itemsize = np.dtype(leaf.dtype).itemsize
            shard = leaf.sharding.shard_shape(leaf.shape)
            device_bytes = int(math.prod(shard)) * itemsize
            total_device += device_bytes
            infos.append(ArrayInfo(
                path=f"{section}.{_path_str(path)}", shape=tuple(leaf.shape),
                dtype=str(np.dtype(leaf.dtype)), spec=str(leaf.sharding.spec),
                global_bytes=int(math.prod(leaf.shape)) * itemsize, device_bytes=device_bytes,
            ))
        sections[section] = total_device
    infos.sort(key=lambda a: -a.global_bytes)
    return infos, sections


def make_plan(config: ExperimentConfig, *, top: int = 8) -> PlanReport:
    """Lower and compile the config's train step on abstract inputs; see the module doc."""
    check_rows_fit_model(config)  # a row past the model's context, before building anything
    devices, topology, note = select_devices(config)
    # "auto" dtypes resolve for the target's platform, not this CPU's.
    model = config.model.model_copy(update={
        key: resolve_compute_dtype(getattr(config.model, key), devices[0].platform)
        for key in ("param_dtype", "compute_dtype")})
    config = config.model_copy(update={"model": model})
    if config.plan.sampler_topology and config.plan.platform == "tpu" and libtpu_available():
        # the sampler on a slice of its own: the whole of plan.topology trains
        sampler_devices = _tpu_devices(config.plan.sampler_topology)
        topology += f" + sampler {config.plan.sampler_topology}"
    else:
        sampler_devices, devices = split_devices(config, devices)
    mesh = make_mesh(config.mesh, devices)
    state = abstract_train_state(config, mesh)
    decoder = decoder_config(config.model)
    refuse_before_compiling(config, decoder, mesh, sum(_array_infos(state)[1].values()),
                            topology)
    sampler_mesh = None
    if sampler_devices is not None:  # a decode layout that cannot be, refused before compiling
        from jaxrl_llm.sampling.layout import from_mesh

        sampler_mesh = mesh if sampler_devices is devices else sampler_mesh_for(
            config, list(sampler_devices))
        from_mesh(sampler_mesh, decoder.num_kv_heads, data=config.generate.decode_data,
                  tensor=config.generate.decode_tensor)
    batch = abstract_batch(config, mesh)
    step = make_train_step(config, mesh, state)
    start = time.perf_counter()
    with attention_mesh(mesh):  # "auto" attention resolves for the mesh's platform
        lowered = step.lower(state, batch)
        impl = resolve_attention(decoder.attention, dtype=decoder.compute_jnp_dtype,
                                 logit_softcap=decoder.attn_logit_softcap,
                                 context=context_shards(mesh) > 1)
    try:
        compiled = lowered.compile()
    except Exception as err:  # XLA raises JaxRuntimeError; only memory exhaustion is a result
        if "RESOURCE_EXHAUSTED" not in str(err):
            raise
        raise PlanOutOfMemory(
            f"{config.name}: the train step does not fit on {topology} "
            f"(mesh {dict(mesh.shape)}): {str(err).splitlines()[0]}\n"
            "Try model.remat=full, a smaller train.micro_batch_size, a larger mesh.fsdp, a "
            "larger mesh.context (splits each row's tokens), model.scan_layers=true or a "
            "smaller loss.logprob_chunk_size."
        ) from None
    seconds = time.perf_counter() - start
    sampler = None
    if sampler_mesh is not None:
        from jaxrl_llm.plan.sampler import make_sampler_plan

        try:
            sampler = make_sampler_plan(config, decoder, sampler_mesh, _chip_memory(config))
        except Exception as err:  # XLA's JaxRuntimeError
            if "limited ICI routing" not in str(err):
                raise
            raise ConfigError(
                f"online.sampler_devices={len(sampler_mesh.devices.flat)} splits the "
                f"{config.plan.topology} slice, and the TPU compiler compiles a program only "
                "over a whole slice of this generation (it refused: device assignment should "
                "include all slice devices). On such a pod the sampler runs on a slice of its "
                "own (online.exchange rollout workers, launch/tpu_pipeline.sh): set "
                "plan.sampler_topology to that slice (e.g. v5e:8x8) and plan.topology to the "
                "trainer's") from None
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    infos, sections = _array_infos(state)
    n_params = count_params(state.params)
    frozen = count_params(state.model_state)  # the frozen base under LoRA; else ≈ 0
    # a mixture of experts: a token's matmuls use only its k experts' weights
    active = n_params + frozen - inactive_expert_params(decoder)
    tokens = config.train.batch_size * config.train.max_seq_len
    if impl == "splash" and config.train.max_seq_len // context_shards(mesh) % 128:
        impl = "jnp"  # models/attention.py: the kernel tiles 128-multiple sequences per device
    attn = attention_flops(decoder, config.train.batch_size, config.train.max_seq_len)
    # remat=full recomputes the forward in the backward pass: 8·N·tokens instead of 6.
    recompute = 4 / 3 if config.model.remat == "full" else 1.0
    return PlanReport(
        config_name=config.name,
        platform=devices[0].platform,
        topology=topology,
        num_devices=len(devices),
        fallback_note=note,
        mesh=dict(mesh.shape),
        batch={"batch_size": config.train.batch_size, "seq_len": config.train.max_seq_len,
               "micro_batch_size": config.train.micro_batch_size or config.train.batch_size},
        num_params=n_params,
        compile_seconds=seconds,
        argument_bytes=int(mem.argument_size_in_bytes),
        output_bytes=int(mem.output_size_in_bytes),
        alias_bytes=int(mem.alias_size_in_bytes),
        temp_bytes=int(mem.temp_size_in_bytes),
        code_bytes=int(mem.generated_code_size_in_bytes),
        state_bytes_per_device=sum(sections.values()),
        flops_per_device=float(cost.get("flops", float("nan"))),
        model_flops_6nd=6.0 * active * tokens,
        active_params=active if decoder.is_moe else None,
        chip_memory_bytes=_chip_memory(config),
        largest=infos[:top],
        frozen_params=frozen,
        lora=None if config.model.lora is None else config.model.lora.model_dump(),
        section_bytes=sections,
        attention=impl,
        pallas_kernels=compiled.as_text().count("tpu_custom_call"),
        bytes_accessed_per_device=float(cost.get("bytes accessed", float("nan"))),
        attention_flops=attn,
        hardware_flops=recompute * (6.0 * active * tokens + attn),
        chip_peak=_chip_peak(config),
        context=context_split(config, decoder, mesh),
        sampler=sampler,
        sampler_split=sampler_devices is not None and sampler_devices is not devices,
    )


def split_devices(config: ExperimentConfig, devices: list[Any]) -> tuple[list[Any] | None,
                                                                        list[Any]]:
    """(the sampler's devices, or None when `plan.sampler` does not plan it; the trainer's).
    With `online.sampler_devices: k` the first k devices sample and the rest train, as
    `online.placement.make_placement` splits them; otherwise both share all of them."""
    online = getattr(config, "online", None)
    wanted = config.plan.sampler == "on" or (config.plan.sampler == "auto" and online is not None)
    k = getattr(online, "sampler_devices", 0) if online is not None else 0
    if k and k >= len(devices):
        raise ConfigError(f"online.sampler_devices={k} leaves none of the {len(devices)} "
                          "devices to train on")
    if not wanted:
        return None, devices
    return (devices[:k], devices[k:]) if k else (devices, devices)


def sampler_mesh_for(config: ExperimentConfig, devices: list[Any]) -> Any:
    """The sampler's own mesh over its devices: the `mesh:` sizes when they fit them, else
    all data-parallel (as `make_placement` builds it)."""
    from jaxrl_llm.parallel.mesh import AxisSizes

    try:
        return make_mesh(config.mesh, devices)
    except ConfigError:
        return make_mesh(AxisSizes(), devices)


def host_device_count(config: ExperimentConfig) -> int | None:
    """How many fake CPU devices stand in for the target when compiling (None: compile for
    real TPU chips with `libtpu`)."""
    if config.plan.platform != "cpu" and libtpu_available():
        return None
    return (config.plan.num_devices or _tpu_count(config.plan.topology)
            if config.plan.platform == "tpu" else _needed_devices(config))
