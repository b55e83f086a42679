"""`Policy.sample` builds its sampler like `generate` and `evaluate` do (`sampling/build.py`):
the same samples as a `Sampler` of `generate.batch_size` prompts when the memory suffices, and
the memory check's refusal, naming the figure and the fix, when it does not."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxrl_llm.api import load_policy
from jaxrl_llm.parallel.memory import LIMIT_ENV, InsufficientMemory
from jaxrl_llm.sampling.sampler import Sampler, SamplingParams
from tests.online.helpers import tiny

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory):
    tree = tiny(tmp_path_factory.mktemp("api") / "run")
    del tree["online"]  # an experiment config: the API's own schema has no online: section
    return load_policy(config=tree)


def test_sample_equals_a_sampler_of_the_configured_batch(policy) -> None:
    g = policy.config.generate
    got = policy.sample(PROMPTS, seed=4)
    pad = getattr(policy.tokenizer, "pad_token_id", None)
    eos = getattr(policy.tokenizer, "eos_token_id", None)
    direct = Sampler(policy.model, pad_token_id=0 if pad is None else pad,
                     batch_size=g.batch_size).generate(
        PROMPTS, SamplingParams(max_new_tokens=g.max_new_tokens, temperature=g.temperature,
                                top_k=g.top_k, top_p=g.top_p, n=g.n,
                                stop_token_ids=(eos,) if g.stop_at_eos and eos is not None
                                else ()), jax.random.key(4))
    assert len(got.token_ids) == len(PROMPTS) * g.n
    for i, tokens in enumerate(got.token_ids):
        np.testing.assert_array_equal(tokens, direct.tokens[i, :direct.lengths[i]])


def test_sample_that_cannot_fit_is_refused_naming_the_fix(policy, monkeypatch) -> None:
    # A cap below what the process already holds leaves no room for even one prompt.
    monkeypatch.setenv(LIMIT_ENV, "0.01")
    with pytest.raises(InsufficientMemory,
                       match=r"even (one prompt|[0-9]+ prompts) at a time.*generate\.n"):
        policy.sample(PROMPTS, seed=4)
