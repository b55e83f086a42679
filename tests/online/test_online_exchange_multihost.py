"""The storage pipeline's trainer as a two-process `jax.distributed` job (two local processes
× 4 fake CPU devices, one global data 4 × fsdp 2 mesh) beside one rollout worker process:
each trainer process writes its own part of every weight version (the shards its devices
hold: no process gathers the model; tests/online/test_weight_parts.py checks the parts),
process 0 alone writes progress, metrics and checkpoint meta, and the run matches the single-process serial loop on
the same mesh as `jaxrl-llm online`'s multi-host serial loop does (tests/online/
test_online_multiprocess.py): the same rewards and pass@k per round, losses and parameters
within float32 reduction-order noise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxrl_llm.api import restore_state
from jaxrl_llm.config import MeshConfig, config_from_dict
from jaxrl_llm.online.config import OnlineConfig
from jaxrl_llm.online.loop import run_online
from jaxrl_llm.parallel.mesh import make_mesh
from tests.online.helpers import (
    ROOT,
    launch_two_processes,
    metric_rows,
    tiny,
    write_yaml,
)
from tests.online.test_online_multiprocess import _arrays, assert_rows_match

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

MESH = {"data": 4, "fsdp": 2}
ONLINE = {"rounds": 2, "staleness": 1, "mu_source": "trainer"}


def test_two_process_trainer_and_a_worker_match_the_serial_loop(tmp_path: Path) -> None:
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (tests/conftest.py forces 8 host devices)")
    tree = tiny(tmp_path / "one", mesh=MESH, data={"group_transform": "none"}, online=ONLINE)
    ref = run_online(config_from_dict(tree, schema=OnlineConfig), progress=False,
                     mesh=make_mesh(MeshConfig(**MESH)))
    config = write_yaml(tmp_path / "two.yaml", tiny(
        tmp_path / "two", mesh=MESH, data={"group_transform": "none"},
        online={**ONLINE, "pipeline": "deterministic", "exchange": str(tmp_path / "exchange"),
                "worker_timeout_s": 300}))
    cli = ["-m", "jaxrl_llm.cli", "online", "--config", str(config), "--no-progress"]
    # the worker: one process on 8 devices, the mesh of the serial loop's sampler
    worker = subprocess.Popen([sys.executable, *cli, "--role", "worker", "--worker", "0"],
                              env=dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    outputs = launch_two_processes([*cli, "--role", "trainer"], local_devices=4)
    assert worker.wait(timeout=600) == 0, worker.stdout.read()[-3000:]
    assert [json.loads(o[o.rindex("\n{") + 1:])["updates"] for o in outputs] == [2, 2]

    ref_rows, rows = metric_rows(tmp_path / "one"), metric_rows(tmp_path / "two")
    assert len(rows) == len(ref_rows) == 3  # written by process 0 alone, once per round
    assert_rows_match(ref_rows, rows)
    # the two-process checkpoint read onto the reference's state (Orbax needs a target for a
    # checkpoint written by another topology)
    got = _arrays(restore_state(ref.policy.state, str(tmp_path / "two/checkpoints")))
    want = _arrays(ref.policy.state)
    assert got.keys() == want.keys() and int(got["['step']"]) == 2
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-4, atol=1e-4, err_msg=key)
    versions = sorted((tmp_path / "exchange/weights").iterdir()) if (
        tmp_path / "exchange/weights").exists() else []
    assert not [p for p in versions if p.name.startswith(".")]  # nothing half-written left
