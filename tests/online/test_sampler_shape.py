"""Determinism must not depend on free memory (issue 55 item 6): the online sampler's prompt
batch, and with it every compiled shape, is decided once per run (online/sampler_shape.py),
recorded in the checkpoint and reused on resume. A run resumed under simulated memory
pressure (less memory than the recorded batch needs at the time, so a fresh decision would
halve it) ends in the state of the run without pressure, bit for bit, with
`online.mu_source: sampler` (the sampler's log-probs reach the update)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jaxrl_llm.config import MeshConfig, config_from_dict
from jaxrl_llm.online.config import OnlineConfig
from jaxrl_llm.online.loop import ONLINE_META, run_online
from jaxrl_llm.online.sampler_shape import fixed_sampler_batch
from jaxrl_llm.parallel.memory import Available, InsufficientMemory
from jaxrl_llm.parallel.mesh import make_mesh
from jaxrl_llm.sampling import build
from jaxrl_llm.train.checkpoint import Checkpointer
from tests.online.helpers import final_arrays, tiny
from tests.reliability import record

ONLINE = {"staleness": 0, "mu_source": "sampler", "checkpoint_every": 1}


def _run(run_dir: Path, rounds: int):
    """`run_online` on one device (more would split the slots into groups: a batch of 1
    prompt × n = 4 samples could not fill 8 groups)."""
    import jax

    return run_online(_config(run_dir, rounds), progress=False,
                      mesh=make_mesh(MeshConfig(), jax.devices()[:1]))


def _config(run_dir: Path, rounds: int) -> OnlineConfig:
    return config_from_dict(tiny(run_dir, online={**ONLINE, "rounds": rounds}),
                            schema=OnlineConfig)


def _recorded(run_dir: Path) -> int:
    with Checkpointer(run_dir / "checkpoints", async_save=False) as ckpt:
        return ckpt.read_meta(ckpt.latest_step())[ONLINE_META]["sampler_batch"]


def _pressure(monkeypatch: pytest.MonkeyPatch, config: OnlineConfig, policy) -> None:
    """Memory for one prompt per batch but not two: the largest budget under which the
    run's own decision (`fixed_sampler_batch`, over the memory check) halves
    generate.batch_size=2, found by bisection over a simulated budget."""
    problems = policy.task.load(split=config.generate.split, num=config.data.num_prompts,
                                seed=config.seed)

    def fits(budget: int) -> int:
        monkeypatch.setattr(build, "available_memory",
                            lambda device: Available(budget, "simulated", True))
        try:
            return fixed_sampler_batch(config, policy, problems)
        except InsufficientMemory:
            return 0

    low, high = 0, 64 << 30  # fits(low) < 2 <= fits(high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if fits(mid) == 2 else (mid, high)
    assert fits(low) == 1  # under this budget a fresh decision takes 1 prompt, not 2


@pytest.mark.reliability
def test_a_resume_under_memory_pressure_equals_the_run_without(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    failures = 0
    try:
        _resume_under_pressure(tmp_path, monkeypatch)
    except AssertionError:
        failures = 1
        raise
    finally:
        record("fault injection", "online: a resume under simulated memory pressure",
               runs=1, failures=failures,
               detail="round 1 with ample memory, then resumed with memory for 1 prompt per "
               "sampler batch instead of 2 (a fresh decision takes 1): the checkpoint's "
               "batch of 2 is kept and the final state equals the run without pressure bit "
               "for bit, mu_source: sampler")


def _resume_under_pressure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reference = _run(tmp_path / "ref", 2)
    assert _recorded(tmp_path / "ref") == 2  # generate.batch_size: the memory was ample
    _run(tmp_path / "run", 1)  # round 1, then stopped
    _pressure(monkeypatch, _config(tmp_path / "run", 2), reference.policy)
    _run(tmp_path / "run", 2)  # resumed under pressure
    assert _recorded(tmp_path / "run") == 2  # the recorded batch, not a new decision
    want, got = final_arrays(tmp_path / "ref"), final_arrays(tmp_path / "run")
    assert got[0] == want[0] == 2 and got[1].keys() == want[1].keys()
    for key in want[1]:
        np.testing.assert_array_equal(got[1][key], want[1][key], err_msg=key)
    # a fresh run under the same pressure decides 1 prompt per batch (and says so)
    _run(tmp_path / "fresh", 1)
    assert _recorded(tmp_path / "fresh") == 1
