"""The score pass's sampler-vs-trainer mismatch report (per-token |Δp|, k3 KL, χ², ESS,
Pearson of the log-probs), its bound that flags or drops sequences, and the flags that say
what the sampler's log-probs are (top-k/top-p, vLLM raw mode) — which `mu_source: sampler`
refuses."""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl_llm.config import ConfigError, config_from_dict
from jaxrl_llm.data.shards import SamplingInfo, read_manifest, read_records, write_records
from jaxrl_llm.train.mismatch import MISMATCH_STATS, Mismatch
from jaxrl_llm.train.preflight import check_records
from jaxrl_llm.train.score import score_records

from .helpers import make_records
from .test_ref_logprobs import VOCAB, numpy_logprobs, tiny_model


def expected(trainer: list[np.ndarray], sampler: list[np.ndarray]) -> dict[str, float]:
    """The metrics straight from their definitions (float64 numpy)."""
    y = np.concatenate(trainer).astype(np.float64)
    x = np.concatenate(sampler).astype(np.float64)
    r = np.exp(y - x)
    seq = np.asarray([t.astype(np.float64).sum() - s.astype(np.float64).sum()
                      for t, s in zip(trainer, sampler, strict=True)])
    big_w = np.exp(seq)
    return {
        "mismatch/mean_abs_logprob_diff": np.abs(y - x).mean(),
        "mismatch/mean_abs_prob_diff": np.abs(np.exp(y) - np.exp(x)).mean(),
        "mismatch/max_abs_prob_diff": np.abs(np.exp(y) - np.exp(x)).max(),
        "mismatch/kl_sampler_trainer": np.mean(r - 1 - np.log(r)),
        "mismatch/chi2_token": np.mean(r**2) - 1,
        "mismatch/chi2_seq": np.mean(big_w**2) - 1,
        "mismatch/ess_fraction": big_w.sum() ** 2 / (big_w**2).sum() / big_w.size,
        "mismatch/pearson_logprob": np.corrcoef(x, y)[0, 1],
        "mismatch/max_abs_seq_logprob_diff": np.abs(seq).max(),
        "mismatch/num_sequences": float(seq.size),
        "mismatch/num_tokens": float(y.size),
    }


def test_metrics_match_their_definitions_and_combine_over_processes():
    rng = np.random.default_rng(0)
    trainer = [-rng.random(int(n)) * 3 for n in rng.integers(1, 12, size=9)]
    sampler = [t + rng.normal(0, 0.3, t.size) for t in trainer]
    sampler = [np.minimum(s, 0.0) for s in sampler]
    whole = Mismatch()
    parts = [Mismatch(), Mismatch(), Mismatch()]
    for i, (t, s) in enumerate(zip(trainer, sampler, strict=True)):
        assert whole.add(t, s) == pytest.approx(t.sum() - s.sum())
        parts[i % 3].add(t, s)
    want = expected(trainer, sampler)
    for got in (whole.metrics(), Mismatch.combine(np.stack([p.stats() for p in parts]))):
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    assert len(whole.stats()) == len(MISMATCH_STATS)


def test_identical_logprobs_give_no_mismatch():
    m = Mismatch()
    m.add(np.log([0.5, 0.25, 0.125]), np.log([0.5, 0.25, 0.125]))
    got = m.metrics()
    assert got["mismatch/kl_sampler_trainer"] == 0 and got["mismatch/chi2_seq"] == 0
    assert got["mismatch/ess_fraction"] == 1 and got["mismatch/pearson_logprob"] == pytest.approx(1)


@pytest.fixture(scope="module")
def perturbed(tmp_path_factory):
    """Records whose sampler log-probs are the model's at T = 1 (JAX sampler: raw = tempered,
    untruncated), with records 2 and 5 shifted by a known 0.5 nats per token."""
    model = tiny_model()
    base = [r.replace(mu_logprobs=None, behavior_logprobs=None)
            for r in make_records(8, seed=7, vocab=VOCAB, max_prompt=5, max_completion=8)]
    records = []
    for i, r in enumerate(base):
        raw = numpy_logprobs(model, r, 1.0).astype(np.float32)
        if i in (2, 5):
            raw = raw - 0.5
        records.append(r.replace(raw_logprobs=raw, behavior_logprobs=raw))
    path = tmp_path_factory.mktemp("mismatch") / "records"
    write_records(path, records, vocab_size=VOCAB, records_per_shard=3,
                  sampling=SamplingInfo(backend="jax", temperature=1.0))
    return model, path, records


def test_the_bound_flags_then_drops_the_shifted_sequences(perturbed, tmp_path):
    model, src, records = perturbed
    shifted = {2: 0.5 * records[2].completion_ids.size, 5: 0.5 * records[5].completion_ids.size}
    bound = 0.25  # every shifted record is ≥ 1 token, so |Σ Δ| ≥ 0.5; the others ≈ 1e-6
    flagged = score_records(model, str(src), str(tmp_path / "flag"), batch_size=4, progress=False,
                            max_mismatch=bound)
    assert flagged["mismatch/flagged_sequences"] == 2 and flagged["mismatch/dropped_sequences"] == 0
    out = read_records(tmp_path / "flag")
    assert len(out) == 8
    for i, r in enumerate(out):
        if i in shifted:
            assert r.metadata["mismatch"]["bound"] == bound
            assert r.metadata["mismatch"]["seq_logprob_diff"] == pytest.approx(shifted[i], abs=1e-3)
        else:
            assert "mismatch" not in r.metadata
    assert flagged["mismatch/max_abs_seq_logprob_diff"] == pytest.approx(max(shifted.values()), abs=1e-3)

    dropped = score_records(model, str(src), str(tmp_path / "drop"), batch_size=4, progress=False,
                            max_mismatch=bound, drop_mismatched=True)
    assert dropped["mismatch/dropped_sequences"] == 2 and dropped["mismatch/flagged_sequences"] == 0
    kept = read_records(tmp_path / "drop")
    assert [r.metadata["i"] for r in kept] == [0, 1, 3, 4, 6, 7]
    m = read_manifest(tmp_path / "drop")
    assert m.num_records == 6 and [s["count"] for s in m.shards] == [2, 2, 2]
    assert m.num_correct == sum(r.correct for r in kept)
    assert m.extra["score_metrics"]["mismatch/dropped_sequences"] == 2
    assert m.extra["score_mismatch_bound"] == {"max_mismatch": bound, "drop": True}
    with pytest.raises(ConfigError, match="generate.max_mismatch"):
        score_records(model, str(src), str(tmp_path / "x"), batch_size=4, progress=False,
                      drop_mismatched=True)


def test_vllm_raw_logprobs_are_compared_with_the_t1_reference(tmp_path):
    """vLLM's raw_logprobs mode reports log-probs before temperature: at T = 1, so a record
    set sampled at T = 0.7 is compared with ref_logprobs, not with μ at 0.7."""
    model = tiny_model()
    base = [r.replace(mu_logprobs=None, behavior_logprobs=None)
            for r in make_records(4, seed=8, vocab=VOCAB, max_prompt=5, max_completion=8)]
    records = [r.replace(raw_logprobs=numpy_logprobs(model, r, 1.0).astype(np.float32)) for r in base]
    write_records(tmp_path / "raw", records, vocab_size=VOCAB,
                  sampling=SamplingInfo(backend="vllm", temperature=0.7),
                  extra={"vllm_logprobs_mode": "raw_logprobs"})
    metrics = score_records(model, str(tmp_path / "raw"), str(tmp_path / "scored"), batch_size=4,
                            progress=False)
    assert metrics["mismatch/mean_abs_logprob_diff"] < 2e-5  # against π_ref at T = 1
    extra = read_manifest(tmp_path / "scored").extra
    assert extra["score_compared"] == {"raw_logprobs": "ref_logprobs", "behavior_logprobs": "mu_logprobs"}
    assert extra["raw_logprobs_temperature"] == 1.0 and extra["score_temperature"] == 0.7


def ratio_config(records, mu_source: str):
    return config_from_dict({"loss": {"name": "topr", "mu_source": mu_source},
                             "data": {"records": str(records)}})


@pytest.mark.parametrize("sampling, says", [
    ({"top_k": 500}, "top_k=500"),
    ({"top_p": 0.9}, "top_p=0.9"),
    ({"temperature": 0.0}, "greedily"),
])
def test_mu_source_sampler_refuses_log_probs_that_are_not_the_policys(tmp_path, sampling, says):
    records = make_records(4, seed=1)
    write_records(tmp_path / "r", records, vocab_size=50, sampling=SamplingInfo(backend="jax", **sampling))
    with pytest.raises(ConfigError) as err:
        check_records(ratio_config(tmp_path / "r", "sampler"), tmp_path / "r")
    text = str(err.value)
    assert "loss.mu_source=sampler" in text and says in text and "loss.mu_source=trainer" in text
    assert str(tmp_path / "r" / "manifest.json") in text
    check_records(ratio_config(tmp_path / "r", "trainer"), tmp_path / "r")  # μ from the score pass


def test_mu_source_sampler_takes_untruncated_records_at_their_temperature(tmp_path):
    write_records(tmp_path / "r", make_records(4, seed=1), vocab_size=50,
                  sampling=SamplingInfo(backend="jax", temperature=0.6))
    cfg = check_records(ratio_config(tmp_path / "r", "sampler"), tmp_path / "r")
    assert cfg.generate.temperature == 0.6  # unset in the config: the records' value


@pytest.mark.slow  # ≈ 20 s on 2 cores; the other mismatch cases here stay in the default run
def test_generation_manifests_say_whether_sampling_was_truncated(tmp_path):
    from flax import nnx

    from jaxrl_llm.generate.jax_backend import generate_records
    from jaxrl_llm.models.config import DecoderConfig
    from jaxrl_llm.models.decoder import Decoder
    from jaxrl_llm.models.tokenizer import char_tokenizer
    from jaxrl_llm.tasks import get_task

    model = Decoder(DecoderConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1,
                                  num_heads=2, num_kv_heads=1), rngs=nnx.Rngs(0))
    task = get_task("arithmetic", min_ops=1, max_ops=1)
    for top_k, truncated in ((0, False), (5, True)):
        out = tmp_path / f"k{top_k}"
        generate_records(model, char_tokenizer(), task, task.load(num=2), str(out), n=2,
                         temperature=0.8, top_k=top_k, max_new_tokens=6, batch_size=2, progress=False)
        extra = read_manifest(out).extra
        assert extra["sampling_truncated"] is truncated and extra["raw_logprobs_temperature"] == 0.8
    score_records(model, str(tmp_path / "k5"), str(tmp_path / "k5-scored"), batch_size=4, progress=False)
    extra = read_manifest(tmp_path / "k5-scored").extra
    assert extra["sampling_truncated"] is True and extra["score_temperature_matches_sampling"] is True
    # The JAX sampler's raw log-probs are tempered and untruncated: they match μ at 0.8.
    assert extra["score_compared"]["raw_logprobs"] == "mu_logprobs"
    assert extra["score_metrics"]["mismatch/mean_abs_logprob_diff"] < 2e-5
    with pytest.raises(ConfigError, match="top_k=5"):
        check_records(ratio_config(tmp_path / "k5-scored", "sampler"), tmp_path / "k5-scored")
