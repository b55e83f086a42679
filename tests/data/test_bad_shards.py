"""A damaged shard is an error that names the shard file and says what to do, in every stage
that reads records (array_record itself raises a RuntimeError without text)."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxrl_llm.cli import main
from jaxrl_llm.data.records import RecordError
from jaxrl_llm.data.shards import RecordSource, write_records
from tests.data.helpers import make_records

BAD = "records-00001.array_record"


def damaged(directory: Path, how: str) -> Path:
    write_records(directory, make_records(40, group_size=4), records_per_shard=20)
    shard = directory / BAD
    data = bytearray(shard.read_bytes())
    if how == "truncated":
        data = data[: len(data) // 2]
    else:  # flip bytes inside the first chunk's data (bytes 104-363) only: its hash no longer
        # matches, and no other chunk is damaged, so a reader that reads chunks in parallel
        # reports the same chunk every time
        data[150:300] = bytes(b ^ 0xFF for b in data[150:300])
    shard.write_bytes(bytes(data))
    return directory


@pytest.fixture
def truncated(tmp_path) -> Path:
    return damaged(tmp_path / "recs", "truncated")


def test_record_source_names_the_truncated_shard(truncated):
    with pytest.raises(RecordError, match=rf"{truncated / BAD}: shard is truncated or corrupt.*"
                                          r"re-run the stage that wrote"):
        RecordSource(truncated)


def test_record_source_names_a_corrupt_shard_on_read(tmp_path):
    directory = damaged(tmp_path / "recs", "corrupt")
    source = RecordSource(directory)  # the footer is intact: opening works
    assert len(source) == 40
    with pytest.raises(RecordError, match=rf"{directory / BAD}.*corrupt or truncated"):
        [source[i] for i in range(len(source))]


def test_data_stats_curate_and_train_name_the_file(truncated, tmp_path, capsys):
    assert main(["data", "stats", str(truncated)]) == 2
    assert str(truncated / BAD) in capsys.readouterr().err
    assert main(["curate", "--records", str(truncated), "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert str(truncated / BAD) in err and "data.curation" not in err  # not blamed on the config
    assert not (tmp_path / "c").exists()
    config = tmp_path / "c.yaml"
    config.write_text(f"run_dir: {tmp_path / 'run'}\nloss: {{name: sft}}\n")
    assert main(["train", "--config", str(config), "--records", str(truncated), "--no-progress"]) == 2
    assert str(truncated / BAD) in capsys.readouterr().err


def test_score_names_the_file(truncated, tmp_path):
    from jaxrl_llm.train.score import score_records

    # the records are opened before the model is touched
    with pytest.raises(RecordError, match=str(truncated / BAD)):
        score_records(None, str(truncated), str(tmp_path / "scored"), batch_size=4, progress=False)
    assert not (tmp_path / "scored").exists()
