"""`jaxrl-llm online` as a two-process job (two local processes × 4 fake CPU devices, one
global data 4 × fsdp 2 mesh, jax.distributed over gloo) matches the single-process run on the
same 8-device mesh: same per-round rewards, pass@k and losses, same final parameters; and a
second launch of the job resumes from the checkpoint the first one wrote."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from jaxrl_llm.api import restore_state
from jaxrl_llm.config import MeshConfig, config_from_dict
from jaxrl_llm.online.config import OnlineConfig
from jaxrl_llm.online.loop import run_online
from jaxrl_llm.parallel.distributed import host_array
from jaxrl_llm.parallel.mesh import make_mesh
from jaxrl_llm.train.state_items import state_items
from tests.online.helpers import launch_two_processes, metric_rows, tiny, write_yaml
from tests.online.online_mp_worker import MESH as SAMPLER_MESH
from tests.online.online_mp_worker import process_records, reward_table, sample_with_drops

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

MESH = {"data": 4, "fsdp": 2}  # rows over data × fsdp, parameters over fsdp
LOCAL_DEVICES = 4


def _tree(run_dir: Path, rounds: int) -> dict:
    # staleness 1 (the queue crosses a checkpoint), μ re-scored by the trainer (Policy.score
    # gathers a sharded result), TOPR on the raw ±1 rewards (every update has a gradient).
    return tiny(run_dir, mesh=MESH, data={"group_transform": "none"},
                online={"rounds": rounds, "staleness": 1, "mu_source": "trainer"})


def _online(config: Path, *overrides: str) -> list[dict]:
    """`jaxrl-llm online --config CONFIG` as a two-process job: each process's JSON summary."""
    outputs = launch_two_processes(["-m", "jaxrl_llm.cli", "online", "--config", str(config),
                                    "--no-progress", *overrides], local_devices=LOCAL_DEVICES)
    return [json.loads(out[out.rindex("\n{") + 1:]) for out in outputs]


def assert_rows_match(ref_rows: list[dict[str, Any]], rows: list[dict[str, Any]]) -> None:
    """A multi-process run's metric rows against the one-process reference: rewards and pass@k
    exactly (the same samples), losses and norms within float32 reduction-order noise."""
    for a, b in zip(ref_rows, rows, strict=True):
        for key in ("reward_mean", "correct_rate", "pass@1", "pass@4", "updates", "queued"):
            assert b[key] == a[key], (key, a, b)
        for key in ("loss", "grad_norm", "mu_mismatch_max"):
            assert (key in a) == (key in b), key
            if key in a:
                np.testing.assert_allclose(b[key], a[key], rtol=1e-4, atol=1e-6, err_msg=key)


def _arrays(state: Any) -> dict[str, np.ndarray]:
    """Every array of a train state (params, optimizer state, step, RNG) by path, gathered."""
    key_data = lambda a: jax.random.key_data(a) if jax.dtypes.issubdtype(
        a.dtype, jax.dtypes.prng_key) else a
    return {jax.tree_util.keystr(p): host_array(key_data(a))
            for p, a in jax.tree_util.tree_leaves_with_path(state_items(state))}


def test_two_processes_match_one_process_and_resume(tmp_path: Path) -> None:
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (tests/conftest.py forces 8 host devices)")
    # Reference: one process, the same mesh over its 8 devices, 2 training rounds (3 in all).
    ref = run_online(config_from_dict(_tree(tmp_path / "one", 2), schema=OnlineConfig),
                     progress=False, mesh=make_mesh(MeshConfig(**MESH)))
    ref_rows = metric_rows(tmp_path / "one")
    assert ref.rounds == 3 and len(ref_rows) == 3

    # Two processes: a first launch stops after round 2 (online.rounds=1), the same command
    # with online.rounds=2 resumes from that checkpoint and runs round 3.
    run_dir = tmp_path / "two"
    config = write_yaml(tmp_path / "two.yaml", _tree(run_dir, 1))
    assert [s["rounds"] for s in _online(config)] == [2, 2]
    second = _online(config, "online.rounds=2")
    assert [(s["rounds"], s["updates"]) for s in second] == [(3, 2), (3, 2)]

    rows = metric_rows(run_dir)  # written by process 0 alone
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows] == [1, 2, 3]
    assert_rows_match(ref_rows, rows)
    assert all(r["grad_norm"] > 0 for r in ref_rows if "grad_norm" in r)
    # The two-process checkpoint read onto the reference's state (its shardings: Orbax
    # needs a target for a checkpoint written by another topology).
    arrays = _arrays(restore_state(ref.policy.state, str(run_dir / "checkpoints")))
    ref_arrays = _arrays(ref.policy.state)
    assert arrays.keys() == ref_arrays.keys() and int(arrays["['step']"]) == 2
    for part in ("['params']", ""):
        worst = max(float(np.max(np.abs(arrays[k].astype(np.float64) - ref_arrays[k])))
                    for k in ref_arrays if arrays[k].dtype.kind == "f" and k.startswith(part))
        print(f"max |Δ| two processes vs one, {part or 'whole train state'}: {worst:.3g}")
    for key, value in ref_arrays.items():
        np.testing.assert_allclose(arrays[key], value, rtol=1e-4, atol=1e-4, err_msg=key)


def test_sampler_and_rewards_across_processes(tmp_path: Path) -> None:
    """The decode loop's host reads (which rows stopped, the outputs) on a mesh whose
    parameters span both processes: the same samples as one process, rows really dropped;
    and rewards that differ by process come out as process 0's on both, exactly."""
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (tests/conftest.py forces 8 host devices)")
    worker = Path(__file__).with_name("online_mp_worker.py")
    launch_two_processes([str(worker), str(tmp_path / "p{}.npz")], local_devices=LOCAL_DEVICES)
    ref, ref_rows = sample_with_drops(make_mesh(MeshConfig(**SAMPLER_MESH)))
    first = reward_table(process_records(0))
    assert not np.array_equal(first, reward_table(process_records(1)), equal_nan=True)
    for index in range(2):
        got = np.load(str(tmp_path / "p{}.npz").format(index))
        np.testing.assert_array_equal(got["rewards"], first)
    got = np.load(tmp_path / "p1.npz")
    assert int(got["rows_decoded"]) == ref_rows < ref.tokens.size  # finished rows were dropped
    np.testing.assert_array_equal(got["tokens"], ref.tokens)
    np.testing.assert_array_equal(got["lengths"], ref.lengths)
    for name in ("logprobs", "raw_logprobs"):
        np.testing.assert_allclose(got[name], getattr(ref, name), rtol=1e-5, atol=1e-5)
