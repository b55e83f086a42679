"""A rollout worker's weight cache (`remote.StoredWeights`) against a restarted free-running
trainer: the version number alone does not name the weights (a restarted trainer publishes
its own θ_v over a killed one's), so the worker reloads when the bytes differ and, when they
are the same, stamps its rounds with the publisher now on file. Stamped with the killed
trainer's, every later round is dropped as sampled by lost weights and the run never ends —
the livelock the free-running SIGKILL test (tests/online/test_online_exchange_kill.py) hit."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm.online.exchange import Exchange
from jaxrl_llm.online.remote import StoredWeights
from jaxrl_llm.parallel.mesh import AxisSizes, make_mesh
from jaxrl_llm.parallel.rules import state_shardings
from tests.reliability import record

MANIFEST = {"model": "m", "run_id": "r1", "about": {"name": "t", "run_dir": "run"}}


def _worker(ex: Exchange) -> StoredWeights:
    params = nnx.state(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.Param)
    template = (params, nnx.State({}))
    mesh = make_mesh(AxisSizes(), jax.devices()[:1])
    weights = StoredWeights(ex, template, state_shardings(template, mesh), MANIFEST, None)
    weights.free = True
    return weights


def _publish(ex: Exchange, version: int, scale: float, incarnation: str) -> None:
    """θ_version as one trainer process's part (weight_parts.local_part's format)."""
    kernel = np.full((2, 3), scale, np.float32)
    leaves = [["[0]['bias'].value", "float32", [3], [[[0, 3]]]],
              ["[0]['kernel'].value", "float32", [2, 3], [[[0, 2], [0, 3]]]]]
    ex.publish_part(version, 0, 1, leaves, np.zeros(3, np.float32).tobytes()
                    + kernel.tobytes(), {"model": "m", "run": "r1",
                                         "incarnation": incarnation})


def test_a_restarted_trainer_s_version_is_reloaded_or_restamped(tmp_path):
    ex = Exchange(str(tmp_path), timeout_s=5)
    weights = _worker(ex)
    _publish(ex, 2, 1.0, "killed")
    first = weights.take(2)
    assert weights.incarnation == "killed"

    _publish(ex, 2, 1.0, "restarted")  # the same update replayed: the same bytes
    assert weights.take(2) is first  # no reload
    assert weights.incarnation == "restarted"

    _publish(ex, 2, 3.0, "again")  # different bytes under the same number
    params, _ = weights.take(2)
    assert weights.incarnation == "again"
    kernel = jax.tree_util.tree_leaves(params)[1]
    np.testing.assert_array_equal(np.asarray(kernel), np.full((2, 3), 3.0, np.float32))


@pytest.mark.reliability
def test_a_version_deleted_while_a_free_worker_reads_it_gives_the_newest(tmp_path):
    """The free-running trainer keeps only its newest versions, so one can vanish between
    the worker's existence check and its read. A deleting trainer (the delete lands inside
    the read) makes the worker take the newest version instead of crashing."""
    failures = 0
    try:
        _deleted_mid_read(tmp_path)
    except AssertionError:
        failures = 1
        raise
    finally:
        record("fault injection", "online exchange (free-running): a weight version collected "
               "while a worker reads it", runs=1, failures=failures,
               detail="the trainer's garbage collection deletes θ_1 between the worker's "
               "existence check and its read: the worker takes the newest (θ_2, its values "
               "checked) instead of crashing; deterministic workers still refuse a missing θ_v")


def _deleted_mid_read(tmp_path) -> None:
    from jaxrl_llm.online import remote

    ex = Exchange(str(tmp_path), timeout_s=5)
    weights = _worker(ex)
    _publish(ex, 1, 1.0, "t")
    _publish(ex, 2, 2.0, "t")
    real_load = ex.load

    def deleting_load(version: int):
        if version == 1:  # the trainer's garbage collection, between check and read
            ex.part_path(1, 0, 1).unlink()
        return real_load(version)

    ex.load = deleting_load  # type: ignore[method-assign]
    with pytest.raises(remote._Newer):
        weights.take(1)
    version, (params, _) = weights.take_newest()
    assert version == 2
    np.testing.assert_array_equal(np.asarray(jax.tree_util.tree_leaves(params)[1]),
                                  np.full((2, 3), 2.0, np.float32))

    weights.free = False  # deterministic: θ_v must exist, a missing one is an error
    _publish(ex, 1, 1.0, "t")
    with pytest.raises(FileNotFoundError):
        weights.take(1)
