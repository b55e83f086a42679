"""Mesh construction and the logical-axis rules (no train-step compile here)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm.config import ConfigError, MeshConfig
from jaxrl_llm.parallel.distributed import detect_cluster, global_batch, initialize
from jaxrl_llm.parallel.mesh import make_mesh, resolve_mesh_shape
from jaxrl_llm.parallel.rules import (
    _spec_for_derived,
    batch_shardings,
    logical_to_mesh_spec,
)

from .helpers import make_batch


@pytest.mark.parametrize(
    "sizes, expected",
    [((-1, 1, 1), (8, 1, 1)), ((2, -1, 2), (2, 2, 2)), ((1, 4, 2), (1, 4, 2)),
     ((1, 1, -1), (1, 1, 8))],
)
def test_resolve_mesh_shape(sizes, expected):
    config = MeshConfig(data=sizes[0], fsdp=sizes[1], tensor=sizes[2])
    assert resolve_mesh_shape(config, 8) == expected


@pytest.mark.parametrize(
    "sizes, message",
    [((2, 2, 1), r"multiply to 4 but there are 8 devices"),
     ((3, -1, 1), r"does not divide the 8 available devices"),
     ((-1, -1, 1), r"only one axis may be -1"),
     ((0, 1, 1), r"mesh.data=0")],
)
def test_bad_mesh_sizes_name_the_keys(sizes, message):
    config = MeshConfig(data=sizes[0], fsdp=sizes[1], tensor=sizes[2])
    with pytest.raises(ConfigError, match=message):
        resolve_mesh_shape(config, 8)


def test_make_mesh_has_auto_axes_over_all_devices():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert set(mesh.axis_types) == {AxisType.Auto}
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


def _mesh(shape):
    devices = np.asarray(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return Mesh(devices, ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)


def test_logical_rules_map_and_drop_non_dividing_axes():
    mesh = _mesh((1, 4, 2))
    assert logical_to_mesh_spec(("vocab", "embed"), (64, 16), mesh) == P("tensor", "fsdp")
    assert logical_to_mesh_spec(("embed", "q_heads", "head_dim"), (16, 4, 8), mesh) == P(
        "fsdp", "tensor", None
    )
    # 3 KV heads do not split over tensor=2; d = 6 does not split over fsdp=4.
    assert logical_to_mesh_spec(("embed", "kv_heads", "head_dim"), (6, 3, 8), mesh) == P(
        None, None, None
    )
    assert logical_to_mesh_spec(("layers", "embed", "mlp"), (2, 16, 32), mesh) == P(
        None, "fsdp", "tensor"
    )
    assert logical_to_mesh_spec(("norm",), (16,), mesh) == P(None)
    # A mesh axis is never used twice in one spec.
    rules = {"a": "fsdp", "b": "fsdp"}
    assert logical_to_mesh_spec(("a", "b"), (8, 8), mesh, rules) == P("fsdp", None)
    with pytest.raises(ValueError, match="logical axis 'embd' has no sharding rule"):
        logical_to_mesh_spec(("embd",), (16,), mesh)


def test_factored_optimizer_statistics_drop_the_factored_dimension():
    spec = P("fsdp", "tensor")
    assert _spec_for_derived(spec, (256, 512), (256, 512)) == P("fsdp", "tensor")
    assert _spec_for_derived(spec, (256, 512), (256,)) == P("fsdp")
    assert _spec_for_derived(spec, (256, 512), (512,)) == P("tensor")
    assert _spec_for_derived(spec, (256, 512), (1,)) == P()


def test_global_batch_is_row_sharded_and_checks_divisibility():
    mesh = _mesh((2, 2, 2))
    batch = global_batch(make_batch(batch=8), mesh)
    assert batch.inputs.sharding.spec == P(("data", "fsdp"))
    assert batch.inputs.addressable_shards[0].data.shape == (2, 12)
    assert batch.pair_index.sharding.spec == P()
    np.testing.assert_array_equal(np.asarray(batch.inputs), make_batch(batch=8).inputs)
    with pytest.raises(ValueError, match=r"batch.inputs has 6 rows, not a multiple of .* = 4"):
        batch_shardings(make_batch(batch=6), mesh)
    assert isinstance(batch_shardings(make_batch(batch=8), mesh).rewards, NamedSharding)


def test_cluster_detection_and_explicit_arguments():
    assert detect_cluster({}) is None
    assert detect_cluster({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "4"}) == "slurm"
    assert detect_cluster({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "1"}) is None
    assert detect_cluster({"JAXRL_COORDINATOR": "h:1"}) == "explicit"
    assert detect_cluster({"TPU_WORKER_HOSTNAMES": "a,b"}) == "tpu"
    # Single-process environments are left alone (no jax.distributed call).
    assert initialize(env={}) is False
    with pytest.raises(ValueError, match="also needs num_processes and process_id"):
        initialize("127.0.0.1:1234", env={})
    with pytest.raises(ValueError, match="process_id=2 is not in"):
        initialize("127.0.0.1:1234", 2, 2, env={})
    with pytest.raises(ValueError, match="JAXRL_NUM_PROCESSES='x' must be an integer"):
        initialize(env={"JAXRL_COORDINATOR": "h:1", "JAXRL_NUM_PROCESSES": "x",
                        "JAXRL_PROCESS_ID": "0"})
