"""Multi-host initialisation and global arrays from per-host batches.

JAX's own multi-controller SPMD: every host runs the same program, `jax.distributed.initialize`
connects them, after which `jax.devices()` lists the devices of all hosts and one `Mesh` spans
them. On a TPU pod and under SLURM JAX detects the coordinator itself; elsewhere pass it
explicitly (or set the `JAXRL_COORDINATOR`, `JAXRL_NUM_PROCESSES`, `JAXRL_PROCESS_ID`
environment variables, which `launch/` scripts do).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from jaxrl_llm.data.batch import array_fields
from jaxrl_llm.parallel.context import reorder_batch
from jaxrl_llm.parallel.mesh import context_shards
from jaxrl_llm.parallel.rules import batch_shardings

ENV_COORDINATOR = "JAXRL_COORDINATOR"
ENV_NUM_PROCESSES = "JAXRL_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXRL_PROCESS_ID"


def detect_cluster(env: Mapping[str, str] | None = None) -> str | None:
    """Which launcher started us: "explicit" (JAXRL_* variables), "slurm", "tpu" or None."""
    env = os.environ if env is None else env
    if env.get(ENV_COORDINATOR):
        return "explicit"
    if int(env.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_JOB_ID" in env:
        return "slurm"
    if env.get("TPU_WORKER_HOSTNAMES") and "," in env["TPU_WORKER_HOSTNAMES"]:
        return "tpu"
    if env.get("MEGASCALE_COORDINATOR_ADDRESS") or env.get("CLOUD_TPU_TASK_ID"):
        return "tpu"
    return None


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: list[int] | None = None,
    env: Mapping[str, str] | None = None,
) -> bool:
    """Join a multi-process JAX job; a single-process run is left alone.

    Explicit arguments win; then the JAXRL_* variables; then JAX's auto-detection for TPU pods
    and SLURM (which reads SLURM_* / the TPU metadata). Returns True when a distributed
    runtime was initialised. Must run before anything touches a JAX device.
    """
    env = os.environ if env is None else env
    if coordinator_address is None and env.get(ENV_COORDINATOR):
        coordinator_address = env[ENV_COORDINATOR]
        num_processes = num_processes or _int_env(env, ENV_NUM_PROCESSES)
        process_id = process_id if process_id is not None else _int_env(env, ENV_PROCESS_ID)
    if coordinator_address is not None:
        if num_processes is None or process_id is None:
            raise ValueError(
                f"distributed: coordinator_address={coordinator_address!r} also needs "
                f"num_processes and process_id (or {ENV_NUM_PROCESSES}/{ENV_PROCESS_ID})"
            )
        if not 0 <= process_id < num_processes:
            raise ValueError(
                f"distributed: process_id={process_id} is not in [0, num_processes="
                f"{num_processes})"
            )
        jax.distributed.initialize(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
            local_device_ids=local_device_ids,
        )
        return True
    if detect_cluster(env) in ("slurm", "tpu"):
        jax.distributed.initialize(local_device_ids=local_device_ids)
        return True
    return False


def _int_env(env: Mapping[str, str], name: str) -> int:
    raw = env.get(name)
    try:
        return int(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"environment variable {name}={raw!r} must be an integer") from None


def process_row_slice(global_rows: int) -> slice:
    """The rows of a global batch this process loads (contiguous, equal split by process).

    Rows are sharded over ("data", "fsdp") in device order, so process p owns the p-th
    contiguous block when each process holds the same number of batch shards (the case for
    every mesh `make_mesh` builds: hosts are outermost in device order).
    """
    count, index = jax.process_count(), jax.process_index()
    if global_rows % count:
        raise ValueError(
            f"global batch of {global_rows} rows does not split evenly over {count} processes"
        )
    per = global_rows // count
    return slice(index * per, (index + 1) * per)


def global_array(local: np.ndarray | jax.Array, sharding: NamedSharding,
                 global_shape: tuple[int, ...] | None = None) -> jax.Array:
    """One global array from this process's rows (`jax.make_array_from_process_local_data`)."""
    return jax.make_array_from_process_local_data(sharding, np.asarray(local), global_shape)


def global_batch(local_batch: Any, mesh: Mesh) -> Any:
    """A global, sharded `Batch` from this host's rows of it.

    Every process passes its own `local_batch` (rows `process_row_slice(global_rows)`, and
    for packed batches the [b·k] record slots of those rows, so process p's records follow
    process p−1's exactly as its rows do);
    `pair_index` is replicated and must be identical on every process (global row numbers).
    Single-process runs get a plain sharded `device_put`. The rows' tokens are put in the
    mesh's order first, whatever order they are in (`parallel.context.reorder_batch`: the
    load-balanced order on a mesh with a "context" axis, the natural one otherwise), and the
    batch records it (`Batch.context_order`).
    """
    local_batch = reorder_batch(local_batch, context_shards(mesh))
    count = jax.process_count()
    fields = array_fields(local_batch)
    template = local_batch.replace(
        **{
            name: jax.ShapeDtypeStruct(
                _global_shape(name, np.shape(getattr(local_batch, name)), count),
                np.asarray(getattr(local_batch, name)).dtype,
            )
            for name in fields
        }
    )
    shardings = batch_shardings(template, mesh)
    out = {}
    for name in fields:
        value = np.asarray(getattr(local_batch, name))
        sharding = getattr(shardings, name)
        # Per-record arrays of packed batches are [B·k]: each field scales its own length.
        out[name] = global_array(value, sharding, _global_shape(name, value.shape, count))
    return local_batch.replace(**out)


def global_batch_from_whole(batch: Any, mesh: Mesh) -> Any:
    """A global, sharded `Batch` from the whole batch, held identically by every process (the
    online loop: every process samples the same records). Each device takes its own slice
    (`jax.make_array_from_callback`), so no assumption about which rows a process owns.
    Reordered for a "context" axis like `global_batch`."""
    batch = reorder_batch(batch, context_shards(mesh))
    shardings = batch_shardings(batch, mesh)
    out = {}
    for name in array_fields(batch):
        value = np.asarray(getattr(batch, name))
        out[name] = jax.make_array_from_callback(value.shape, getattr(shardings, name),
                                                 lambda index, value=value: value[index])
    return batch.replace(**out)


def batch_on_mesh(batch: Any, mesh: Mesh) -> Any:
    """`batch` (host or global arrays) in the token order `mesh` trains on
    (`Batch.context_order`): itself when it is, else gathered whole to the host
    (`host_array`: a collective, so every process calls it with the same batch), converted
    and placed again (`global_batch_from_whole`). What `Policy.step` runs on."""
    if batch.context_order == context_shards(mesh):
        return batch
    whole = batch.replace(**{name: host_array(getattr(batch, name))
                             for name in array_fields(batch)})
    return global_batch_from_whole(whole, mesh)


def host_array(value: Any) -> np.ndarray:
    """`value` whole on this host. A global array split over other processes' devices is
    gathered (`process_allgather`: a collective, so every process must call this at the same
    point); anything else, replicated arrays included, is read directly."""
    if (isinstance(value, jax.Array) and not value.is_fully_addressable
            and not value.is_fully_replicated):
        return np.asarray(multihost_utils.process_allgather(value, tiled=True))
    return np.asarray(value)


def _global_shape(name: str, shape: tuple[int, ...], count: int) -> tuple[int, ...]:
    if name == "pair_index" or not shape:
        return tuple(shape)
    return (shape[0] * count, *shape[1:])
