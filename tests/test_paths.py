"""Run and output paths: relative ones resolved once when the config is loaded, `gs://` kept as
`gs://` from the config to every writer (metrics, config.yaml, checkpoints, export, eval,
report), never a local `./gs:/…` directory.

Remote paths run against a fake GCS: `etils.epath.testing.mock_epath` with every file-system
call for `gs://bucket/…` redirected to a local directory (and the redirected calls recorded).
Orbax talks to GCS with its own client (not epath), so for the trainer's checkpoints the test
records the directory object Orbax's `CheckpointManager` receives instead.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from etils import epath
from etils.epath import testing as epath_testing

from jaxrl_llm.config import ConfigError, config_from_dict, load_config
from jaxrl_llm.core.paths import (
    RUN_PATH_KEYS,
    absolute,
    as_path,
    copy_tree,
    find_files,
    resolve_paths,
)

BUCKET = "gs://bucket/exp"


@contextlib.contextmanager
def fake_gcs(store: Path) -> Iterator[list[str]]:
    """epath calls on `gs://X` act on `store/X`; yields the list of gs:// paths touched."""
    root = str(store)
    touched: list[str] = []

    def local(path: object) -> str:
        text = os.fspath(path)
        if text.startswith("gs://"):
            touched.append(text)
            return os.path.join(root, text.removeprefix("gs://"))
        return text

    def remote(path: str) -> str:
        return "gs://" + os.path.relpath(path, root) if path.startswith(root + os.sep) else path

    def one(orig, path, *args, **kwargs):
        return orig(local(path), *args, **kwargs)

    def two(orig, path, dst, *args, **kwargs):
        return orig(local(path), local(dst), *args, **kwargs)

    def glob(orig, pattern):
        return [remote(p) for p in orig(local(pattern))]

    def walk(orig, top, **kwargs):
        for base, dirs, files in orig(local(top), **kwargs):
            yield remote(base), dirs, files

    with epath_testing.mock_epath(
        open=one, exists=one, isdir=one, listdir=one, makedirs=one, mkdir=one, remove=one,
        rmtree=one, stat=one, rename=two, replace=two, copy=two, glob=glob, walk=walk,
    ):
        yield touched


# -- resolution at load ---------------------------------------------------------------------

def test_relative_paths_resolve_against_the_working_directory_at_load(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_config(None, ["run_dir=runs/a", "data.records=data/../recs",
                                "data.curated=./cur", "generate.output=out/records",
                                "generate.score_output=~/scored"])
    assert config.run_dir == str(tmp_path / "runs" / "a")
    assert config.data.records == str(tmp_path / "recs")
    assert config.data.curated == str(tmp_path / "cur")
    assert config.generate.output == str(tmp_path / "out" / "records")
    assert config.generate.score_output == str(Path.home() / "scored")
    # The default run_dir too (a dataclass default is not validated unless asked).
    assert load_config(None).run_dir == str(tmp_path / "runs" / "experiment")
    # Resolved once: moving elsewhere later does not move the run.
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert config.run_dir == str(tmp_path / "runs" / "a")
    assert config_from_dict(config.model_dump()).run_dir == str(tmp_path / "runs" / "a")


def test_assignment_after_load_resolves_too(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_config(None)
    config.data.curated = "later"
    assert config.data.curated == str(tmp_path / "later")


def test_gs_paths_stay_gs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_config(None, [f"run_dir={BUCKET}", f"data.records={BUCKET}/records"])
    assert config.run_dir == BUCKET and config.data.records == f"{BUCKET}/records"
    checkpoints = as_path(config.run_dir) / "checkpoints"
    assert isinstance(checkpoints, epath.Path)
    assert os.fspath(checkpoints) == f"{BUCKET}/checkpoints"
    assert not (tmp_path / "gs:").exists()


@pytest.mark.parametrize(("value", "message"), [
    ("gs:/bucket/exp", "collapsed by pathlib.Path"),  # what str(pathlib.Path("gs://…")) gives
    ("", "empty path"),
])
def test_bad_paths_are_refused_naming_the_key(value, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"run_dir={value}"])
    assert "'run_dir'" in str(err.value) and message in str(err.value)


def test_resolve_paths_fixes_an_unvalidated_config(tmp_path, monkeypatch):
    from jaxrl_llm.config import ExperimentConfig

    monkeypatch.chdir(tmp_path)
    raw = ExperimentConfig.model_construct(run_dir="rel")  # skips validation
    raw.data = raw.data.model_construct(records="r", curated=f"{BUCKET}/c")
    raw.generate = raw.generate.model_construct(output=None, score_output=None)
    fixed = resolve_paths(raw)
    assert (fixed.run_dir, fixed.data.records, fixed.data.curated) == (
        str(tmp_path / "rel"), str(tmp_path / "r"), f"{BUCKET}/c")
    assert raw.run_dir == "rel"  # a copy
    assert set(RUN_PATH_KEYS) >= {"run_dir", "data.records", "data.curated"}


def test_absolute_and_as_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert absolute("x/../y") == str(tmp_path / "y")
    assert absolute(Path("/abs")) == "/abs"
    assert absolute("s3://b/k") == "s3://b/k"
    assert os.fspath(as_path(epath.Path("gs://b") / "k")) == "gs://b/k"
    assert os.fspath(as_path("rel")) == str(tmp_path / "rel")


# -- gs:// end to end against the fake GCS -------------------------------------------------------

def test_metrics_log_eval_report_and_stage_log_on_gs(tmp_path, monkeypatch):
    from jaxrl_llm.core.paths import append_text
    from jaxrl_llm.eval.evaluate import write_eval
    from jaxrl_llm.eval.report import write_report
    from jaxrl_llm.flows.iterate import StageLog
    from jaxrl_llm.train.metrics_log import MetricsLogger

    store, cwd = tmp_path / "store", tmp_path / "cwd"
    store.mkdir()
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    with fake_gcs(store) as touched:
        with MetricsLogger(f"{BUCKET}/train", tensorboard=False) as log:
            for step in (1, 2, 3):
                log.log(step, {"loss": 0.5 * step})
        with MetricsLogger(f"{BUCKET}/train", resume_step=2, tensorboard=False) as log:
            log.log(3, {"loss": 9.0})
        append_text(f"{BUCKET}/metrics.jsonl", json.dumps({"step": 0, "samples/x": 1}) + "\n")
        summary = {"pass_at_1": {"mean": 0.25, "se": 0.05}, "label": "iter 1", "step": 3,
                   "proportions": {"correct": 0.25, "incorrect": 0.7, "invalid": 0.05}}
        written = write_eval(f"{BUCKET}/iter_1/eval", summary)
        StageLog(as_path(f"{BUCKET}/iter_1")).mark("evaluate", {"path": os.fspath(written)})
        report = write_report(BUCKET)
        found = [os.fspath(p) for p in find_files(BUCKET, "metrics.jsonl")]

    assert os.fspath(written) == f"{BUCKET}/iter_1/eval/eval.json"
    assert os.fspath(report) == f"{BUCKET}/report/report.md"
    assert found == [f"{BUCKET}/metrics.jsonl", f"{BUCKET}/train/metrics.jsonl"]
    assert all(p.startswith("gs://bucket/") for p in touched)
    on_disk = store / "bucket" / "exp"
    rows = [json.loads(line) for line in (on_disk / "train" / "metrics.jsonl").read_text()
            .splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 0.5), (2, 1.0), (3, 9.0)]
    assert json.loads((on_disk / "iter_1" / "eval" / "eval.json").read_text()) == summary
    assert json.loads((on_disk / "iter_1" / "stages.json").read_text())["evaluate"]["path"] \
        == f"{BUCKET}/iter_1/eval/eval.json"
    md = (on_disk / "report" / "report.md").read_text()
    assert "iter 1" in md and "0.250" in md
    assert (on_disk / "report" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in cwd.iterdir()) == []  # nothing local, no ./gs:/…


# -- the trainer: a relative run_dir through real Orbax saves; gs:// to Orbax intact ------------

TINY = {
    "seed": 1,
    "model": {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_layers": 1,
              "num_heads": 2, "num_kv_heads": 1, "max_position_embeddings": 64},
    "optim": {"learning_rate": 1e-2},
    "loss": {"name": "sft"},
    "train": {"steps": 2, "batch_size": 8, "max_seq_len": 16, "log_every": 1,
              "checkpoint_every": 2},
}


@pytest.fixture(scope="module")
def records_dir(tmp_path_factory) -> Path:
    from jaxrl_llm.data.shards import write_records
    from tests.data.helpers import make_records

    path = tmp_path_factory.mktemp("paths") / "records"
    write_records(path, make_records(12, seed=4), vocab_size=64)
    return path


def test_relative_run_dir_trains_checkpoints_and_resumes(tmp_path, monkeypatch, records_dir,
                                                         capsys):
    """The README's case: a config with relative paths, run from its directory (Orbax refuses
    relative checkpoint paths, so this failed at the first save)."""
    import yaml

    from jaxrl_llm.cli import main as cli_main
    from jaxrl_llm.train.checkpoint import Checkpointer

    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    os.symlink(records_dir, work / "data" / "records")
    (work / "exp.yaml").write_text(yaml.safe_dump(
        {**TINY, "run_dir": "runs/rel", "data": {"records": "data/records"}}))
    monkeypatch.chdir(work)
    assert cli_main(["train", "--config", "exp.yaml", "--no-progress"]) == 0
    assert "trained 2 steps" in capsys.readouterr().out
    run = work / "runs" / "rel"
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["run_dir"] == str(run) and saved["data"]["records"] == str(work / "data/records")

    monkeypatch.chdir(tmp_path)  # elsewhere: the checkpoint restores by its absolute path
    ckpt = Checkpointer(run / "checkpoints", async_save=False)
    try:
        assert ckpt.all_steps() == [2]
        assert ckpt.read_meta()["config"]["run_dir"] == str(run)
    finally:
        ckpt.close()
    monkeypatch.chdir(work)  # a re-run resumes from the committed step (nothing to train)
    assert cli_main(["train", "--config", "exp.yaml", "--no-progress"]) == 0
    assert "trained 2 steps" in capsys.readouterr().out


def test_relative_checkpointer_directory_saves_and_restores(tmp_path, monkeypatch):
    import jax.numpy as jnp

    from jaxrl_llm.train.checkpoint import Checkpointer, abstract_like

    monkeypatch.chdir(tmp_path)
    tree = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3, jnp.int32)}
    with Checkpointer("ckpts", async_save=False) as ckpt:
        assert os.fspath(ckpt.directory) == str(tmp_path / "ckpts")
        assert ckpt.save(1, tree, meta={"note": "rel"}, force=True)
    monkeypatch.chdir("/")
    with Checkpointer(tmp_path / "ckpts", async_save=False) as ckpt:
        restored = ckpt.restore(abstract_like(tree))
    assert restored.step == 1 and restored.meta["note"] == "rel"
    np.testing.assert_array_equal(restored.state["w"], np.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(restored.state["b"], np.ones(3, np.int32))


class RecordingManager:
    """Stands in for `orbax.checkpoint.CheckpointManager` (whose GCS client is not epath's)."""

    instances: list[RecordingManager] = []

    def __init__(self, directory, options=None):
        self.directory, self.saved = directory, []
        RecordingManager.instances.append(self)

    def latest_step(self):
        return self.saved[-1] if self.saved else None

    def all_steps(self):
        return list(self.saved)

    def save(self, step, args=None, force=False):
        self.saved.append(step)
        return True

    def wait_until_finished(self):
        pass

    def close(self):
        pass


def test_gs_run_dir_reaches_every_writer_as_gs(tmp_path, monkeypatch, records_dir):
    from jaxrl_llm.policy.export import atomic_save
    from jaxrl_llm.train import checkpoint as checkpoint_module
    from jaxrl_llm.train.trainer import Trainer

    store, cwd = tmp_path / "store", tmp_path / "cwd"
    store.mkdir()
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(checkpoint_module.ocp, "CheckpointManager", RecordingManager)
    RecordingManager.instances.clear()
    config = config_from_dict({**TINY, "run_dir": f"{BUCKET}/train",
                               "data": {"records": str(records_dir)}})
    with fake_gcs(store) as touched:
        trainer = Trainer(config, progress=False, tensorboard=False)
        try:
            result = trainer.run()
        finally:
            trainer.close()
        export = atomic_save(result.state.model(), f"{BUCKET}/export")
        back = copy_tree(export, tmp_path / "back")  # what `evaluate --model gs://…` reads
    (manager,) = RecordingManager.instances
    assert isinstance(manager.directory, epath.Path)
    assert os.fspath(manager.directory) == f"{BUCKET}/train/checkpoints"
    assert manager.saved == [2]
    assert os.fspath(result.metrics_path) == f"{BUCKET}/train/metrics.jsonl"
    assert os.fspath(export) == f"{BUCKET}/export"
    on_disk = store / "bucket" / "exp"
    assert [json.loads(r)["step"] for r in (on_disk / "train" / "metrics.jsonl").read_text()
            .splitlines()] == [1, 2]
    assert "run_dir: gs://bucket/exp/train" in (on_disk / "train" / "config.yaml").read_text()
    assert {"config.json", "model.safetensors"} <= {p.name for p in (on_disk / "export").iterdir()}
    for name in ("config.json", "model.safetensors"):
        assert (back / name).read_bytes() == (on_disk / "export" / name).read_bytes()
    assert all(p.startswith("gs://bucket/exp/") for p in touched)
    assert sorted(p.name for p in cwd.iterdir()) == []  # no ./gs:/bucket/…


@pytest.mark.slow
def test_quickstart_with_its_default_relative_run_dir(tmp_path):
    """The README's first command as run from a checkout: no run_dir given, so the default
    `runs/quickstart` (relative) must get through SFT, its Orbax saves and the export."""
    import subprocess
    import sys

    from tests.train.test_quickstart import TINY

    cli = "import sys; from jaxrl_llm.cli import main; sys.exit(main())"
    result = subprocess.run([sys.executable, "-c", cli, "quickstart", "--no-progress", *TINY],
                            cwd=tmp_path, capture_output=True, text=True,
                            stdin=subprocess.DEVNULL, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run = tmp_path / "runs" / "quickstart"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["paths"]["run_dir"] == str(run)
    assert (run / "sft" / "run" / "checkpoints").is_dir()
    assert (run / "iter_1" / "export" / "model.safetensors").is_file()
    assert "transformers loads the export: ok" in result.stdout
