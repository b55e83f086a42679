"""`online.exchange` (jaxrl_llm/online/remote.py, exchange.py): the trainer and a rollout
worker as separate processes sharing only a directory compute what the serial loop computes,
bit for bit; what either side cannot use in the exchange is refused with the path, the cause
and the fix, and nothing half-written is ever loaded."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from jaxrl_llm.cli import main
from jaxrl_llm.config import ConfigError, config_from_dict
from jaxrl_llm.online.config import OnlineConfig
from jaxrl_llm.online.exchange import Exchange, ExchangeError, read_blob, write_blob
from jaxrl_llm.online.pipeline import run_pipeline
from jaxrl_llm.online.remote import run_trainer, run_worker
from tests.faults.harness import base_env, cli
from tests.online.exchange_helpers import (
    assert_serial_equal,
    finish_all,
    readme_commands,
    setup,
    start,
)
from tests.online.helpers import metric_rows, tiny, write_yaml
from tests.reliability import record


@pytest.mark.slow
def test_trainer_and_worker_processes_equal_the_serial_loop_bit_for_bit(tmp_path: Path) -> None:
    # The README's two command lines, run as they are in a working directory of relative
    # paths (run/, exchange/), against `jaxrl-llm online` serial on the same config.
    env = dict(base_env(tmp_path / "jax-cache"), JAXRL_PROGRESS_INTERVAL_S="0")
    setup(tmp_path)
    trainer_args, worker_args = readme_commands()[:2]
    # serial first: the two sides then find its compiled programs in the cache
    cli(["online", "--config", "serial.yaml", "--no-progress"], cwd=tmp_path, env=env)
    trainer = start(trainer_args, tmp_path, env, "trainer.log")
    worker = start(worker_args, tmp_path, env, "worker.log")
    trainer_out, worker_out = finish_all([trainer, worker], tmp_path,
                                         ["trainer.log", "worker.log"])
    rows = assert_serial_equal(tmp_path)
    # a progress line per side; the worker sampled all 6 rounds
    assert "trainer: 4/4" in trainer_out and "worker 0: 6/6" in worker_out, worker_out[-2000:]
    assert json.loads(worker_out[worker_out.rindex("{"):])["sampled_rounds"] == 6
    # round r samples with θ_max(0, r−2); update u trains on it s = 2 updates later
    assert [r["pipeline/version"] for r in rows] == [0.0, 0.0, 0.0, 1.0, 2.0, 3.0]
    assert [r.get("pipeline/lag_max") for r in rows] == [None, None, 0.0, 1.0, 2.0, 2.0]
    assert all(r["pipeline/worker"] == 0.0 and r["pipeline/sampler_busy_s"] > 0 for r in rows)
    assert sum(r["pipeline/syncs"] for r in rows) == 4  # θ_0 … θ_3, each published once
    # garbage collected: no shard the trainer's last checkpoint passed, no version left
    # that a round after it samples with (none: the run is over)
    ex = Exchange(str(tmp_path / "exchange"), 1)
    assert ex.sampled_rounds() == [] and ex.versions() == []
    assert ex.progress()["done"] is True and not list((tmp_path / "exchange").rglob(".*tmp"))


def _config(tmp_path: Path, **online: object) -> OnlineConfig:
    tree = tiny(tmp_path / "run", online={
        "rounds": 1, "staleness": 1, "pipeline": "deterministic", "mu_source": "trainer",
        "exchange": str(tmp_path / "exchange"), "worker_timeout_s": 3, **online})
    return config_from_dict(tree, schema=OnlineConfig)


@pytest.mark.reliability
@pytest.mark.slow  # ten refused set-ups, each with real side processes (~45 s)
def test_what_the_exchange_cannot_use_is_refused_naming_path_cause_and_fix(tmp_path: Path) -> None:
    failures = 0
    try:
        _refusals(tmp_path)
    except AssertionError:
        failures = 1
        raise
    finally:
        record("bad input", "online exchange: what a side cannot use", runs=10,
               failures=failures, detail="no worker (trainer: no record shard of round 0 … "
               "within online.worker_timeout_s … may not share this path); a worker of "
               "another model (model.hidden_size: worker 64, the exchange 32) or seed; a "
               "weight version torn at its final name (half-written … never loaded) or only "
               "at a temporary name (not loaded: no weight version θ_0 … within "
               "worker_timeout_s); a shard of θ_1 where the bound says θ_0 (outside the "
               "bound); a shard of another run (written by the run with id …, not this run …); a "
               "torn shard (half-written record shard); a trainer of another learning rate "
               "with its own run_dir (training settings differ … run.optim.learning_rate …, "
               "naming both runs)")


def _refusals(tmp_path: Path) -> None:
    # In one process, in turn: a trainer alone, workers beside its manifest and θ_0.
    ex = Exchange(str(tmp_path / "exchange"), 1)
    # 1. no worker: the trainer waits online.worker_timeout_s for round 0, then names the path
    with pytest.raises(ExchangeError, match=r"no record shard of round 0 \(worker 0\) in .*"
                       r"exchange within online.worker_timeout_s=3 s.*--role worker --worker 0"
                       r".*may not share this path"):
        run_trainer(_config(tmp_path), progress=False)
    assert ex.versions() == [0] and (tmp_path / "exchange/manifest.json").is_file()
    assert not (tmp_path / "run/checkpoints").exists() or \
        not list((tmp_path / "run/checkpoints").iterdir())
    # 2. a worker of another model: refused before sampling, both values named
    bigger = _config(tmp_path)
    bigger.model.hidden_size = 64
    with pytest.raises(ExchangeError, match=r"worker's model or tokenizer differ from what the "
                       r"trainer publishes .*model.hidden_size: worker 64, the exchange 32"):
        run_worker(bigger, 0, progress=False)
    # 3. a worker of other sampling settings (here the seed): refused, naming the key
    with pytest.raises(ExchangeError, match=r"sampling settings differ.*run.seed: worker 4, "
                       "the exchange 3"):
        run_worker(_config(tmp_path).model_copy(update={"seed": 4}), 0, progress=False)
    # 4. θ_0 torn at its final name (copied by hand, not renamed into place): never loaded
    path = ex.part_path(0, 0, 1)
    whole = path.read_bytes()
    path.write_bytes(whole[:len(whole) // 2])
    with pytest.raises(ExchangeError, match=r"v00000000-p000of001.bin: half-written weight "
                       r"version θ_0 \(part 0 of 1\).*never loaded.*delete it"):
        run_worker(_config(tmp_path), 0, progress=False)
    assert ex.sampled_rounds() == []
    # 5. only a temporary name (a writer killed mid-write): not a version; the worker waits
    # for θ_0, then names the exchange
    path.unlink()
    (path.parent / ".v00000000-p000of001.bin.abc123.tmp").write_bytes(whole[:100])
    with pytest.raises(ExchangeError, match=r"no weight version θ_0 in .*exchange within "
                       r"online.worker_timeout_s=3 s.*--role trainer"):
        run_worker(_config(tmp_path), 0, progress=False)
    # 6. θ_0 whole: the worker samples both rounds (θ_0 samples rounds 0 and 1 at s = 1)
    path.write_bytes(whole)
    assert run_worker(_config(tmp_path), 0, progress=False)["sampled_rounds"] == 2
    assert ex.sampled_rounds() == [0, 1]
    # 7. a shard of a version outside the bound (round 0 claiming θ_1): refused by the trainer
    shard = ex.round_path(0)
    header, payload = read_blob(shard, "shard")
    write_blob(shard, {**header, "version": 1}, payload)
    with pytest.raises(ExchangeError, match=r"r00000000.bin: round 0 was sampled with θ_1, "
                       r"outside the bound: online.staleness=1 samples it with θ_0.*delete it"):
        run_trainer(_config(tmp_path), progress=False)
    # 8. a shard another run wrote (its run id differs): refused, naming both runs
    write_blob(shard, {**header, "run": "0123456789abcdef"}, payload)
    with pytest.raises(ExchangeError, match=r"r00000000.bin: this record shard was written by "
                       r"the run with id 0123456789abcdef, not this run 'experiment' \(id "
                       r"[0-9a-f]{16}, run_dir .*run\): another run shared this "
                       r"online.exchange"):
        run_trainer(_config(tmp_path), progress=False)
    # 9. a torn shard: refused, not read
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(ExchangeError, match=r"half-written record shard of round 0"):
        run_trainer(_config(tmp_path), progress=False)
    # 10. issue 55 item 3: a new run (its own run_dir) with another learning rate on the same
    # exchange is refused before it trains, naming both runs and the key; it never takes the
    # other run's weights or shards because their version numbers match
    other = _config(tmp_path)
    other.run_dir = str(tmp_path / "run-lr")
    other.optim.learning_rate *= 2
    lr = _config(tmp_path).optim.learning_rate
    with pytest.raises(ExchangeError, match=(
            r"this trainer's training settings differ from what the trainer publishes in .*"
            rf"manifest.json \(run.optim.learning_rate: trainer {2 * lr!r}, the exchange "
            rf"{lr!r}\): this trainer is run 'experiment' \(id [0-9a-f]{{16}}, run_dir "
            r".*run-lr\), the exchange holds run 'experiment' \(id [0-9a-f]{16}, run_dir "
            r".*run\)")):
        run_trainer(other, progress=False)
    assert not list((tmp_path / "run-lr/checkpoints").glob("*"))  # nothing trained


@pytest.mark.parametrize(("argv", "message"), [
    (["--role", "trainer"], "--role trainer needs online.exchange"),
    (["online.exchange=ex"], "online.exchange=.*ex runs one side .*add --role trainer"),
    (["online.exchange=ex", "--role", "worker"], "--role worker needs --worker K"),
    (["online.exchange=ex", "online.workers=2", "--role", "worker", "--worker", "2"],
     r"0 <= K < online.workers=2 \(got 2\)"),
    (["online.exchange=ex", "online.pipeline=deterministic", "online.staleness=0", "--role",
      "trainer"], "staleness >= 1 .*nothing can overlap"),
    (["online.exchange=ex", "online.pipeline=deterministic", "online.staleness=0", "--role",
      "worker", "--worker", "0"], "staleness >= 1 .*nothing can overlap"),
    (["online.exchange=ex", "online.pipeline=deterministic", "online.staleness=1",
      "generate.backend=vllm", "generate.top_k=5", "--role", "worker", "--worker", "0"],
     "vLLM rollout worker needs untruncated sampling .*got top_k=5"),
    (["online.exchange=ex", "online.staleness=1", "--role", "trainer"],
     "online.exchange=.*ex runs the sampler in worker processes: set online.pipeline"),
])
def test_roles_and_exchange_mistakes_are_refused_before_loading(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
        argv: list[str], message: str) -> None:
    monkeypatch.chdir(tmp_path)
    write_yaml(tmp_path / "online.yaml", tiny("run"))
    assert main(["online", "--config", "online.yaml", "--no-progress", *argv]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "run").exists() and not (tmp_path / "ex").exists()


def test_an_exchange_config_is_refused_by_the_one_process_pipeline(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="online.exchange.*--role trainer"):
        run_pipeline(_config(tmp_path), progress=False)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # a trainer and two workers as processes (~1 min)
def test_free_running_workers_keep_the_bound_and_account_for_every_sample(tmp_path: Path) -> None:
    # Not reproducible (which round meets which version is timing): what holds in every run
    # is the bound and the accounting, as for the in-memory free-running pipeline.
    env = base_env(tmp_path / "jax-cache")
    setup(tmp_path, pipeline="free", staleness=0, max_staleness=1, workers=2,
          mu_source="sampler", checkpoint_every=2)
    trainer_args, worker_args = readme_commands()[:2]
    sides = [start(trainer_args, tmp_path, env, "trainer.log")] + [
        start([*worker_args[:-1], str(k)], tmp_path, env, f"worker{k}.log") for k in (0, 1)]
    outputs = finish_all(sides, tmp_path, ["trainer.log", "worker0.log", "worker1.log"])
    rows = metric_rows(tmp_path / "run")
    assert [r["updates"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["pipeline/lag_max"] <= 1.0  # the bound
        assert r["pipeline/received_total"] == (r["pipeline/trained_total"]
                                                + r["pipeline/dropped_total"]
                                                + r["pipeline/waiting"])
    assert [r["pipeline/trained_total"] for r in rows] == [8.0, 16.0, 24.0, 32.0]
    assert rows[-1]["pipeline/sampled_rounds"] * 8 == rows[-1]["pipeline/received_total"]
    # the workers stopped when the trainer was done, each having sampled its own rounds
    sampled = [json.loads(out[out.rindex("{"):])["sampled_rounds"] for out in outputs[1:]]
    assert all(n >= 1 for n in sampled)
    assert sum(sampled) >= rows[-1]["pipeline/sampled_rounds"]
    assert Exchange(str(tmp_path / "exchange"), 1).progress()["done"] is True
