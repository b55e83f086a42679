"""Metric writers: one protocol (JSONL, TensorBoard, wandb, custom); `jaxrl-llm train
metrics.wandb=true` in wandb's offline mode writes a run whose history (read back from the
`.wandb` file with wandb's own protobuf schema) holds the values metrics.jsonl holds."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import yaml

from jaxrl_llm.cli import main as cli_main
from jaxrl_llm.data.records import Record
from jaxrl_llm.data.shards import write_records
from jaxrl_llm.train.metrics_log import METRICS_FILE, WANDB_ID_FILE, MetricsLogger

# The `.wandb` file is a LevelDB-style log (wandb's datastore): a 7-byte file header
# (":W&B", magic 0xBEE1, version 0), then 32 KiB blocks of chunks, each with a 7-byte header
# (crc32, length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4).
_BLOCK, _HEADER = 32768, 7


def wandb_records(path: Path) -> list[bytes]:
    """The serialized `wandb_internal_pb2.Record`s of a .wandb file, in order."""
    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0)
    out, pending, pos = [], b"", _HEADER
    while pos + _HEADER <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < _HEADER:  # block trailer padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if length == 0 and kind == 0:  # zero padding at the end of a block
            pos += room
            continue
        chunk = data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            out.append(pending)
            pending = b""
    return out


def wandb_history(path: Path) -> tuple[list[dict], dict]:
    """(history rows, run config) of an offline run file."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows, config = [], {}
    for raw in wandb_records(path):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            rows.append({(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                         for item in record.history.item})
        elif kind in ("run", "config"):
            cfg = record.run.config if kind == "run" else record.config
            for item in cfg.update:
                config[item.key] = json.loads(item.value_json)
    return rows, config


class ListWriter:
    """A custom writer: keeps the rows it is given."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict]] = []
        self.closed = False

    def write(self, step: int, row) -> None:
        self.rows.append((step, dict(row)))

    def close(self) -> None:
        self.closed = True


def test_every_writer_gets_the_same_row(tmp_path):
    custom = ListWriter()
    with MetricsLogger(tmp_path, tensorboard=False, writers=[custom]) as log:
        log.log(1, {"loss": np.float32(0.5), "grad_norm": float("nan")})
        log.log(2, {"loss": 0.25})
    lines = [json.loads(x) for x in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert [row for _, row in custom.rows] == lines
    assert lines[0]["loss"] == 0.5 and lines[0]["grad_norm"] is None  # strict JSON
    assert custom.closed


def test_missing_wandb_names_the_extra(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("no wandb")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    from jaxrl_llm.config import MetricsConfig

    with pytest.raises(ImportError, match=r"metrics.wandb=true needs .*jaxrl_llm\[wandb\]"):
        MetricsLogger(tmp_path, tensorboard=False, wandb=MetricsConfig(wandb=True))


def test_train_logs_to_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the test extra installs wandb")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wb").mkdir()
    rng = np.random.default_rng(0)
    records = [Record(prompt_ids=np.array([1, 2 + i]), completion_ids=rng.integers(3, 60, 5),
                      reward=1.0 if i % 2 else -1.0, correct=bool(i % 2), group_id=i,
                      mu_logprobs=np.full(5, -3.0, np.float32)) for i in range(8)]
    write_records(tmp_path / "recs", records, vocab_size=64)
    config = {
        "name": "wandb-offline", "run_dir": "run", "seed": 1,
        "model": {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                  "num_layers": 1, "num_heads": 2, "num_kv_heads": 1},
        "optim": {"learning_rate": 1e-2}, "data": {"records": "recs"},
        "train": {"steps": 3, "batch_size": 8, "max_seq_len": 8, "log_every": 1},
    }
    Path("exp.yaml").write_text(yaml.safe_dump(config))
    assert cli_main(["train", "--config", "exp.yaml", "--no-progress", "metrics.wandb=true",
                     "metrics.wandb_project=p19", "metrics.wandb_tags=[cpu,test]"]) == 0
    import wandb

    # `run.finish()` returns before wandb's service process has flushed the offline file to
    # disk (seen on a loaded machine: no history rows yet); teardown waits for that process.
    wandb.teardown()

    jsonl = [json.loads(x) for x in (tmp_path / "run" / METRICS_FILE).read_text().splitlines()]
    assert [r["step"] for r in jsonl] == [1, 2, 3]
    run_id = (tmp_path / "run" / WANDB_ID_FILE).read_text().strip()
    files = list((tmp_path / "wb" / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 1, list((tmp_path / "wb").rglob("*"))
    history, run_config = wandb_history(files[0])
    by_step = {int(row["step"]): row for row in history if "step" in row}
    assert sorted(by_step) == [1, 2, 3]
    for row in jsonl:
        logged = by_step[row["step"]]
        for name in ("loss", "grad_norm", "learning_rate", "throughput/tokens_per_s"):
            assert logged[name] == pytest.approx(row[name], rel=1e-12), name
    assert run_config["name"] == "wandb-offline"
    assert run_config["train"]["steps"] == 3 and run_config["metrics"]["wandb"] is True
