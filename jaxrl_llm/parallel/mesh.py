"""Device meshes with the axes ("data", "fsdp", "tensor") from the `mesh:` config section, and
("data", "fsdp", "context", "tensor") when `mesh.context` > 1 (the sequence split over
"context": context parallelism, `parallel/context.py`), with "expert" before "tensor" when
`mesh.expert` > 1 (a mixture of experts' experts split over it, and the batch's rows too:
expert parallelism, `models/moe_dispatch.py`).

The same code builds a 1-device mesh on a laptop, an 8-device mesh over fake CPU devices in the
tests, a 256-chip mesh over a TPU topology description for `plan`, and the global mesh of a
multi-host job (after `parallel.distributed.initialize`, `jax.devices()` lists every host's
devices).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxrl_llm.core.errors import ConfigError

MESH_AXES: tuple[str, str, str] = ("data", "fsdp", "tensor")
# The sequence axis of context parallelism: a mesh has it only when its size is > 1, so every
# mesh without it keeps the three axes above (and its shardings, plans and tests).
CONTEXT_AXIS = "context"
# The expert-parallel axis: a mesh has it only when its size is > 1 (as "context").
EXPERT_AXIS = "expert"
# Axes a batch's leading (row) dimension is split over: every data-parallel replica and every
# FSDP shard sees different rows (ZeRO-3 style); "tensor" shards see the same rows. A mesh
# with an "expert" axis splits rows over it too (`batch_axes`): outside the experts its
# devices are data-parallel, as in MaxText.
BATCH_AXES: tuple[str, str] = ("data", "fsdp")


class MeshSizes(Protocol):
    """The sizes this module reads (the `mesh:` config section has them): -1 = the rest.
    `context` and `expert` are optional (read with a default of 1)."""

    data: int
    fsdp: int
    tensor: int


@dataclass(frozen=True)
class AxisSizes:
    """Plain `MeshSizes` for a mesh a pass builds itself, not from a `mesh:` config section."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    context: int = 1
    expert: int = 1


def mesh_axes(config: MeshSizes) -> tuple[str, ...]:
    """The mesh's axis names: `MESH_AXES`, with "context" and then "expert" before "tensor"
    when their sizes are > 1."""
    optional = tuple(axis for axis in (CONTEXT_AXIS, EXPERT_AXIS)
                     if getattr(config, axis, 1) != 1)
    return ("data", "fsdp", *optional, "tensor")


def resolve_mesh_shape(config: MeshSizes, num_devices: int) -> tuple[int, ...]:
    """Sizes of `mesh_axes(config)` (("data", "fsdp", "tensor") unless `context` or `expert`
    > 1); at most one may be -1 and takes the rest ("context" and "expert" may not be -1).

    Raises `ConfigError` naming the `mesh.*` keys when the sizes do not multiply to
    `num_devices`.
    """
    for axis in (CONTEXT_AXIS, EXPERT_AXIS):
        size = getattr(config, axis, 1)
        if size < 1:
            raise ConfigError(f"mesh.{axis}={size}: the {axis} axis size must be ≥ 1")
    sizes = {axis: getattr(config, axis) for axis in mesh_axes(config)}
    for axis, size in sizes.items():
        if size == 0 or size < -1:
            raise ConfigError(f"mesh.{axis}={size}: a mesh axis size must be ≥ 1 or -1 (the rest)")
    free = [axis for axis, size in sizes.items() if size == -1]
    if len(free) > 1:
        raise ConfigError(
            f"mesh: only one axis may be -1, got {', '.join(f'mesh.{a}=-1' for a in free)}"
        )
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if free:
        if num_devices % fixed:
            raise ConfigError(
                f"mesh: {_describe(sizes)} — the fixed axes multiply to {fixed}, which does not "
                f"divide the {num_devices} available devices, so mesh.{free[0]}=-1 cannot be "
                "resolved"
            )
        sizes[free[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ConfigError(
            f"mesh: {_describe(sizes)} multiply to {fixed} but there are {num_devices} devices; "
            "the sizes must multiply to the device count (set one axis to -1 to take the rest)"
        )
    return tuple(sizes.values())


def _describe(sizes: dict[str, int]) -> str:
    return ", ".join(f"mesh.{axis}={size}" for axis, size in sizes.items())


def make_mesh(config: MeshSizes, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `Mesh` with axes `mesh_axes(config)` over `devices` (default: all devices).

    Axes are `AxisType.Auto` (GSPMD propagation): jax 0.10's default Explicit axes make an
    embedding gather fail with a ShardingTypeError.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_mesh_shape(config, len(devices))
    try:
        # Topology-aware order: "tensor" (the chattiest axis) on the closest chips, then
        # "context" (a K/V all-gather per layer).
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, devices=devices, allow_split_physical_axes=True)
    except (ValueError, RuntimeError, AssertionError):  # unknown device kinds: plain order
        grid = np.asarray(devices, dtype=object).reshape(shape)
    names = mesh_axes(config)
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def batch_axes(mesh: Mesh | None) -> tuple[str, ...]:
    """The axes a batch's rows are split over: `BATCH_AXES`, and "expert" when the mesh has
    that axis (module docstring)."""
    if expert_shards(mesh) > 1:
        return (*BATCH_AXES, EXPERT_AXIS)
    return BATCH_AXES


def batch_shards(mesh: Mesh) -> int:
    """How many ways a batch's rows are split (data × fsdp, × expert when present)."""
    return int(math.prod(mesh.shape[axis] for axis in batch_axes(mesh)))


def expert_shards(mesh: Mesh | None) -> int:
    """How many ways a mixture of experts' experts are split (the "expert" axis; 1 without)."""
    return 1 if mesh is None else int(dict(mesh.shape).get(EXPERT_AXIS, 1))


def context_shards(mesh: Mesh | None) -> int:
    """How many ways the sequence is split (the "context" axis; 1 without one)."""
    return 1 if mesh is None else int(dict(mesh.shape).get(CONTEXT_AXIS, 1))


def describe_mesh(mesh: Mesh) -> str:
    """`data=2 fsdp=4 tensor=1 (8 cpu devices)`."""
    kinds = {d.platform for d in mesh.devices.flat}
    axes = " ".join(f"{name}={size}" for name, size in mesh.shape.items())
    return f"{axes} ({mesh.devices.size} {'/'.join(sorted(kinds))} devices)"
