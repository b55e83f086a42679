"""Logical-axis → mesh-axis rules: where every parameter, optimizer-state leaf and batch
array lives on the ("data", "fsdp", "tensor") mesh.

Models annotate each parameter with logical axis names (`nnx.with_partitioning` / the
`out_sharding` metadata): "vocab", "embed", "q_heads", "kv_heads", "head_dim", "mlp",
"norm", "layers". The rules below map them to mesh axes:

- "embed" → "fsdp" (and "context" on a context-parallel mesh): every weight matrix is split
  along d_model over the FSDP axis (ZeRO-3: parameters, gradients and optimizer state are all
  1/fsdp per device; XLA all-gathers a layer's weights just before use). The "context" shards
  see different tokens of the same rows, so they shard the state like FSDP shards do.
- "vocab", "q_heads", "kv_heads", "mlp" → "tensor": Megatron-style tensor parallelism.
- "experts" (a mixture of experts' expert dimension) → "expert": expert parallelism; on a
  mesh with that axis "embed" is split over it too (after "fsdp"), since its devices see
  different rows outside the experts, like FSDP shards (an expert weight's "embed" then
  takes only "fsdp": "expert" is already used by its expert dimension).
- "head_dim", "norm", "layers" → replicated.

A mesh axis is dropped for a dimension it does not divide (e.g. 3 KV heads on tensor=2) or
when it is already used by an earlier dimension of the same array, so every rule set is valid
for every model; `plan` reports the resulting shardings of the largest arrays.
Optimizer-state leaves take the sharding of the parameter they belong to (Adafactor's
factored row/column statistics drop the factored dimension's entry).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm.parallel.mesh import CONTEXT_AXIS, batch_axes, batch_shards, context_shards

MeshAxes = str | tuple[str, ...] | None

DEFAULT_PARAM_RULES: dict[str, MeshAxes] = {
    "vocab": "tensor",
    "embed": ("fsdp", "context", "expert"),
    "experts": "expert",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "norm": None,
    "layers": None,
}


def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def logical_to_mesh_spec(
    logical: Sequence[str | None] | None,
    shape: Sequence[int],
    mesh: Mesh,
    rules: Mapping[str, MeshAxes] = DEFAULT_PARAM_RULES,
) -> P:
    """PartitionSpec for an array of `shape` annotated with `logical` axis names.

    Unknown logical names raise (a typo in a model annotation must not silently replicate a
    large matrix); mesh axes that do not divide the dimension, that an earlier dimension
    already uses, or that the mesh does not have ("context" without context parallelism), are
    dropped.
    """
    if not logical:
        return P()
    if len(logical) != len(shape):
        raise ValueError(
            f"logical axes {tuple(logical)} do not match the array's rank {len(shape)} "
            f"(shape {tuple(shape)})"
        )
    used: set[str] = set()
    spec: list[MeshAxes] = []
    for name, dim in zip(logical, shape):
        if name is None:
            spec.append(None)
            continue
        if name not in rules:
            raise ValueError(
                f"logical axis {name!r} has no sharding rule; known: {sorted(rules)}"
            )
        kept: list[str] = []
        size = 1
        for axis in _as_tuple(rules[name]):
            axis_size = dict(mesh.shape).get(axis, 1)
            if axis in used or axis_size == 1 or dim % (size * axis_size):
                continue
            kept.append(axis)
            size *= axis_size
        used.update(kept)
        spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return P(*spec)


def _logical_names(variable: nnx.Variable) -> tuple[str | None, ...] | None:
    meta = variable.get_metadata()
    names = meta.get("out_sharding", meta.get("sharding_names", meta.get("sharding")))
    return tuple(names) if names is not None else None


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def state_shardings(
    state: nnx.State, mesh: Mesh, rules: Mapping[str, MeshAxes] = DEFAULT_PARAM_RULES
) -> nnx.State:
    """The NamedSharding of every variable of an (abstract or concrete) `nnx.State`.

    Returns a State of the same structure whose variables hold `NamedSharding`s, usable as
    `jit` in/out shardings and for `jax.device_put`.
    """

    def one(variable: nnx.Variable) -> nnx.Variable:
        spec = logical_to_mesh_spec(_logical_names(variable), variable.get_value().shape, mesh, rules)
        return variable.replace(NamedSharding(mesh, spec))

    return jax.tree.map(one, state, is_leaf=_is_variable)


def _path_key(path: Sequence[Any]) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _spec_for_derived(param_spec: P, param_shape: tuple[int, ...], shape: tuple[int, ...]) -> P:
    """Spec of an optimizer leaf derived from a parameter: identical shape → same spec;
    one dimension removed (Adafactor's factored statistics) → that entry removed; anything
    else is small and replicated."""
    entries = list(param_spec) + [None] * (len(param_shape) - len(param_spec))
    if tuple(shape) == tuple(param_shape):
        return P(*entries)
    if len(shape) == len(param_shape) - 1:
        for i in range(len(param_shape)):
            if tuple(param_shape[:i]) + tuple(param_shape[i + 1 :]) == tuple(shape):
                return P(*(entries[:i] + entries[i + 1 :]))
    return P()


def optimizer_shardings(opt_state: Any, params: nnx.State, param_shardings: nnx.State) -> Any:
    """Shardings of an optax state: each leaf inside a params-shaped subtree takes its
    parameter's sharding (path-suffix match); counters and scalars are replicated."""
    mesh = None
    by_path: dict[tuple[str, ...], tuple[P, tuple[int, ...]]] = {}
    flat_params = jax.tree_util.tree_flatten_with_path(params)[0]
    flat_shardings = jax.tree_util.tree_leaves(param_shardings)
    for (path, leaf), sharding in zip(flat_params, flat_shardings, strict=True):
        by_path[_path_key(path)] = (sharding.spec, tuple(leaf.shape))
        mesh = sharding.mesh
    if mesh is None:
        raise ValueError("optimizer_shardings: the parameter tree is empty")
    longest = max(len(k) for k in by_path)

    def one(path: Sequence[Any], leaf: Any) -> NamedSharding:
        key = _path_key(path)
        for start in range(max(0, len(key) - longest), len(key)):
            hit = by_path.get(key[start:])
            if hit is not None:
                return NamedSharding(mesh, _spec_for_derived(hit[0], hit[1], tuple(leaf.shape)))
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(one, opt_state)


def replicated(tree: Any, mesh: Mesh) -> Any:
    """A fully replicated NamedSharding for every leaf of `tree`."""
    return jax.tree.map(lambda _: NamedSharding(mesh, P()), tree)


def batch_spec(name: str, ndim: int, mesh: Mesh | None = None) -> P:
    """Rows over ("data", "fsdp") (and "expert" when `mesh` has it, `mesh.batch_axes`), and a
    [B, T] array's tokens over "context" when `mesh` has that axis; `pair_index` holds global
    row numbers and is replicated."""
    if name == "pair_index" or ndim == 0:
        return P()
    rows = batch_axes(mesh)
    if ndim >= 2 and context_shards(mesh) > 1:
        return P(rows, CONTEXT_AXIS)
    return P(rows)


def batch_shardings(batch: Any, mesh: Mesh) -> Any:
    """NamedShardings for a `Batch` (or any flax struct of arrays keyed by field name).

    Raises a ValueError naming the field when its row count is not a multiple of
    data × fsdp, or (context parallelism) its length not a multiple of 2 × context.
    """
    from jaxrl_llm.data.batch import array_fields

    shards = batch_shards(mesh)
    context = context_shards(mesh)
    out = {}
    for name in array_fields(batch):
        value = getattr(batch, name)
        spec = batch_spec(name, value.ndim, mesh)
        if spec != P() and value.shape[0] % shards:
            raise ValueError(
                f"batch.{name} has {value.shape[0]} rows, not a multiple of the mesh's "
                f"{'×'.join(batch_axes(mesh))} = {shards}; choose train.batch_size (and "
                "micro_batch_size) as a multiple of it"
            )
        if len(spec) == 2 and value.shape[1] % (2 * context):
            raise ValueError(
                f"batch.{name} has {value.shape[1]} tokens per row, not a multiple of "
                f"2 × mesh.context = {2 * context} (the load-balanced chunks); choose "
                "train.max_seq_len and data.buckets as multiples of it"
            )
        out[name] = NamedSharding(mesh, spec)
    return batch.replace(**out)


def batch_sharding_tree(mesh: Mesh, batch_cls: Any = None) -> Any:
    """A `Batch` whose fields are the NamedShardings of `batch_spec` (jit in_shardings), in
    the token order the mesh trains on (`Batch.context_order`: static, part of the tree)."""
    from jaxrl_llm.data.batch import TOKEN_FIELDS, array_fields

    if batch_cls is None:
        from jaxrl_llm.data.batch import Batch as batch_cls
    return batch_cls(**{
        name: NamedSharding(mesh, batch_spec(name, 2 if name in TOKEN_FIELDS else 1, mesh))
        for name in array_fields(batch_cls)
    }, context_order=context_shards(mesh))
