"""`online.pipeline: deterministic` (jaxrl_llm/online/pipeline.py): the sampler on its own
devices running ahead of the trainer computes what the serial loop computes — final params,
optimizer state, step and RNG bit for bit, the same metric rows — and each version lag is the
staleness rule's; configs it cannot run are refused before anything is loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm.config import ConfigError, MeshConfig, config_from_dict
from jaxrl_llm.eval.report import SERIES, write_report
from jaxrl_llm.online.config import OnlineConfig
from jaxrl_llm.online.free import run_free
from jaxrl_llm.online.lag import weights_version
from jaxrl_llm.online.loop import run_online
from jaxrl_llm.online.pipeline import open_run, run_pipeline
from jaxrl_llm.online.queue import StalenessQueue
from jaxrl_llm.parallel.mesh import make_mesh
from tests.online.helpers import (
    ROOT,
    final_arrays,
    metric_rows,
    saved_queue,
    solvable,
    tiny,
    write_yaml,
)

SERIES_TITLES = {stem: title for stem, title, _, _ in SERIES}
TIMING = ("time", "seconds_sampling", "seconds_scoring", "seconds_training")


def _comparable(rows: list[dict]) -> list[dict]:
    """A row without its timing columns and the pipeline's own (the serial loop has none)."""
    return [{k: v for k, v in r.items() if k not in TIMING and not k.startswith("pipeline/")}
            for r in rows]


def _state(run_dir: Path) -> tuple[int, dict[str, np.ndarray]]:
    return final_arrays(run_dir)


@pytest.mark.parametrize(("per_round", "staleness", "rounds"),
                         [(1, 1, 5), (1, 3, 6), (2, 1, 4), (2, 3, 4), (3, 2, 3), (2, 4, 3)])
def test_weights_version_is_what_the_serial_queue_does(per_round: int, staleness: int,
                                                       rounds: int) -> None:
    # Brute force: run the serial loop's queue (push a round's batches, pop while it holds
    # more than s, stop at the last update) and record which weights sampled each round and
    # which batch each update trains on; `weights_version` and the lag must say the same.
    total = rounds * per_round
    queue, updates, sampled_by, trained = StalenessQueue(staleness), 0, [], []
    for r in range(rounds + -(-staleness // per_round)):
        sampled_by.append(updates)
        for j in range(per_round):
            queue.push([r * per_round + j])  # a "batch" is its own index here
        while queue.ready() and updates < total:
            trained.append(queue.pop()[0])
            updates += 1
    version = partial(weights_version, updates_per_round=per_round, staleness=staleness,
                      total_updates=total)
    assert [version(r) for r in range(len(sampled_by))] == sampled_by
    assert trained == list(range(total))  # update u trains batch u (FIFO)
    lags = [u - version(u // per_round) for u in range(total)]
    assert lags == [u - sampled_by[u // per_round] for u in range(total)]
    assert max(lags) == staleness + per_round - 1  # batch j of a round is j updates older


def _cli_online(cwd: Path) -> subprocess.CompletedProcess:
    """`jaxrl-llm online --config online.yaml` run from `cwd`, as a user runs it."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               JAXRL_PROGRESS_INTERVAL_S="0")
    return subprocess.run([sys.executable, "-m", "jaxrl_llm.cli", "online", "--config",
                           "online.yaml"], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def _needs_eight() -> None:
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (tests/conftest.py forces 8 host devices)")


@pytest.mark.slow  # a CLI subprocess on 8 devices and an in-process serial run (~20-40 s)
def test_pipeline_run_from_the_cli_equals_the_serial_loop_bit_for_bit(tmp_path: Path) -> None:
    # The serial loop on the trainer's 4 devices (data 2 × fsdp 2) against `jaxrl-llm online`
    # with the first 4 of 8 devices sampling ahead: the sampler's mesh has the trainer's
    # sizes, so it computes the serial sampler's tokens and log-probs exactly, and μ (auto:
    # the sampler's log-probs) too.
    _needs_eight()
    online = {"rounds": 4, "staleness": 2, "checkpoint_every": 2}
    keep = {"keep_checkpoints": 10}
    serial = config_from_dict(tiny(tmp_path / "serial", online=online, train=keep,
                                   mesh={"data": 2, "fsdp": 2}), schema=OnlineConfig)
    run_online(serial, progress=False, mesh=make_mesh(MeshConfig(data=2, fsdp=2), jax.devices()[4:]))
    (tmp_path / "cli").mkdir()
    # train.eval_every: held-out evaluations join the rows (updates 2 and 4), the state unchanged
    write_yaml(tmp_path / "cli/online.yaml", tiny(
        "run", mesh={"data": 2, "fsdp": 2}, train={**keep, "eval_every": 2},
        eval={"n": 2, "num_questions": 4, "max_new_tokens": 8, "split": "test"},
        online={**online, "pipeline": "deterministic", "sampler_devices": 4}))
    proc = _cli_online(tmp_path / "cli")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # a progress line per side
    assert "sampler: 6/6" in proc.stderr and "trainer: 4/4" in proc.stderr, proc.stderr[-2000:]

    step_a, a = _state(tmp_path / "serial")
    step_b, b = _state(tmp_path / "cli/run")
    assert step_a == step_b == 6  # 4 training rounds + 2 that fill the queue
    assert a.keys() == b.keys() and any("opt_state" in k for k in a) and any("rng" in k for k in a)
    assert not [k for k in a if not np.array_equal(a[k], b[k])]
    _, first = final_arrays(tmp_path / "serial", step=2)
    assert any(not np.array_equal(first[k], a[k]) for k in a if "params" in k)  # it trained
    # the checkpoint of round 4 too: the same state and meta (queue of 2 batches, position)
    _, mid = final_arrays(tmp_path / "cli/run", step=4)
    assert not [k for k, v in final_arrays(tmp_path / "serial", step=4)[1].items()
                if not np.array_equal(v, mid[k])]
    meta = [json.loads((d / "checkpoints/4/meta/metadata").read_text())["online"]
            for d in (tmp_path / "serial", tmp_path / "cli/run")]
    queues = [saved_queue(d, 4) for d in (tmp_path / "serial", tmp_path / "cli/run")]
    assert meta[0] == meta[1] and queues[0] == queues[1]  # the records, metadata too
    assert len(StalenessQueue.from_bytes(2, queues[0], where="queue")) == 2
    serial_rows, rows = metric_rows(tmp_path / "serial"), metric_rows(tmp_path / "cli/run")
    # the serial loop's step-0 row (the initial weights' evaluation), then one row a round
    before, rows = rows[0], rows[1:]
    assert before["step"] == 0 and "eval/pass_at_1" in before and "updates" not in before
    assert [r["updates"] for r in rows if "eval/pass_at_1" in r] == [2, 4]
    assert all("eval/pass_at_1_se" in r for r in rows if "eval/pass_at_1" in r)
    assert _comparable(serial_rows) == [{k: v for k, v in r.items() if not k.startswith("eval/")}
                                        for r in _comparable(rows)]
    # update u trains on θ_max(0, u−2)'s batch: round r trains update r − 2 (rounds 2 … 5),
    # so the lags are 0, 1, 2, 2, each for the batch's 8 samples
    assert [r.get("pipeline/lag_max") for r in rows] == [None, None, 0.0, 1.0, 2.0, 2.0]
    assert [r.get(f"pipeline/lag_hist_{lag}") for r, lag in zip(rows[2:], [0, 1, 2, 2])] == [8.0] * 4
    # round r samples with θ_max(0, r−2)
    assert [r["pipeline/version"] for r in rows] == [0.0, 0.0, 0.0, 1.0, 2.0, 3.0]
    for r in rows:
        for key in ("pipeline/sampler_busy_s", "pipeline/sampler_wait_s",
                    "pipeline/trainer_busy_s", "pipeline/trainer_wait_s",
                    "pipeline/trainer_sync_s", "pipeline/syncs"):
            assert r[key] >= 0, key
    # θ_0 … θ_3 are sampled with, each published once (θ_4 is never needed)
    assert sum(r["pipeline/syncs"] for r in rows) == 4
    # `report` draws the lag and the time of each side
    report = write_report(tmp_path / "cli/run")
    for stem in ("pipeline_lag", "pipeline_lag_histogram", "pipeline_seconds"):
        assert (report.parent / f"{stem}.png").is_file(), stem
    assert f"![{SERIES_TITLES['pipeline_seconds']}]" in report.read_text()


@pytest.mark.slow  # three in-process runs on 8 devices (~30 s): the default suite's budget
def test_split_placement_without_overlap_is_the_reference(tmp_path: Path) -> None:
    # 6 sampler devices cannot take the trainer's fsdp 2 × data 1 sizes: the sampler is
    # data-parallel, its log-probs (μ here: mu_source sampler) round differently from the
    # fsdp-split serial sampler's. The pipeline then equals the serial loop on the same
    # placements (pipeline: off, the same sampler_devices) bit for bit, and the serial loop
    # on the trainer's mesh within float tolerance; 2 updates per round at staleness 3.
    _needs_eight()
    online = {"rounds": 2, "staleness": 3, "prompts_per_round": 4, "updates_per_round": 2,
              "mu_source": "sampler", "sampler_devices": 6}
    runs = {}
    for name, pipeline in (("off", "off"), ("pipe", "deterministic")):
        cfg = config_from_dict(tiny(tmp_path / name, online={**online, "pipeline": pipeline},
                                    mesh={"data": 1, "fsdp": 2}), schema=OnlineConfig)
        result = run_pipeline(cfg, progress=False)
        assert result.updates == 4 and result.rounds == 4
        runs[name] = (metric_rows(tmp_path / name), _state(tmp_path / name)[1])
    serial = config_from_dict(tiny(tmp_path / "serial", online={**online, "sampler_devices": 0},
                                   mesh={"data": 1, "fsdp": 2}), schema=OnlineConfig)
    run_online(serial, progress=False, mesh=make_mesh(MeshConfig(data=1, fsdp=2), jax.devices()[6:]))
    (off_rows, off), (rows, pipe) = runs["off"], runs["pipe"]
    assert _comparable(off_rows) == _comparable(rows)
    assert not [k for k in off if not np.array_equal(off[k], pipe[k])]
    ref = _state(tmp_path / "serial")[1]
    ref_rows = metric_rows(tmp_path / "serial")
    # the same tokens and rewards (μ's last bits differ, not the draws)
    for key in ("reward_mean", "pass@1", "completion_length"):
        assert [r.get(key) for r in ref_rows] == [r.get(key) for r in rows], key
    worst = max(float(np.max(np.abs(pipe[k] - ref[k]), initial=0)) for k in ref if "params" in k)
    print(f"max |Δparam| pipeline vs serial on the trainer's mesh: {worst:.3g}")
    # μ differs by ~1e-7 per token; Adam at lr 3e-2 turns that into parameter changes ≲ 1e-4
    for k in ref:
        np.testing.assert_allclose(pipe[k], ref[k], rtol=1e-3, atol=1e-4, err_msg=k)
    # round r samples with θ_U(r), U(r) = min(4, max(0, 2r − 3)): 0, 0, 1, 3; update u
    # trains on batch u of round u // 2: lags (u − U(u // 2)) 0, 1, 2, 3 in rounds 1, 2, 2, 3
    assert [r["pipeline/version"] for r in rows] == [0.0, 0.0, 1.0, 3.0]
    assert [r.get("pipeline/lag_min") for r in rows] == [None, 0.0, 1.0, 3.0]
    assert [r.get("pipeline/lag_max") for r in rows] == [None, 0.0, 2.0, 3.0]
    assert [r["round_updates"] for r in rows] == [0, 1, 2, 1]


def test_pipeline_equals_pipeline_off_on_the_same_placements_bit_for_bit(tmp_path: Path) -> None:
    """docs/online.md's headline claim in the default suite (the slow tests above run it at
    more sizes): the sampler running ahead on 4 devices, the trainer on the other 4, ends in
    the state and the rows of `pipeline: off` on the same placements, bit for bit. On a task
    the random model solves now and then, with RLOO: positive rewards and mixed groups reach
    the transform, so every update has a gradient to get wrong."""
    _needs_eight()
    online = {"rounds": 2, "staleness": 1, "sampler_devices": 4}
    runs = {}
    for name, pipeline in (("off", "off"), ("pipe", "deterministic")):
        cfg = config_from_dict(solvable(tmp_path / name, online={**online, "pipeline": pipeline},
                                        data={"group_transform": "rloo"}), schema=OnlineConfig)
        result = run_pipeline(cfg, progress=False)
        assert result.updates == 2 and result.rounds == 3
        runs[name] = (metric_rows(tmp_path / name), _state(tmp_path / name)[1])
    (off_rows, off), (rows, pipe) = runs["off"], runs["pipe"]
    assert off.keys() == pipe.keys() and any("opt_state" in k for k in off)
    assert not [k for k in off if not np.array_equal(off[k], pipe[k])]
    assert _comparable(off_rows) == _comparable(rows)
    # round r samples with θ_max(0, r−1): the sampler ran a round ahead of the trainer
    assert [r["pipeline/version"] for r in rows] == [0.0, 0.0, 1.0]
    assert [r["round_updates"] for r in rows] == [0, 1, 1]
    assert all(r["grad_norm"] > 0 for r in rows[1:])  # both updates moved the weights
    assert any(r["reward_mean"] > -1 for r in rows)  # ±1 rewards: some sample was right


# The 2 + 2 split of docs/online.md § Pipeline (mesh: {data: 2}) on the first 4 devices of
# this process, and the serial loop's config on the trainer's 2 devices.
TWO_PLUS_TWO = {"online": {"rounds": 3, "staleness": 1}, "mesh": {"data": 2}}


def _two_plus_two_pipeline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """The deterministic pipeline with 2 sampler and 2 trainer devices (devices 0-1 and 2-3
    of this process), mesh data 2 on both sides; its final state."""
    from jaxrl_llm.online import pipeline
    from jaxrl_llm.online.placement import make_placement

    monkeypatch.setattr(pipeline, "make_placement",
                        lambda config: make_placement(config, jax.devices()[:4]))
    cfg = config_from_dict(solvable(tmp_path / "pipe", mesh=TWO_PLUS_TWO["mesh"], online={
        **TWO_PLUS_TWO["online"], "pipeline": "deterministic", "sampler_devices": 2}),
        schema=OnlineConfig)
    assert run_pipeline(cfg, progress=False).updates == 3
    return _state(tmp_path / "pipe")[1]


def test_pipeline_equals_the_serial_loop_on_the_trainers_devices_in_the_same_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/online.md's stronger claim, in the case issue 55 tried: 2 sampler devices and 2
    trainer devices with mesh: {data: 2} end in the state and rows of the serial loop run
    with that mesh on the trainer's 2 devices, bit for bit, when both run in one process
    (one XLA:CPU thread pool; the test below runs the serial loop in a process of its own)."""
    _needs_eight()
    pipe = _two_plus_two_pipeline(tmp_path, monkeypatch)
    serial = config_from_dict(solvable(tmp_path / "serial", **TWO_PLUS_TWO), schema=OnlineConfig)
    run_online(serial, progress=False,
               mesh=make_mesh(MeshConfig(**TWO_PLUS_TWO["mesh"]), jax.devices()[2:4]))
    ref = _state(tmp_path / "serial")[1]
    assert ref.keys() == pipe.keys() and any("opt_state" in k for k in ref)
    assert not [k for k in ref if not np.array_equal(ref[k], pipe[k])]
    rows = metric_rows(tmp_path / "pipe")
    assert _comparable(metric_rows(tmp_path / "serial")) == _comparable(rows)
    assert all(r["grad_norm"] > 0 for r in rows[1:])  # all 3 updates moved the weights


# The serial loop in a process of its own, pinned to one core before jax starts: XLA:CPU's
# thread pool then has max(1 core, 2 devices) = 2 threads, never this process's max(cores, 8).
_SERIAL_ALONE = """
import os, sys, json
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
sys.path.insert(0, sys.argv[3])
import numpy as np
from jaxrl_llm.config import config_from_dict
from jaxrl_llm.online.config import OnlineConfig
from jaxrl_llm.online.loop import run_online
from pathlib import Path
from tests.online.helpers import final_arrays
config = config_from_dict(json.loads(sys.argv[1]), schema=OnlineConfig)
run_online(config, progress=False)
np.savez(sys.argv[2], **final_arrays(Path(config.run_dir))[1])
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pins a process to a core (Linux)")
@pytest.mark.slow  # a subprocess beside an in-process pipeline run (~30 s on 2 busy cores)
def test_the_serial_loop_in_a_process_with_another_cpu_thread_pool_differs_in_the_last_bits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where docs/online.md's stronger claim stops: the same 2 + 2 pipeline against the serial
    loop in a 2-device process of its own (`jaxrl-llm online` with 2 host devices). XLA:CPU
    runs a process's programs on one intra-op thread pool of max(schedulable cores, host
    devices) threads and splits a large matrix product (the gradient's sum over a batch's
    tokens) by that count, so another pool size rounds differently: the same samples and
    rewards, the state within float32 noise. Pinned to one core, that process has 2 threads
    and this one at least 8, on any host."""
    _needs_eight()
    pipe = _two_plus_two_pipeline(tmp_path, monkeypatch)
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                     if "xla_force_host_platform_device_count" not in f)
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=2")
    tree = solvable(tmp_path / "alone", **TWO_PLUS_TWO)
    proc = subprocess.run([sys.executable, "-c", _SERIAL_ALONE, json.dumps(tree),
                           str(tmp_path / "alone.npz"), str(ROOT)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(tmp_path / "alone.npz") as npz:
        alone = {k: npz[k] for k in npz.files}
    assert alone.keys() == pipe.keys()
    differ = [k for k in pipe if not np.array_equal(pipe[k], alone[k])]
    worst = max(float(np.max(np.abs(pipe[k] - alone[k]))) for k in pipe)
    print(f"{len(differ)} of {len(pipe)} arrays differ, by at most {worst:.3g}")
    assert differ  # not bit for bit: another thread pool
    # 3 Adam updates at lr 3e-2, measured on 2 cores (8 threads here, 2 there): 33 of 37
    # arrays differ, by at most 1.4e-4 (Adam's step is ≈ lr · sign(g) where g ≈ 0)
    for k in pipe:
        np.testing.assert_allclose(alone[k], pipe[k], rtol=1e-3, atol=5e-4, err_msg=k)
    rows = metric_rows(tmp_path / "pipe")
    for key in ("reward_mean", "pass@1", "completion_length"):  # the same samples
        assert [r.get(key) for r in rows] == [r.get(key) for r in metric_rows(tmp_path / "alone")]


@pytest.mark.parametrize(("online", "mesh", "message"), [
    ({"pipeline": "deterministic", "staleness": 0, "sampler_devices": 2},
     None, "staleness >= 1 .*nothing can overlap"),
    ({"pipeline": "deterministic", "staleness": 1}, None, "set online.sampler_devices to 1"),
    ({"pipeline": "deterministic", "staleness": 1, "sampler_devices": 8},
     None, "sampler_devices=8 covers all 8 devices"),
    ({"sampler_devices": 2}, {"data": 4, "fsdp": 2},
     "mesh.*the 6 devices that online.sampler_devices=2 leaves"),
])
def test_pipeline_mistakes_are_refused_before_loading(tmp_path: Path, online: dict,
                                                      mesh: dict | None, message: str) -> None:
    _needs_eight()
    tree = tiny(tmp_path / "bad", online=online, **({"mesh": mesh} if mesh else {}))
    with pytest.raises(ConfigError, match=message):
        run_pipeline(config_from_dict(tree, schema=OnlineConfig), progress=False)
    assert not (tmp_path / "bad").exists()  # refused before anything was written


@pytest.mark.parametrize("online", [{"pipeline": "deterministic", "staleness": 1},
                                    {"pipeline": "deterministic", "staleness": 1,
                                     "sampler_devices": 1}])
def test_one_device_is_told_how_to_get_several(online: dict) -> None:
    """On one device neither "at most 0" nor "1 … 0 (of the 1 devices)": the refusal says
    how to get several CPU devices, and what runs without them."""
    import jax

    from jaxrl_llm.online.placement import check_placement

    tree = tiny("run", online=online)
    with pytest.raises(ConfigError) as err:
        check_placement(config_from_dict(tree, schema=OnlineConfig), jax.devices()[:1])
    message = str(err.value)
    assert "this process has 1 device" in message
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=4" in message
    assert "online.exchange" in message and "online.pipeline: off" in message
    assert "at most 0" not in message and "1 … 0" not in message


def test_the_serial_loop_refuses_a_split_placement_instead_of_ignoring_it(tmp_path: Path) -> None:
    tree = tiny(tmp_path / "bad", online={"sampler_devices": 2})
    with pytest.raises(ConfigError, match="run_pipeline"):
        run_online(config_from_dict(tree, schema=OnlineConfig), progress=False)


@pytest.mark.slow  # moved out of the default suite (10 min 27 s on 2026-11-28); CI runs it (16 s)
def test_free_running_keeps_the_bound_and_accounts_for_every_sample(tmp_path: Path) -> None:
    # Not reproducible (which batch meets which weights is timing): the bound and the
    # accounting are what hold in every run. max_staleness 0: a batch trains only on the
    # weights that sampled it, so every batch sampled before the last update is dropped.
    _needs_eight()
    tree = tiny(tmp_path / "free", mesh={"data": 2, "fsdp": 2},
                online={"rounds": 4, "pipeline": "free", "max_staleness": 0,
                        "sampler_devices": 4, "checkpoint_every": 2})
    result = run_free(config_from_dict(tree, schema=OnlineConfig), progress=False)
    assert result.updates == result.rounds == 4
    rows = metric_rows(tmp_path / "free")
    assert len(rows) == 4 and [r["updates"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["pipeline/lag_max"] == 0.0  # the bound
        assert r["pipeline/lag_hist_0"] == 8.0  # the round's one update trained 8 samples
        assert r["pipeline/received_total"] == (r["pipeline/trained_total"]
                                                + r["pipeline/dropped_total"]
                                                + r["pipeline/waiting"])
        assert r["pipeline/received_total"] % 8 == 0
    assert [r["pipeline/trained_total"] for r in rows] == [8.0, 16.0, 24.0, 32.0]
    assert sum(r["pipeline/dropped"] for r in rows) == rows[-1]["pipeline/dropped_total"]
    assert rows[-1]["pipeline/sampled_rounds"] * 8 == rows[-1]["pipeline/received_total"]
    meta = json.loads((tmp_path / "free/checkpoints/4/meta/metadata").read_text())["online"]
    queue = StalenessQueue.from_bytes(0, saved_queue(tmp_path / "free", 4), where="queue")
    assert len(meta["versions"]) == len(queue) == rows[-1]["pipeline/waiting"] / 8
    assert all(0 <= v <= 4 for v in meta["versions"])
    assert (write_report(tmp_path / "free").parent / "pipeline_samples.png").is_file()
    # its checkpoint does not resume as the deterministic pipeline (rounds mean other things)
    tree["online"].update(pipeline="deterministic", staleness=1, rounds=5)
    with pytest.raises(ConfigError, match="written by online.pipeline=free"):
        run_pipeline(config_from_dict(tree, schema=OnlineConfig), progress=False)


def test_free_running_refuses_a_fixed_staleness(tmp_path: Path) -> None:
    tree = tiny(tmp_path / "bad", online={"pipeline": "free", "staleness": 2, "sampler_devices": 1})
    with pytest.raises(ConfigError, match="online.max_staleness"):
        run_free(config_from_dict(tree, schema=OnlineConfig), progress=False)
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow  # a CLI subprocess on 8 devices (~15 s): the default suite's budget
def test_in_flight_weights_from_the_cli_keep_the_bound_for_every_token(tmp_path: Path) -> None:
    """`online.inflight_weights` (PipelineRL's in-flight updates) as a user runs it: the CLI,
    free-running, the sampler on 4 of 8 devices taking newer weights between decode segments.
    Which token meets which weights is timing, so what must hold in every run: every trained
    token's lag (from its record's weight_versions) is within max_staleness, never negative,
    a record spanning two versions was counted as a swap, and the sample accounting closes.
    A swap that must happen is test_weights_published_as_a_free_round_starts_are_swapped_in's
    (forced, not timed); that a swap logs each token's own policy is
    tests/models/test_continuous_sampler.py's exact check; the hook's wiring is below."""
    _needs_eight()
    (tmp_path / "cli").mkdir()
    write_yaml(tmp_path / "cli/online.yaml", tiny(
        "run", mesh={"data": 2, "fsdp": 2}, generate={"max_new_tokens": 32},
        train={"max_seq_len": 256},
        online={"rounds": 5, "pipeline": "free", "max_staleness": 2, "sampler_devices": 4,
                "inflight_weights": True, "mu_source": "sampler"}))
    proc = _cli_online(tmp_path / "cli")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metric_rows(tmp_path / "cli/run")
    assert [r["updates"] for r in rows] == [1, 2, 3, 4, 5]
    swaps = spanning = 0.0
    for r in rows:
        assert 0 <= r["pipeline/token_lag_min"] <= r["pipeline/token_lag_mean"]
        assert r["pipeline/token_lag_mean"] <= r["pipeline/token_lag_max"] <= 2  # the bound
        assert r["pipeline/token_lag_max"] <= r["pipeline/lag_max"]  # oldest token = batch's
        # a count of swaps in the rounds received; a trained record that spans two versions
        # comes from a round received by now, whose swap the count has seen
        swaps += r["pipeline/inflight_swaps"]
        spanning += r["pipeline/inflight_records"]
        assert r["pipeline/inflight_swaps"] == int(r["pipeline/inflight_swaps"])
        assert swaps >= min(spanning, 1.0), (swaps, spanning)
        assert r["pipeline/received_total"] == (r["pipeline/trained_total"]
                                                + r["pipeline/dropped_total"]
                                                + r["pipeline/waiting"])


def test_weights_published_as_a_free_round_starts_are_swapped_in(tmp_path: Path) -> None:
    """The in-flight swap, forced rather than timed: the free-running sampler side takes θ0
    for round 1, the trainer then trains an update and publishes θ1 before the round decodes
    (from the task's `prompt`, which the rollout calls between the two), and the weights hook
    swaps θ1 in at the first segment: one swap counted, every token θ1's, the round's tokens
    those of the same round sampled with θ1 from its start. (A whole free run cannot force
    this: which round meets which publish is timing.)"""
    _needs_eight()
    tree = solvable(tmp_path / "run", online={"pipeline": "free", "max_staleness": 2,
                                              "sampler_devices": 4, "inflight_weights": True,
                                              "mu_source": "sampler"})
    opened = open_run(config_from_dict(tree, schema=OnlineConfig))
    side, run = opened.side, opened.run
    side.free = True  # as run_free sets it: each round starts on the newest weights
    try:
        opened.publish()  # θ0
        first = side.sample(0, 0)
        assert first.version == 0 and first.seconds["inflight_swaps"] == 0.0
        assert _runs(first) == ((0, 0),)  # nothing newer was published: θ0 throughout

        task, prompt = side.policy.task, side.policy.task.prompt
        calls: list[Any] = []

        def prompt_after_an_update(problem: Any) -> str:
            if not calls:  # the trainer's turn (free_rounds: step, count, publish)
                opened.policy.step(first.batches[0])
                run.updates += 1
                opened.publish()
            calls.append(problem)
            return prompt(problem)

        task.prompt = prompt_after_an_update
        swapped = side.sample(1, first.position)
        task.prompt = prompt
        assert calls  # the hook ran inside the round
        assert swapped.version == 0  # the round began on θ0 …
        assert swapped.seconds["inflight_swaps"] == 1.0  # … and swapped once, to θ1
        assert _runs(swapped) == ((1, 0),)  # before its prefill: every token θ1's
        fresh = side.sample(1, first.position)  # the same round on θ1 from its start
        assert fresh.version == 1 and fresh.seconds["inflight_swaps"] == 0.0
        for a, b in zip(_records(swapped), _records(fresh), strict=True):
            np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
            np.testing.assert_array_equal(a.raw_logprobs, b.raw_logprobs)
    finally:
        opened.weights.close()
        opened.checkpointer.close()


def _records(done: Any) -> list[Any]:
    return [r for batch in done.batches for r in batch]


def _runs(done: Any) -> tuple[tuple[int, int], ...]:
    """The one `weight_versions` every record of the round has (it fails when they differ)."""
    runs = {tuple(map(tuple, r.metadata["weight_versions"])) for r in _records(done)}
    assert len(runs) == 1, runs
    return runs.pop()


@pytest.mark.parametrize(("online", "generate", "message"), [
    ({"pipeline": "deterministic", "staleness": 1}, {}, "set online.pipeline: free"),
    ({"pipeline": "free"}, {}, "mu_source=auto.*set online.mu_source: sampler"),
    ({"pipeline": "free", "mu_source": "sampler"}, {"batching": "static"},
     "set generate.batching: continuous"),
])
def test_in_flight_weights_are_refused_where_they_cannot_hold(tmp_path: Path, online: dict,
                                                              generate: dict, message: str) -> None:
    tree = tiny(tmp_path / "bad", generate=generate,
                online={**online, "inflight_weights": True, "sampler_devices": 1})
    run = run_free if online["pipeline"] == "free" else run_pipeline
    with pytest.raises(ConfigError, match=f"inflight_weights=true cannot run: .*{message}"):
        run(config_from_dict(tree, schema=OnlineConfig), progress=False)
    assert not (tmp_path / "bad").exists()


def test_the_api_rollout_tags_each_token_with_the_weights_that_sampled_it() -> None:
    """The wiring the sampler side uses (`Policy.rollout(weights=…)`): weights handed over
    before the first segment sample every token (records equal a rollout of those weights,
    weight_versions [[1, 0]]); handed over later, the tokens before the swap are the old
    weights' and the records name both versions in order."""
    from jaxrl_llm.api import load_policy

    tree = tiny("unused", generate={"max_new_tokens": 24, "n": 2})
    del tree["online"]  # an experiment config: the API's
    old = load_policy(config=config_from_dict(tree))
    new = load_policy(config=config_from_dict({**tree, "seed": 11}))  # other weights, same shapes
    new_state = nnx.split(new.model)[1]
    problems = old.task.load(split="train", num=3, seed=0)
    reference = new.rollout(problems, seed=5)

    def at_call(k):
        calls = []

        def hook():
            calls.append(None)
            return (1, new_state) if len(calls) == k else None
        return hook

    first = old.rollout(problems, seed=5, weights=at_call(1), version=0)
    assert [r.metadata["weight_versions"] for r in first] == [[[1, 0]]] * len(first)
    for a, b in zip(first, reference, strict=True):
        np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
        np.testing.assert_allclose(a.raw_logprobs, b.raw_logprobs, atol=1e-5)
    plain = old.rollout(problems, seed=5)
    late = old.rollout(problems, seed=5, weights=at_call(3), version=0)
    runs = [r.metadata["weight_versions"] for r in late]
    assert all(v[0][1] == 0 and [x for x, _ in v] in ([0], [1], [0, 1]) for v in runs), runs
    assert any(len(v) == 2 for v in runs), runs  # some sample spans the swap
    for record, same, v in zip(late, plain, runs, strict=True):
        before = v[1][1] if len(v) == 2 else (len(record.completion_ids) if v[0][0] == 0 else 0)
        np.testing.assert_array_equal(record.completion_ids[:before], same.completion_ids[:before])


def test_token_lag_metrics_count_each_token_at_its_own_version() -> None:
    """By hand: trained at update 6, a 5-token record sampled by θ_3 (tokens 0–1) and θ_5
    (2–4) has token lags 3, 3, 1, 1, 1; a 2-token record of θ_6 alone at update 7 adds 1, 1."""
    from jaxrl_llm.data.records import Record
    from jaxrl_llm.online.lag import token_lag_metrics

    def rec(length: int, runs: list[list[int]]) -> Record:
        return Record(prompt_ids=[1], completion_ids=[2] * length, reward=0.0,
                      metadata={"weight_versions": runs})

    out = token_lag_metrics([(6, [rec(5, [[3, 0], [5, 2]])]), (7, [rec(2, [[6, 0]])])])
    assert out == {"pipeline/token_lag_min": 1.0, "pipeline/token_lag_mean": 11 / 7,
                   "pipeline/token_lag_max": 3.0, "pipeline/inflight_records": 1.0}
    assert token_lag_metrics([(1, [Record(prompt_ids=[1], completion_ids=[2], reward=0.0)])]) == {}
