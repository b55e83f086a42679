"""Where the online loop's two sides run on one host (docs/online.md § Pipeline): the first
`online.sampler_devices` devices sample, the rest train; weights move from the trainer's
sharding to the sampler's decode layout, in the sampling dtype, in memory (`Placement.publish`:
one resharding `device_put` per version)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import Mesh

from jaxrl_llm.core.errors import ConfigError
from jaxrl_llm.online.config import OnlineConfig
from jaxrl_llm.parallel.mesh import AxisSizes, make_mesh, resolve_mesh_shape
from jaxrl_llm.parallel.rules import state_shardings
from jaxrl_llm.sampling.layout import DecodeLayout, from_mesh

# Said where one device cannot be split (instead of an empty range such as "1 … 0").
ONE_DEVICE = (
    "this process has 1 device, and a split needs at least 2. On a CPU, ask XLA for several "
    "host devices before starting: XLA_FLAGS=--xla_force_host_platform_device_count=4 (they "
    "share the CPU's cores); on a GPU or TPU host each chip is a device. Or run the sides as "
    "separate processes (online.exchange: a directory both share, with online.sampler_devices: "
    "0), or sample and train in turn (online.pipeline: off)")


def check_placement(config: OnlineConfig, devices: Sequence[Any]) -> None:
    """Refuse a pipeline or a device split the loop cannot run, naming the key and the fix
    (before any model is loaded)."""
    o = config.online
    if o.pipeline == "free" and o.staleness:
        raise ConfigError(
            f"online.pipeline=free bounds the lag with online.max_staleness, not "
            f"online.staleness={o.staleness} (no fixed queue): set online.staleness: 0 and "
            "online.max_staleness, or use online.pipeline: deterministic")
    inflight_blockers = [  # (it cannot run because …, the fix)
        (o.pipeline != "free", "the other pipeline modes sample each round with fixed weights",
         "set online.pipeline: free"),
        (o.mu_source != "sampler", f"online.mu_source={o.mu_source}: a re-score would give "
         "every token the newest weights' log-probs, not those of the weights that sampled it",
         "set online.mu_source: sampler"),
        (bool(o.exchange), "online.exchange is set: rollout workers sample whole rounds with one "
         "published version", "unset online.exchange"),
        (config.generate.batching != "continuous", "generate.batching=static: weights change "
         "between decode segments of the continuous sampler", "set generate.batching: continuous"),
    ]
    for blocked, why, fix in inflight_blockers:
        if o.inflight_weights and blocked:
            raise ConfigError(f"online.inflight_weights=true cannot run: {why} ({fix})")
    if o.exchange and (o.pipeline == "off" or o.sampler_devices):
        raise ConfigError(
            f"online.exchange={o.exchange} runs the sampler in worker processes: set "
            "online.pipeline: deterministic (or free) and online.sampler_devices: 0 (now "
            f"pipeline={o.pipeline}, sampler_devices={o.sampler_devices}), or unset "
            "online.exchange")
    if o.pipeline != "off":
        if o.pipeline == "deterministic" and o.staleness < 1:
            raise ConfigError(
                "online.pipeline=deterministic needs online.staleness >= 1 (it is 0): at "
                "staleness 0 update u trains on the batch θ_u samples, so sampling cannot start "
                "before update u−1 ends and nothing can overlap. Set online.staleness: 1 (or "
                "more), or online.pipeline: off")
        if o.sampler_devices < 1 and not o.exchange:
            if len(devices) < 2:
                raise ConfigError(f"online.pipeline={o.pipeline} runs the sampler on devices of "
                                  f"its own (online.sampler_devices): {ONE_DEVICE}")
            raise ConfigError(
                f"online.pipeline={o.pipeline} runs the sampler on its own devices: set "
                f"online.sampler_devices to 1 … {len(devices) - 1} (of the {len(devices)} "
                "devices; the rest train)")
    if o.sampler_devices and jax.process_count() > 1:
        raise ConfigError("online.sampler_devices splits one host's devices; a multi-host "
                          "job runs the serial loop: set online.sampler_devices: 0")
    if o.sampler_devices and len(devices) < 2:
        raise ConfigError(f"online.sampler_devices={o.sampler_devices} splits this host's "
                          f"devices between sampler and trainer: {ONE_DEVICE}")
    if o.sampler_devices >= len(devices):
        raise ConfigError(
            f"online.sampler_devices={o.sampler_devices} covers all {len(devices)} devices and "
            "leaves none to train on: set it to at most "
            f"{len(devices) - 1} (the trainer takes the rest)")
    if o.sampler_devices:
        rest = len(devices) - o.sampler_devices
        try:
            resolve_mesh_shape(config.mesh, rest)
        except ConfigError as e:
            raise ConfigError(f"{e} (the trainer's mesh spans the {rest} devices that "
                              f"online.sampler_devices={o.sampler_devices} leaves)") from None


@dataclass(frozen=True)
class Placement:
    """The trainer's mesh and the sampler's (the same mesh when the devices are shared)."""

    trainer: Mesh
    sampler: Mesh

    @property
    def split(self) -> bool:
        return self.trainer is not self.sampler

    def sampler_layout(self, kv_heads: int | None, *, data: int | None = None,
                       tensor: int | None = None) -> DecodeLayout:
        """The sampler's decode layout over its mesh (`sampling.layout.from_mesh`; the keys'
        `generate.decode_data` × `generate.decode_tensor`), placed on its device even when it
        has one."""
        return from_mesh(self.sampler, kv_heads, data=data, tensor=tensor, placed=True)

    def publish(self, params: Any, model_state: Any, layout: DecodeLayout | None = None,
                dtype: Any = None) -> tuple[Any, Any]:
        """The weights on the sampler's devices, copied (the trainer's next step donates its
        own buffers), waited for: the caller times the trainer's pause. With the sampler's
        decode `layout` (`sampler_layout`) and sampling `dtype`, the copy is the one the
        sampler decodes with: it makes none of its own. Without: the trainer's rules."""
        if layout is not None:
            moved = (layout.place_state(params, dtype), layout.place_state(model_state, dtype))
        else:
            moved = jax.device_put((params, model_state),
                                   (state_shardings(params, self.sampler),
                                    state_shardings(model_state, self.sampler)))
        return jax.block_until_ready(moved)


def make_placement(config: OnlineConfig, devices: Sequence[Any] | None = None) -> Placement:
    """The first `online.sampler_devices` of `devices` (default: this host's) sample, the rest
    train over the `mesh:` section's mesh. The sampler's mesh takes the `mesh:` sizes too when
    they fit its devices (then it computes what the serial loop's sampler computes, bit for
    bit), else it is data-parallel over them."""
    devices = list(jax.devices() if devices is None else devices)
    check_placement(config, devices)
    k = config.online.sampler_devices
    if not k:
        mesh = make_mesh(config.mesh, devices)
        return Placement(mesh, mesh)
    try:
        sampler = make_mesh(config.mesh, devices[:k])
    except ConfigError:  # e.g. mesh.fsdp=4 on 2 sampler devices
        sampler = make_mesh(AxisSizes(), devices[:k])
    return Placement(make_mesh(config.mesh, devices[k:]), sampler)
