"""Two processes on localhost (jax.distributed, CPU collectives) run the sharded step on one
global mesh spanning both and match the single-process 8-device result."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from .helpers import free_port
from .test_sharded_step import run_step

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORKER = Path(__file__).with_name("mp_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def test_two_processes_match_single_process(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(ROOT)
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(port), str(i), str(tmp_path / f"p{i}.npz")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    _, after, metrics, _ = run_step("topr", (2, 2, 2))
    ref = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(after)[0]}
    for i in range(2):
        got = np.load(tmp_path / f"p{i}.npz")
        np.testing.assert_allclose(got["loss"], metrics["loss"], rtol=1e-5)
        np.testing.assert_allclose(got["grad_norm"], metrics["grad_norm"], rtol=1e-5)
        for key, value in ref.items():
            np.testing.assert_allclose(got[f"param{key}"], value, atol=1e-5, err_msg=key)
