"""The score pass over multi-turn episodes: μ and π_ref are computed over the whole sequence
(the environment's tokens are context for the model's turns after them) but written at model
tokens only, 0.0 at environment tokens; the sampler-vs-trainer mismatch counts model tokens
only. Oracle: float64 NumPy log-softmax of the same tiny model over the whole sequence
(tests/data/test_ref_logprobs.py), and the mismatch metrics from their definitions
(tests/data/test_score_mismatch.py)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl_llm.data.records import Record
from jaxrl_llm.data.shards import SamplingInfo, read_manifest, read_records, write_records
from jaxrl_llm.train.score import score_records
from tests.data.helpers import make_records
from tests.data.test_ref_logprobs import VOCAB, numpy_logprobs, tiny_model
from tests.data.test_score_mismatch import expected

SHIFT = 0.3  # nats the sampler's log-probs are off by, at model tokens


def action_mask(c: int, rng: np.random.Generator) -> np.ndarray:
    """A model turn first, then environment and model turns of 1-3 tokens each."""
    mask, kind = [], 1
    while len(mask) < c:
        mask += [kind] * int(rng.integers(1, 4))
        kind = 1 - kind
    return np.asarray(mask[:c], np.uint8)


@pytest.fixture(scope="module")
def episodes(tmp_path_factory):
    """Episodes whose sampler log-probs (raw = behaviour, JAX sampler at T = 1) are the model's
    own at model tokens, shifted by SHIFT on the odd records, and 0.0 at environment tokens."""
    model = tiny_model()
    rng = np.random.default_rng(5)
    records = []
    for i, r in enumerate(make_records(8, seed=9, vocab=VOCAB, max_prompt=5, max_completion=12)):
        r = r.replace(completion_ids=np.concatenate([r.completion_ids, [7, 8, 9]]),
                      mu_logprobs=None, behavior_logprobs=None)
        mask = action_mask(r.completion_ids.size, rng)
        own = numpy_logprobs(model, r, 1.0) - (SHIFT if i % 2 else 0.0)
        sampler = np.where(mask == 1, own, 0.0).astype(np.float32)
        records.append(r.replace(action_mask=mask, raw_logprobs=sampler, behavior_logprobs=sampler))
    path = tmp_path_factory.mktemp("episodes") / "records"
    write_records(path, records, vocab_size=VOCAB, records_per_shard=3,
                  sampling=SamplingInfo(backend="jax", temperature=1.0))
    return model, path, records


def test_mu_and_ref_are_scored_in_context_and_kept_at_model_tokens(episodes, tmp_path):
    model, src, records = episodes
    score_records(model, str(src), str(tmp_path / "scored"), batch_size=4, progress=False)
    scored = read_records(tmp_path / "scored")
    assert len(scored) == len(records)
    for r, original in zip(scored, records, strict=True):
        np.testing.assert_array_equal(r.action_mask, original.action_mask)
        model_tokens = r.action_mask == 1
        want = numpy_logprobs(model, r, 1.0)  # over the whole sequence, environment included
        for values in (r.mu_logprobs, r.ref_logprobs):
            np.testing.assert_allclose(values[model_tokens], want[model_tokens], atol=2e-5)
            np.testing.assert_array_equal(values[~model_tokens], 0.0)
    # the environment tokens are context: without them a later model token scores otherwise
    r = scored[0]
    keep = r.action_mask == 1
    alone = Record(r.prompt_ids, r.completion_ids[keep], reward=0.0)
    later = np.flatnonzero(keep)[np.flatnonzero(keep) > np.flatnonzero(~keep)[0]]
    assert later.size
    without = numpy_logprobs(model, alone, 1.0)[np.searchsorted(np.flatnonzero(keep), later)]
    assert np.abs(r.mu_logprobs[later] - without).max() > 1e-3


def test_the_mismatch_counts_model_tokens_only(episodes, tmp_path):
    model, src, records = episodes
    metrics = score_records(model, str(src), str(tmp_path / "scored"), batch_size=4,
                            progress=False, max_mismatch=0.05)
    model_tokens = [r.action_mask == 1 for r in records]
    trainer = [numpy_logprobs(model, r, 1.0)[m] for r, m in zip(records, model_tokens, strict=True)]
    sampler = [r.raw_logprobs[m] for r, m in zip(records, model_tokens, strict=True)]
    want = expected(trainer, sampler)
    assert metrics["mismatch/num_tokens"] == sum(int(m.sum()) for m in model_tokens)
    assert metrics["mismatch/num_tokens"] < sum(r.completion_ids.size for r in records)
    for key, value in want.items():
        assert metrics[key] == pytest.approx(value, rel=1e-3, abs=1e-5), key
    # the bound reads Σ over model tokens: SHIFT per model token of the odd records
    out = read_records(tmp_path / "scored")
    for i, (r, m) in enumerate(zip(out, model_tokens, strict=True)):
        if i % 2:
            assert r.metadata["mismatch"]["seq_logprob_diff"] == pytest.approx(SHIFT * m.sum(),
                                                                              abs=1e-3)
        else:
            assert "mismatch" not in r.metadata
    assert metrics["mismatch/flagged_sequences"] == 4
    assert read_manifest(tmp_path / "scored").extra["score_metrics"] == metrics
