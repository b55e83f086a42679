"""Record schema, shards + manifest, and validation errors that name shard and index."""

from __future__ import annotations

import ast
import json
import math
import re
from pathlib import Path

import msgpack
import numpy as np
import pytest
from array_record.python import array_record_module

from jaxrl_llm.data.records import Record, RecordError, validate_record
from jaxrl_llm.data.shards import (
    MANIFEST_NAME,
    RecordSource,
    SamplingInfo,
    ShardWriter,
    read_manifest,
    read_records,
    write_records,
)
from tests.data.helpers import make_records


def assert_same(a: Record, b: Record) -> None:
    for name in ("prompt_ids", "completion_ids", "behavior_logprobs", "raw_logprobs", "mu_logprobs"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            np.testing.assert_array_equal(x, y)
    for name in ("reward", "correct", "invalid", "group_id", "task", "answer", "raw_reward",
                 "prompt_text", "completion_text", "metadata"):
        assert getattr(a, name) == getattr(b, name), name


def test_record_bytes_round_trip_keeps_every_field():
    r = Record([5, 6, 7], [1, 2], reward=-1.0, correct=False, invalid=True, group_id=9, task="math",
               behavior_logprobs=[-0.5, -1.5], raw_logprobs=[-0.25, -2.0], answer=None,
               raw_reward=0.5, prompt_text="Q: é?", completion_text="\\boxed{1}",
               metadata={"gold": "1", "nested": {"a": [1, 2]}})
    back = Record.from_bytes(r.to_bytes())
    assert_same(r, back)
    assert back.prompt_ids.dtype == np.int32 and back.behavior_logprobs.dtype == np.float32


def test_serialisation_is_msgpack_not_pickle():
    payload = msgpack.unpackb(Record([1], [2], reward=1.0).to_bytes())
    assert payload["prompt_ids"] == np.asarray([1], "<i4").tobytes()
    with pytest.raises(RecordError, match="where-x: not a msgpack record|where-x: expected a mapping"):
        Record.from_bytes(b"\x80\x04garbage", where="where-x")


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"behavior_logprobs": np.asarray([-0.1], np.float32)}, "behavior_logprobs"),  # wrong length
        ({"mu_logprobs": np.asarray([-0.1, 0.5], np.float32)}, "mu_logprobs"),  # positive
        ({"raw_logprobs": np.asarray([-0.1, np.nan], np.float32)}, "raw_logprobs"),  # NaN
        ({"reward": math.inf}, "reward"),
        ({"completion_ids": np.asarray([3, 50])}, "completion_ids"),  # id == vocab
        ({"prompt_ids": np.asarray([-1])}, "prompt_ids"),
    ],
)
def test_validation_rejects_each_broken_invariant(changes, field):
    good = Record([1, 2], [3, 4], reward=1.0, behavior_logprobs=[-0.1, -0.2])
    validate_record(good, where="w", vocab_size=50)
    with pytest.raises(RecordError, match=rf"^w: .*{field}"):
        validate_record(good.replace(**changes), where="w", vocab_size=50)


def test_writer_rejects_a_bad_record_naming_shard_and_index(tmp_path):
    records = make_records(5)
    records[3] = records[3].replace(reward=float("nan"))
    with pytest.raises(RecordError, match=r"records-00001\.array_record\[1\]: field 'reward'"):
        write_records(tmp_path / "d", records, records_per_shard=2, vocab_size=50)


def test_reader_names_shard_and_index_of_a_corrupt_record(tmp_path):
    d = tmp_path / "d"
    write_records(d, make_records(4), records_per_shard=2, vocab_size=50)
    # Rewrite shard 1 by hand (bypassing the writer's checks) with a positive log-prob at index 1.
    bad = make_records(4)[2:]
    bad[1].mu_logprobs = np.abs(bad[1].mu_logprobs)
    w = array_record_module.ArrayRecordWriter(str(d / "records-00001.array_record"), "group_size:1")
    for r in bad:
        w.write(r.to_bytes())
    w.close()
    source = RecordSource(d)
    assert_same(source[2], bad[0])
    with pytest.raises(RecordError, match=r"records-00001\.array_record\[1\]: field 'mu_logprobs' has a positive"):
        source[3]


def test_shards_round_trip_and_manifest(tmp_path):
    records = make_records(11)
    sampling = SamplingInfo(backend="jax", temperature=1.0, top_p=1.0, top_k=500, max_new_tokens=512, n=16)
    m = write_records(tmp_path, records, records_per_shard=4, vocab_size=50, tokenizer="char",
                      model="tiny", task="unit", reward_fn="id", sampling=sampling)
    assert [s["count"] for s in m.shards] == [4, 4, 3]
    on_disk = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert on_disk["num_records"] == 11 and on_disk["sampling"]["top_k"] == 500
    assert on_disk["num_groups"] == 4 and on_disk["num_correct"] == 5
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", on_disk["created"])
    assert read_manifest(tmp_path).sampling == sampling
    back = read_records(tmp_path)
    assert len(back) == 11
    for a, b in zip(records, back):
        assert_same(a, b)
    lengths = RecordSource(tmp_path).lengths()
    np.testing.assert_array_equal(lengths, [[r.prompt_ids.size, r.completion_ids.size] for r in records])


def test_writer_refuses_to_overwrite_without_flag(tmp_path):
    write_records(tmp_path, make_records(2))
    with pytest.raises(FileExistsError):
        ShardWriter(tmp_path)
    write_records(tmp_path, make_records(1), overwrite=True)
    assert len(read_records(tmp_path)) == 1


def test_manifest_count_mismatch_is_an_error(tmp_path):
    write_records(tmp_path, make_records(3))
    tree = json.loads((tmp_path / MANIFEST_NAME).read_text())
    tree["num_records"] = 4
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(tree))
    with pytest.raises(RecordError, match="shards hold 3 records but the manifest says 4"):
        RecordSource(tmp_path)


def forbidden_calls(source: str) -> list[str]:
    """eval/exec calls, pickle-family imports and torch.load in Python source (syntax tree walk)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in ("eval", "exec"):
                found.append(f"{node.lineno}: {f.id}(")
            elif (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                  and (f.value.id, f.attr) in (("builtins", "eval"), ("builtins", "exec"), ("torch", "load"))):
                found.append(f"{node.lineno}: {f.value.id}.{f.attr}(")
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            if any(n.split(".")[0] in ("pickle", "cPickle", "dill", "cloudpickle") for n in names):
                found.append(f"{node.lineno}: import pickle")
    return found


def test_forbidden_call_finder_on_probes():
    probe = "import pickle\nx = eval('1')\nexec('y=1')\nimport torch\ntorch.load('f')\nmodel.eval()\n# eval (x)\n"
    assert forbidden_calls(probe) == ["1: import pickle", "2: eval(", "3: exec(", "5: torch.load("]


def test_no_eval_exec_or_pickle_in_the_package():
    root = Path(__file__).resolve().parents[2] / "jaxrl_llm"
    offenders = [f"{p}:{hit}" for p in sorted(root.rglob("*.py")) for hit in forbidden_calls(p.read_text())]
    assert offenders == []
