"""Where the continuous sampler's arrays live on the devices: the decode layout.

Decode has its own layout, separate from training's (in the spirit of MaxText's
`rollout_data_parallelism` / `rollout_tensor_parallelism`, and of vLLM's data × tensor
parallel engines):

- **slot parallelism** over the `slot_axes`: the decode slots, the shared prompt store's rows
  and the staging rows are split into `groups` equal parts, one per slot shard. A slot only
  ever reads a store row of its own group (the driver schedules it so, `continuous.py`), so a
  decode step needs no communication between groups: each device decodes its own slots over its
  own part of the KV cache;
- **tensor parallelism** over `tensor_axis`: KV heads, and the weights' head, MLP and vocabulary
  dimensions (Megatron-style; the weights' "embed" dimension is replicated: FSDP is a training
  layout and would all-gather every layer's weights at every decode step).

The default layout is derived from the mesh the model's weights live on (`from_model`): its
"tensor" axis stays the tensor axis (when it divides the KV heads), and every other axis
("data", "fsdp", "context") becomes slot parallelism. `generate.decode_data` ×
`generate.decode_tensor` choose another split of the same devices. The weights move from the
trainer's sharding to this layout by one resharding copy per weight version (`place_state`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm.core.errors import ConfigError
from jaxrl_llm.parallel.rules import DEFAULT_PARAM_RULES, state_shardings

Array = jax.Array
TENSOR = "tensor"
SLOT = "data"  # the slot-parallel axis of a mesh `DecodeLayout.build` makes

# Decode's parameter rules: training's, with "embed" replicated (no FSDP gathers per step).
DECODE_PARAM_RULES = {**DEFAULT_PARAM_RULES, "embed": None}


@dataclasses.dataclass(frozen=True)
class DecodeLayout:
    """A mesh and how decode uses its axes (module docstring). `mesh` None: unplaced (arrays
    on the default device, as a model without a mesh). Hashable: a static argument of the
    compiled slot programs."""

    mesh: Mesh | None = None
    slot_axes: tuple[str, ...] = ()
    tensor_axis: str | None = None

    @property
    def groups(self) -> int:
        """Slot shards: the product of the slot axes' sizes."""
        if self.mesh is None:
            return 1
        return int(math.prod(self.mesh.shape[a] for a in self.slot_axes))

    @property
    def tensor(self) -> int:
        if self.mesh is None or self.tensor_axis is None:
            return 1
        return int(self.mesh.shape[self.tensor_axis])

    @property
    def devices(self) -> int:
        return 1 if self.mesh is None else int(self.mesh.devices.size)

    def describe(self) -> str:
        return f"{self.groups} slot group(s) × tensor {self.tensor} over {self.devices} device(s)"

    # ---- shardings --------------------------------------------------------------------------
    def _rows(self) -> Any:
        return None if not self.slot_axes or self.groups == 1 else self.slot_axes

    def kv_spec(self, ndim: int) -> P:
        """A KV buffer ([L,] rows, Hkv, ·, ·): rows over the slot axes, heads over tensor."""
        heads = self.tensor_axis if self.tensor > 1 else None
        return P(*([None] * (ndim - 4)), self._rows(), heads, None, None)

    def leaf_spec(self, path: Sequence[Any], leaf: Any) -> P:
        """Every array of the sampler's carry, store and staging area has its rows first,
        except the KV buffers (under a "k" / "v" key: rows fourth from last) and scalars."""
        ndim = len(getattr(leaf, "shape", ()))
        keys = {str(getattr(k, "key", getattr(k, "name", ""))) for k in path}
        if ndim >= 4 and keys & {"k", "v", "own"}:
            return self.kv_spec(ndim)
        return P() if ndim == 0 else P(self._rows())

    def shardings(self, tree: Any) -> Any:
        """NamedShardings for `tree` (`leaf_spec`), or None when unplaced."""
        if self.mesh is None:
            return None
        return jax.tree_util.tree_map_with_path(
            lambda path, leaf: NamedSharding(self.mesh, self.leaf_spec(path, leaf)), tree)

    def constrain(self, tree: Any) -> Any:
        """`tree` constrained to its layout inside a compiled program (unplaced: unchanged)."""
        if self.mesh is None:
            return tree
        return jax.lax.with_sharding_constraint(tree, self.shardings(tree))

    def make(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` built directly in its layout (each device allocates only its shards:
        a pod's cache is never whole on one device)."""
        if self.mesh is None:
            return fn(*args)
        shapes = jax.eval_shape(fn, *args)
        return jax.jit(fn, out_shardings=self.shardings(shapes))(*args)

    def put(self, value: np.ndarray) -> Array:
        """A host array (the driver's tables) as a global array split by rows (scalars
        replicated); every process passes the same value."""
        value = np.asarray(value)
        if self.mesh is None:
            return jax.numpy.asarray(value)
        sharding = NamedSharding(self.mesh, P() if value.ndim == 0 else P(self._rows()))
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    # ---- grouped gathers --------------------------------------------------------------------
    def split(self, x: Array, axis: int = 0) -> Array:
        """x with its `axis` (rows of every group, group-major) split into [groups, rows/group]
        (the group axis where `axis` was), constrained to the slot axes."""
        g = self.groups
        shape = x.shape[:axis] + (g, x.shape[axis] // g) + x.shape[axis + 1:]
        y = x.reshape(shape)
        if self.mesh is None or g == 1:
            return y
        spec = [P.UNCONSTRAINED] * y.ndim  # the other dims keep theirs (heads on tensor)
        spec[axis] = self.slot_axes
        spec[axis + 1] = None
        return jax.lax.with_sharding_constraint(y, NamedSharding(self.mesh, P(*spec)))

    def merge(self, x: Array, axis: int = 0) -> Array:
        """`split`'s inverse."""
        return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])

    def local(self, rows: Array, count: int) -> Array:
        """Global row indices of a `count`-row table (group-major) as indices within their
        group's rows; out of range (≥ count: none) → count / groups (out of range too)."""
        per = count // self.groups
        return jax.numpy.where((rows >= 0) & (rows < count), rows % per, per)

    def take(self, table: Array, rows: Array) -> Array:
        """`table[rows]` along axis 0 where each row of `rows` [R] (group-major, R a multiple of
        the groups) reads a row of its own group of `table` (out of range: clipped): a gather
        within each device's shard."""
        rows = jax.numpy.clip(rows, 0, table.shape[0] - 1)
        if self.groups == 1:
            return jax.numpy.take(table, rows, axis=0)
        local = self.local(rows, table.shape[0])
        out = jax.vmap(lambda t, r: jax.numpy.take(t, r, axis=0))(self.split(table),
                                                                  self.split(local))
        return self.merge(out)

    # ---- weights ----------------------------------------------------------------------------
    def weight_shardings(self, state: Any) -> Any:
        """Where the model's `nnx` state lives for decode (`DECODE_PARAM_RULES` over this
        mesh: heads, MLP and vocabulary over tensor, the rest replicated); None unplaced."""
        if self.mesh is None:
            return None
        return state_shardings(state, self.mesh, DECODE_PARAM_RULES)

    def place_state(self, state: Any, dtype: Any = None) -> Any:
        """The model's `nnx` state in this layout (one resharding device-to-device copy; none
        when it is there already), its float arrays cast to `dtype` when given (the sampling
        dtype, `sampling_dtype`: the trainer's float32 masters are not what a bf16 model
        decodes with; only ≥ 2-D float weights are cast, `castable`)."""
        # Cast on the source devices first: only the lean copy crosses devices.
        state = cast_for_sampling(state, dtype)
        if self.mesh is None:
            return state
        return jax.device_put(state, self.weight_shardings(state))


def cast_for_sampling(tree: Any, dtype: Any) -> Any:
    """`tree` with its `castable` weights cast to the sampling `dtype` on their own devices
    (no value the model computes with changes); `dtype` None: as is."""
    if dtype is None:
        return tree
    dtype = jax.numpy.dtype(dtype)
    return jax.tree.map(lambda a: a.astype(dtype) if castable(a, dtype) else a, tree)


def castable(a: Any, dtype: Any) -> bool:
    """A weight matrix (≥ 2-D float) wider than the sampling dtype: the model casts it to its
    compute dtype at every use, so casting it once first changes no value. Norm scales and
    biases (1-D) stay: RMSNorm reads its scale in float32."""
    return (getattr(a, "ndim", 0) >= 2 and jax.numpy.issubdtype(a.dtype, jax.numpy.floating)
            and a.dtype.itemsize > dtype.itemsize)


def sampling_dtype(model: Any) -> Any:
    """The dtype the model's weights are read in while decoding: its compute dtype."""
    config = getattr(model, "config", None)
    return getattr(config, "compute_jnp_dtype", None)


def model_mesh(model: Any) -> Mesh | None:
    """The mesh the model's weights live on (None: unplaced or on one device)."""
    for leaf in jax.tree.leaves(nnx.state(model)):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh.devices.size > 1:
            return sharding.mesh
    return None


def build_layout(devices: Sequence[Any], *, data: int, tensor: int) -> DecodeLayout:
    """A layout over `devices`: `data` slot groups × `tensor` (a new ("data", "tensor") mesh,
    tensor on neighbouring devices)."""
    grid = np.asarray(list(devices), dtype=object).reshape(data, tensor)
    mesh = Mesh(grid, (SLOT, TENSOR), axis_types=(AxisType.Auto,) * 2)
    return DecodeLayout(mesh, (SLOT,), TENSOR)


def from_model(model: Any, *, data: int | None = None, tensor: int | None = None,
               keys: tuple[str, str] = ("generate.decode_data", "generate.decode_tensor"),
               ) -> DecodeLayout:
    """The decode layout for `model`: `from_mesh` over the mesh its weights live on."""
    config = getattr(model, "config", None)
    return from_mesh(model_mesh(model), getattr(config, "num_kv_heads", None), data=data,
                     tensor=tensor, keys=keys)


def from_mesh(mesh: Mesh | None, kv_heads: int | None, *, data: int | None = None,
              tensor: int | None = None,
              keys: tuple[str, str] = ("generate.decode_data", "generate.decode_tensor"),
              placed: bool = False) -> DecodeLayout:
    """The decode layout over `mesh`'s devices (module docstring): derived from the mesh, or
    `data` × `tensor`. Refuses (ConfigError naming `keys`) a layout larger than those devices,
    one that leaves devices idle, and a tensor size that does not divide the `kv_heads`.
    `placed`: on a one-device mesh too, a layout on that device (a publish or a plan must name
    where the arrays go), where the sampler's own is unplaced (the default device)."""
    layout = _from_mesh(mesh, kv_heads, data=data, tensor=tensor, keys=keys)
    if placed and layout.mesh is None and mesh is not None:
        return DecodeLayout(mesh, tuple(mesh.axis_names), None)
    return layout


def _from_mesh(mesh: Mesh | None, kv_heads: int | None, *, data: int | None,
               tensor: int | None, keys: tuple[str, str]) -> DecodeLayout:
    devices = [] if mesh is None else list(mesh.devices.flat)
    count = max(1, len(devices))
    if data is None and tensor is None:
        if mesh is None:
            return DecodeLayout()
        t = int(mesh.shape.get(TENSOR, 1))
        if kv_heads is not None and kv_heads % t:
            t = 1  # heads not divisible: the tensor axis samples slots too (default only)
        slot_axes = tuple(a for a in mesh.axis_names if a != TENSOR or t == 1)
        return DecodeLayout(mesh, slot_axes, TENSOR if t > 1 else None)
    key_d, key_t = keys
    tensor = 1 if tensor is None else tensor
    data = count // tensor if data is None else data
    if data < 1 or tensor < 1:
        raise ConfigError(f"{key_d}={data}, {key_t}={tensor}: decode layout sizes must be >= 1")
    if data * tensor > count:
        raise ConfigError(
            f"{key_d}={data} × {key_t}={tensor} = {data * tensor} devices, more than the "
            f"{count} the sampler has (its model's mesh); lower them so they multiply to {count}")
    if data * tensor < count:
        raise ConfigError(
            f"{key_d}={data} × {key_t}={tensor} = {data * tensor} devices would leave "
            f"{count - data * tensor} of the sampler's {count} devices idle; choose sizes "
            f"that multiply to {count}")
    if kv_heads is not None and kv_heads % tensor:
        raise ConfigError(
            f"{key_t}={tensor} does not divide the model's {kv_heads} KV heads "
            f"(model.num_kv_heads): choose a divisor of {kv_heads}")
    if count == 1:
        return DecodeLayout()
    return build_layout(devices, data=data, tensor=tensor)


def check_slots(layout: DecodeLayout, slots: int, *, key: str) -> None:
    """Refuse `slots` decode slots that the layout's groups do not divide."""
    if slots % layout.groups:
        raise ConfigError(
            f"{slots} decode slots ({key} × n) do not split over the {layout.groups} slot "
            f"groups of the decode layout ({layout.describe()}): choose {key} so that "
            f"{key} × n is a multiple of {layout.groups}, or set generate.decode_data")
