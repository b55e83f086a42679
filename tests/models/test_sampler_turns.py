"""Multi-turn episodes in the continuous sampler (issue 56 item 2): a slot that ends a turn is
parked while its environment answers; the answer's tokens are fed into that slot's cache and
decoding resumes, while the other slots keep decoding.

The oracle is a cache-free forward pass over the whole episode (prompt, model turns and the
environment's tokens, as one sequence): every model token's sampler log-prob must be the
log-softmax of that forward's logits at its position, which holds only if the fed tokens sit in
the cache at the right positions; fed tokens have log-prob 0 and action mask 0."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm.models.config import DecoderConfig
from jaxrl_llm.models.decoder import Decoder
from jaxrl_llm.sampling.continuous import ContinuousSampler
from jaxrl_llm.sampling.sampler import SamplingParams
from jaxrl_llm.sampling.turns import TurnError

VOCAB = 32
CONFIG = DecoderConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2, max_position_embeddings=64)
PROMPTS = [[5, 9, 13], [7, 3, 22, 4, 8, 2, 30], [11], [1, 2, 3, 4]]
TURN_END = (3, 7)  # tokens that end a model turn
MAX_NEW = 40
PAD = 0


@pytest.fixture(scope="module")
def model() -> Decoder:
    graphdef, state = nnx.split(Decoder(CONFIG, rngs=nnx.Rngs(1)))
    return nnx.merge(graphdef, jax.tree.map(lambda x: x * 5.0 if x.ndim >= 2 else x, state))


class Echo:
    """An environment runner of the sampler's `TurnHook` protocol: after each model turn it
    answers [31, 30, len(turn)] (three tokens) until `turns` model turns, then ends. Answers
    come from other threads, some late (`delay`), so slots are parked for a while."""

    def __init__(self, turns: int, delay: float = 0.0):
        self.stop_ids = TURN_END
        self.turns, self.delay = turns, delay
        self.log: dict[int, list[tuple[list[int], list[float], bool, list[int] | None]]] = {}
        self.pool = ThreadPoolExecutor(4)
        self.lock = threading.Lock()

    def submit(self, row, tokens, logprobs, stopped) -> Future:
        def respond():
            time.sleep(self.delay * (row % 3))
            with self.lock:
                log = self.log.setdefault(row, [])
                used = sum(len(t) + len(o or ()) for t, _, _, o in log) + len(tokens)
                over = len(log) + 1 >= self.turns or not stopped or used + 3 >= MAX_NEW
                obs = None if over else [31, 30, len(tokens)]
                log.append((list(map(int, tokens)), list(map(float, logprobs)), stopped, obs))
            return obs
        return self.pool.submit(respond)


def _forward(model, sequences: list[list[int]]) -> np.ndarray:
    width = max(len(s) for s in sequences)
    tokens = np.full((len(sequences), width), PAD, np.int32)
    for row, seq in enumerate(sequences):
        tokens[row, :len(seq)] = seq
    graphdef, state = nnx.split(model)
    m = nnx.merge(graphdef, state)
    return np.asarray(m.logits(m(tokens)), np.float64)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.mark.parametrize("delay", [0.0, 0.02])
def test_episode_logprobs_are_the_forward_pass_over_the_whole_episode(model, delay):
    echo = Echo(turns=3, delay=delay)
    sampler = ContinuousSampler(model, slots=3, prompt_buckets=(8,), refill_slots=1)
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, n=2)
    out = sampler.generate(PROMPTS, params, jax.random.key(4), turns=echo)
    assert out.action_mask is not None
    multi = 0
    sequences, rows = [], []
    for row in range(len(PROMPTS) * params.n):
        length = int(out.lengths[row])
        tokens, mask = out.tokens[row, :length], out.action_mask[row, :length]
        log = echo.log[row]
        # The episode as the environment saw it: model turns and observations, in order.
        expected, expected_mask = [], []
        for turn, _, _, obs in log:
            expected += turn + list(obs or ())
            expected_mask += [1] * len(turn) + [0] * len(obs or ())
        np.testing.assert_array_equal(tokens, expected)
        np.testing.assert_array_equal(mask, expected_mask)
        assert np.all(out.logprobs[row, :length][mask == 0] == 0.0)
        multi += len(log) > 1
        for turn, _, stopped, obs in log[:-1]:  # every continued turn ended on a turn token
            assert stopped and turn[-1] in TURN_END and obs is not None
        sequences.append(PROMPTS[row // params.n] + tokens.tolist())
        rows.append(row)
    assert multi >= 4, "the set-up should give several multi-turn episodes"
    logits = _forward(model, sequences)
    for seq_index, row in enumerate(rows):
        p = len(PROMPTS[row // params.n])
        length = int(out.lengths[row])
        logp = _log_softmax(logits[seq_index, p - 1:p - 1 + length])
        tokens = out.tokens[row, :length]
        want = logp[np.arange(length), tokens]
        model_tokens = out.action_mask[row, :length] == 1
        np.testing.assert_allclose(out.logprobs[row, :length][model_tokens],
                                   want[model_tokens], atol=2e-4)


def test_other_slots_decode_while_one_waits_for_its_environment(model):
    """One episode's environment blocks until the other rows are all finished: the sampler
    must finish them meanwhile (it would deadlock if a parked slot stopped the decode)."""
    release = threading.Event()
    finished_rows: set[int] = set()

    class Slow(Echo):
        def submit(self, row, tokens, logprobs, stopped):
            if row != 0:
                finished_rows.add(row)
                if len(finished_rows) == 7:
                    release.set()
                return super().submit(row, tokens, logprobs, stopped)

            def respond():
                assert release.wait(60), "the other slots did not go on decoding"
                return None
            return self.pool.submit(respond)

    sampler = ContinuousSampler(model, slots=2, prompt_buckets=(8,), refill_slots=1)
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, n=2)
    out = sampler.generate(PROMPTS, params, jax.random.key(4), turns=Slow(turns=1))
    assert release.is_set() and out.lengths.min() >= 1


def test_an_observation_that_does_not_fit_is_refused(model):
    class TooLong(Echo):
        def submit(self, row, tokens, logprobs, stopped):
            future: Future = Future()
            future.set_result([1] * MAX_NEW)
            return future

    sampler = ContinuousSampler(model, slots=2, prompt_buckets=(8,))
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, n=1)
    with pytest.raises(TurnError, match="does not fit max_new_tokens"):
        sampler.generate(PROMPTS[:1], params, jax.random.key(0), turns=TooLong(turns=2))
