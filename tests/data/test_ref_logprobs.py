"""Reference log-probs from a real source: the score pass writes π_ref at T = 1 beside μ at
the sampling temperature, the record schema keeps older records readable, the loader places
them, and a loss that reads them refuses records without them (never log π_ref = 0)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm.config import ConfigError, config_from_dict
from jaxrl_llm.data.loader import collate, record_row
from jaxrl_llm.data.records import Record, RecordError
from jaxrl_llm.data.shards import SamplingInfo, read_manifest, read_records, write_records
from jaxrl_llm.models.config import DecoderConfig
from jaxrl_llm.models.decoder import Decoder
from jaxrl_llm.train.preflight import check_records
from jaxrl_llm.train.score import score_records

from .helpers import make_records

VOCAB = 64


def tiny_model() -> Decoder:
    config = DecoderConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=1,
                           num_heads=2, num_kv_heads=1, tie_embeddings=True)
    return Decoder(config, rngs=nnx.Rngs(3))


def numpy_logprobs(model: Decoder, record: Record, temperature: float) -> np.ndarray:
    """log_softmax(logits / T) in float64 numpy, at the completion tokens of one record."""
    tokens = np.concatenate([record.prompt_ids, record.completion_ids])
    n = tokens.size - 1
    # Trailing filler up to a multiple of 32: one input shape, so one compile, for all records up to
    # 33 tokens (these tests' are shorter); causal attention leaves the first n positions' logits
    # unchanged by what follows them.
    width = -(-n // 32) * 32
    inputs = np.zeros((1, width), np.int32)
    inputs[0, :n] = tokens[:-1]
    hidden = model(inputs, positions=np.arange(width)[None], segment_ids=np.ones((1, width), np.int32))
    z = np.asarray(model.logits(hidden), np.float64)[0, :n] / temperature
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return logp[np.arange(n), tokens[1:]][record.prompt_ids.size - 1 :]


@pytest.fixture(scope="module")
def unscored(tmp_path_factory):
    records = [r.replace(mu_logprobs=None)
               for r in make_records(10, seed=4, vocab=VOCAB, max_prompt=5, max_completion=9)]
    path = tmp_path_factory.mktemp("ref") / "records"
    write_records(path, records, vocab_size=VOCAB, sampling=SamplingInfo(backend="jax", temperature=0.7))
    return path


@pytest.fixture(scope="module")
def scored(unscored):
    out = unscored.parent / "scored"
    score_records(tiny_model(), str(unscored), str(out), batch_size=4, progress=False)
    return out


def test_score_writes_ref_at_t1_and_mu_at_the_sampling_temperature(scored):
    model = tiny_model()
    records = read_records(scored)
    assert len(records) == 10
    for r in records:
        np.testing.assert_allclose(r.ref_logprobs, numpy_logprobs(model, r, 1.0), atol=2e-5)
        np.testing.assert_allclose(r.mu_logprobs, numpy_logprobs(model, r, 0.7), atol=2e-5)
        assert np.abs(r.ref_logprobs - r.mu_logprobs).max() > 1e-3  # two temperatures, not a copy
    extra = read_manifest(scored).extra
    assert extra["score_temperature"] == 0.7
    assert extra["ref_logprobs"] == {"temperature": 1.0, "model": "policy"}


def test_version_1_records_still_load_and_unknown_versions_are_refused():
    r = make_records(1, seed=0)[0]
    payload = msgpack.unpackb(r.to_bytes(), raw=False)
    assert payload["v"] == 4 and payload["ref_logprobs"] is None
    del payload["ref_logprobs"], payload["action_mask"], payload["routing"]
    payload["v"] = 1  # what the schema before ref_logprobs wrote
    old = Record.from_bytes(msgpack.packb(payload, use_bin_type=True), where="old.array_record[0]")
    assert old.ref_logprobs is None
    np.testing.assert_array_equal(old.mu_logprobs, r.mu_logprobs)
    payload["v"] = 5
    with pytest.raises(RecordError, match=r"old.array_record\[0\]: schema version 5"):
        Record.from_bytes(msgpack.packb(payload, use_bin_type=True), where="old.array_record[0]")
    ref = -np.arange(1, r.completion_ids.size + 1, dtype=np.float32) / 10
    again = Record.from_bytes(r.replace(ref_logprobs=ref).to_bytes())
    np.testing.assert_array_equal(again.ref_logprobs, ref)


def test_loader_places_ref_logprobs_on_the_completion_targets():
    records = make_records(3, seed=2)
    records = [r.replace(ref_logprobs=-(np.arange(r.completion_ids.size, dtype=np.float32) + 1) * (i + 1))
               for i, r in enumerate(records)]
    batch = collate([record_row(r) for r in records], 4, (32,))
    for i, r in enumerate(records):
        p, c = r.prompt_ids.size, r.completion_ids.size
        row = np.zeros(32, np.float32)
        row[p - 1 : p - 1 + c] = r.ref_logprobs  # target position of completion token j: P−1+j
        np.testing.assert_array_equal(batch.ref_logprobs[i], row)
    np.testing.assert_array_equal(batch.ref_logprobs[3], 0.0)  # padding row
    with pytest.raises(RecordError, match=r"shard\[7\]: no ref_logprobs; run `jaxrl-llm score`.*"
                                          r"train.ref_logprobs=model"):
        record_row(make_records(1)[0], require_ref=True, where="shard[7]")


def config(records, loss: str, **train: object):
    return config_from_dict({"loss": {"name": loss}, "data": {"records": str(records)},
                             "train": {"batch_size": 4, **train}})


@pytest.mark.parametrize("loss", ["dpo", "rpo", "kto", "apo", "off_rl_kl"])
def test_reference_losses_refuse_records_without_ref_logprobs(unscored, scored, loss):
    with pytest.raises(ConfigError) as err:
        check_records(config(unscored, loss), unscored)
    text = str(err.value)
    for part in (f"loss.name={loss}", str(unscored), "jaxrl-llm score", "train.ref_logprobs=model",
                 "extra.ref_logprobs"):
        assert part in text, text
    check_records(config(unscored, loss, ref_logprobs="model"), unscored)  # the step computes them
    check_records(config(scored, loss), scored)


def test_losses_without_a_reference_do_not_ask_for_one(unscored):
    for loss in ("sft", "off_rl", "fpa", "reinforce"):
        assert check_records(config(unscored, loss), unscored).loss.name == loss


def test_trainer_refuses_before_building_anything(unscored, tmp_path):
    from jaxrl_llm.train.trainer import Trainer

    cfg = config_from_dict({"run_dir": str(tmp_path / "run"), "loss": {"name": "kto"},
                            "data": {"records": str(unscored)}, "train": {"batch_size": 8}})
    with pytest.raises(ConfigError, match="jaxrl-llm score"):
        Trainer(cfg, progress=False, tensorboard=False)
    assert not (tmp_path / "run").exists()


def test_loader_refuses_one_record_without_ref_logprobs_in_a_scored_directory(scored, tmp_path):
    """The manifest promises ref_logprobs but one record lacks them: the loader names that
    record instead of placing log π_ref = 0 for it."""
    from jaxrl_llm.data.loader import loader_from_config

    manifest = read_manifest(scored)
    records = list(read_records(scored))
    records[3] = records[3].replace(ref_logprobs=None)
    mixed = tmp_path / "mixed"
    write_records(mixed, records, vocab_size=VOCAB, sampling=manifest.sampling,
                  extra=manifest.extra, scored_by=manifest.scored_by)
    check_records(config(mixed, "kto"), mixed)  # the manifest check alone passes
    loader = loader_from_config(config(mixed, "kto", max_seq_len=32), process_index=0,
                                process_count=1, num_epochs=1)
    with pytest.raises(RecordError, match=r"no ref_logprobs; run `jaxrl-llm score`") as err:
        list(loader)
    assert str(mixed) in str(err.value) or "records-" in str(err.value), str(err.value)
    # the same directory is fine for a loss that never reads π_ref
    assert len(list(loader_from_config(config(mixed, "off_rl", max_seq_len=32), process_index=0,
                                       process_count=1, num_epochs=1))) > 0
