"""Multi-turn episodes on vLLM: its generate loop, token ids in and out (docs/environments.md).

Each round, every episode still running is one vLLM request whose prompt is its token ids so
far — the prompt, the model's turns exactly as sampled and the environment's tokens exactly as
rendered (`{"prompt_token_ids": ...}`: vLLM never sees text, so nothing is re-tokenised) — and
that stops at the end of the model's turn (`stop_token_ids` = the runner's). Its tokens and
log-probs go to the `EpisodeRunner`, whose answers (observation ids, or the episode's end)
make the next round. vLLM's prefix cache keeps each episode's earlier tokens: a round
prefills only what the environment added. Unlike the JAX continuous sampler, a round waits
for its slowest turn; environments of a round run in parallel on the runner's threads.

Seeds: turn k of sample j of a prompt with seed s draws from SeedSequence([s, j, k]), so an
episode depends on nothing but itself, whatever the batch or the other episodes' lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl_llm.envs.episodes import Episode, EpisodeRunner


def turn_seed(prompt_seed: int, sample: int, turn: int) -> int:
    """The seed of one turn of one sample (31 bits, as vLLM's seeds)."""
    return int(np.random.SeedSequence([int(prompt_seed), int(sample), int(turn)])
               .generate_state(1, np.uint32)[0] >> 1)


def run_episodes(engine: Any, runner: EpisodeRunner, episodes: Sequence[Episode],
                 prompt_seeds: Sequence[int], *, n: int, temperature: float, top_p: float,
                 top_k: int, max_new_tokens: int) -> int:
    """Every episode of `episodes` (prompt-major, n per prompt with the prompt's seed) to its
    end on the vLLM `engine` (`generate.vllm.VllmEngine`); returns the rounds run."""
    live, rounds = list(range(len(episodes))), 0
    while live:
        eps = [episodes[row] for row in live]
        completions = engine.sample(
            [[*ep.prompt_ids, *ep.completion_ids] for ep in eps],
            [turn_seed(prompt_seeds[row // n], row % n, len(episodes[row].model_turns))
             for row in live], n=1, temperature=temperature, top_p=top_p, top_k=top_k,
            max_new_tokens=[max_new_tokens - len(ep.completion_ids) for ep in eps],
            stop_token_ids=runner.stop_ids)
        futures = []
        for row, done in zip(live, completions, strict=True):
            logprobs = done.logprobs if done.logprobs is not None else done.raw_logprobs
            futures.append(runner.submit(episodes[row], done.token_ids.tolist(),
                                         np.asarray(logprobs).tolist(),
                                         done.finish_reason == "stop"))
        live = [row for row, future in zip(live, futures, strict=True)
                if future.result() is not None]
        rounds += 1
    return rounds
