"""The bad-input corpus, one input at a time through the public command (`jaxrl_llm.cli.main`
in a tmp cwd, relative paths): each fails before any training, with a message naming the
file, record, field or key, and leaves no checkpoint. Inputs are built by fixtures here (no
binary blobs in git). Rows go to RELIABILITY.md (tests/reliability.py), section "bad input".
"""

from __future__ import annotations

from pathlib import Path

import msgpack
import numpy as np
import pytest

import jaxrl_llm.data.shards as shards
from jaxrl_llm.cli import main
from jaxrl_llm.data.shards import write_records
from tests.data.helpers import make_records
from tests.data.test_bad_shards import BAD, damaged
from tests.reliability import record

pytestmark = pytest.mark.reliability
SHARD = "recs/records-00001.array_record"  # the second shard: records 20..39
TRAIN = ("run_dir: run\nloss: {name: topr}\n"
         "train: {steps: 2, batch_size: 8, checkpoint_every: 1, max_seq_len: 32}\n")


@pytest.fixture(autouse=True)
def cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("c.yaml").write_text(TRAIN)
    return tmp_path


def write_unvalidated(records, monkeypatch, directory="recs") -> str:
    """Write records the writer would refuse (as a buggy or foreign writer could)."""
    with monkeypatch.context() as m:
        m.setattr(shards, "validate_record", lambda *a, **k: None)
        write_records(directory, records, records_per_shard=20)
    return directory


def train(*extra: str) -> list[str]:
    return ["train", "--config", "c.yaml", "--no-progress", *extra]


def fails_naming(argv, capsys, *named: str) -> str:
    """Run the command; it must exit 2 with every `named` text in its message, train nothing."""
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, (code, err)
    for text in named:
        assert text in err, (text, err)
    assert not Path("run/checkpoints").exists() or not any(Path("run/checkpoints").iterdir())
    assert not Path("run/metrics.jsonl").exists()
    return err.splitlines()[-1] if err else ""


def _nan(r):
    r[35].mu_logprobs[1 % r[35].mu_logprobs.size] = np.nan


def _positive(r):
    r[35].behavior_logprobs[0] = 0.5


def _length(r):
    r[35].mu_logprobs = np.concatenate([r[35].mu_logprobs, [-1.0]]).astype(np.float32)


def _oov(r):
    r[35].completion_ids[0] = 10_000  # the default random model has 512 ids


def _empty(r):
    r[35].completion_ids = np.zeros(0, np.int32)
    r[35].behavior_logprobs = r[35].mu_logprobs = np.zeros(0, np.float32)


def _overlong(r):
    r[35].completion_ids = np.ones(100, np.int32)
    r[35].behavior_logprobs = r[35].mu_logprobs = -np.ones(100, np.float32)


def _inf_reward(r):
    r[35].reward = float("inf")


def _episode(r, mask):
    """A multi-turn episode (data/records.py `action_mask`) of 5 tokens with `mask`, its
    log-probs 0.0 wherever the mask is not 1."""
    r[35].completion_ids = np.asarray([3, 4, 5, 6, 7], np.int32)
    lp = np.where(np.resize(np.asarray(mask), 5) == 1, -0.5, 0.0).astype(np.float32)
    r[35].behavior_logprobs, r[35].mu_logprobs = lp, lp.copy()
    r[35].action_mask = np.asarray(mask)


def _logprob_at_environment_token(r):
    _episode(r, [1, 1, 0, 0, 1])
    r[35].mu_logprobs[2] = -1.25


# (what, mutation, texts the message must name); record 35 = the last shard's index 15, so a
# lazy reader would have trained on the first batches before meeting it.
RECORD_CASES = [
    ("record with a NaN log-prob", _nan, [f"{SHARD}[15]", "mu_logprobs", "not finite"]),
    ("record with a positive log-prob", _positive, [f"{SHARD}[15]", "behavior_logprobs", "positive"]),
    ("log-probs/completion length mismatch", _length, [f"{SHARD}[15]", "mu_logprobs", "shape"]),
    ("out-of-vocabulary token id", _oov, [f"{SHARD}[15]", "completion_ids", "10000"]),
    ("empty completion", _empty, [f"{SHARD}[15]", "completion_ids is empty"]),
    ("overlong sequence", _overlong, [f"{SHARD}[15]", "train.max_seq_len"]),
    ("non-finite reward", _inf_reward, [f"{SHARD}[15]", "reward"]),
    ("action mask of the wrong length", lambda r: _episode(r, [1, 0, 1]),
     [f"{SHARD}[15]", "action_mask", "shape (3,)", "5 tokens"]),
    ("action mask holding a value other than 0/1", lambda r: _episode(r, [1, 1, 2, 0, 1]),
     [f"{SHARD}[15]", "action_mask", "holds 2 at token 2", "expected 0/1"]),
    ("action mask with no model token", lambda r: _episode(r, [0, 0, 0, 0, 0]),
     [f"{SHARD}[15]", "action_mask", "marks no model token"]),
    ("action mask starting with an environment token", lambda r: _episode(r, [0, 1, 1, 0, 1]),
     [f"{SHARD}[15]", "action_mask", "starts with an environment token"]),
    ("log-prob at an environment token", _logprob_at_environment_token,
     [f"{SHARD}[15]", "mu_logprobs", "environment token 2", "stored as 0.0"]),
]


@pytest.mark.parametrize("what,mutate,named", RECORD_CASES, ids=[c[0] for c in RECORD_CASES])
def test_bad_record_fails_before_training(what, mutate, named, monkeypatch, capsys):
    records = make_records(40, group_size=4)
    mutate(records)
    write_unvalidated(records, monkeypatch)
    first = fails_naming(train("--records", "recs"), capsys, *named)
    record("bad input", what, runs=1, failures=0, detail=f"train on records/{what} -> {first}")


def test_wrong_dtype_field_fails_before_training(monkeypatch, capsys):
    records = make_records(40, group_size=4)
    payload = msgpack.unpackb(records[35].to_bytes(), raw=False)
    payload["completion_ids"] = payload["completion_ids"][:-1]  # int32 ids with 3 bytes cut off
    raw = msgpack.packb(payload, use_bin_type=True)

    records[35].to_bytes = lambda: raw  # type: ignore[method-assign]  # a foreign writer's bytes
    write_unvalidated(records, monkeypatch)
    first = fails_naming(train("--records", "recs"), capsys, f"{SHARD}[15]", "completion_ids", "multiple of 4")
    record("bad input", "wrong dtype (int32 field of odd byte length)", runs=1, failures=0,
           detail=f"completion_ids bytes not a multiple of 4 -> {first}")


@pytest.mark.parametrize("how", ["truncated", "corrupt"])
def test_damaged_shard_fails_before_training(how, capsys):
    damaged(Path("recs"), how)
    first = fails_naming(train("--records", "recs"), capsys, f"recs/{BAD}")
    record("bad input", f"{how} shard", runs=1, failures=0, detail=f"train on a {how} shard -> {first}")


def test_missing_manifest_and_missing_shard(capsys):
    write_records("recs", make_records(40, group_size=4), records_per_shard=20)
    Path(SHARD).unlink()
    first = fails_naming(train("--records", "recs"), capsys, SHARD, "missing shard")
    record("bad input", "manifest lists a missing shard", runs=1, failures=0, detail=first)
    Path("recs/manifest.json").unlink()
    first = fails_naming(train("--records", "recs"), capsys, "recs", "manifest.json")
    record("bad input", "missing manifest", runs=1, failures=0, detail=f"train --records recs -> {first}")
    for cmd in (["curate", "--records", "recs", "--out", "cur"], ["data", "stats", "recs"]):
        fails_naming(cmd, capsys, "manifest.json")
        assert not Path("cur").exists()


# -- configuration ---------------------------------------------------------------------------

CONFIG_CASES = [
    ("unknown config key (override)", ["train.stepz=3"], ["train.stepz"]),
    ("wrong config type (override)", ["train.steps=many"], ["train.steps"]),
    ("impossible mesh", ["mesh.data=3", "mesh.fsdp=2"], ["mesh"]),
    ("batch size not divisible by micro-batch", ["train.batch_size=16", "train.micro_batch_size=12"],
     ["micro_batch_size"]),
    ("batch size not divisible by data parallelism", ["train.batch_size=6", "mesh.data=8"], ["batch_size"]),
    # context parallelism (docs/plan.md § Context parallelism), refused at load
    ("context split whose load-balanced chunks do not divide the row", ["mesh.context=3"],
     ["mesh.context=3", "2 × 3 = 6", "train.max_seq_len=32", "(e.g. 36)"]),
    ("context split that does not divide the devices", ["mesh.context=3", "train.max_seq_len=48"],
     ["mesh.context=3", "does not divide the 8 available devices"]),
    ("context split with an attention kernel that cannot take it",
     ["mesh.context=2", "model.attention=cudnn"], ["model.attention=cudnn", "mesh.context=2"]),
    ("context split with a loss that depends on the token order",
     ["mesh.context=2", "loss.name=m2po"], ["loss.name=m2po", "mesh.context=2"]),
]


@pytest.mark.parametrize("what,overrides,named", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_bad_config_fails_before_training(what, overrides, named, capsys):
    write_records("recs", make_records(40, group_size=4), records_per_shard=20)
    first = fails_naming(train("--records", "recs", *overrides), capsys, *named)
    record("bad input", what, runs=1, failures=0, detail=f"{' '.join(overrides)} -> {first}")


def test_unknown_key_in_config_file_names_the_file(capsys):
    write_records("recs", make_records(40, group_size=4), records_per_shard=20)
    Path("c.yaml").write_text(TRAIN + "optim: {learning_rat: 0.1}\n")
    first = fails_naming(train("--records", "recs"), capsys, "c.yaml", "learning_rat")
    Path("c.yaml").write_text(TRAIN.replace("steps: 2", "steps: two"))
    second = fails_naming(train("--records", "recs"), capsys, "c.yaml", "train.steps")
    record("bad input", "unknown key / wrong type in a config file", runs=2, failures=0,
           detail=f"optim.learning_rat -> {first}; train.steps: two -> {second}")
