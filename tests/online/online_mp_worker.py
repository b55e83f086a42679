"""One process of the two-process sampler test: `python online_mp_worker.py OUT.npz`.

Joins the job through the JAXRL_* variables the test sets, loads the tiny policy on the
global data 2 × fsdp 2 × tensor 2 mesh (parameters split across both processes) and samples
with a third of the vocabulary as stop tokens and 2-step decode segments, so finished rows
are dropped between segments (the host loop that reads `stopped`); then passes records whose
rewards differ by process through `online.loop.shared_rewards`. Writes both outputs.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

MESH = {"data": 2, "fsdp": 2, "tensor": 2}


def sample_with_drops(mesh: Any = None) -> tuple[Any, int]:
    """The tiny online policy's samples (`GenerationOutput`) and rows decoded (what the
    dropped rows saved), on `mesh` (default: the config's over every device)."""
    import jax

    from jaxrl_llm.api import load_policy
    from jaxrl_llm.sampling.sampler import Sampler, SamplingParams
    from tests.online.helpers import tiny

    policy = load_policy(config={k: v for k, v in tiny("unused", mesh=MESH).items()
                                 if k != "online"}, mesh=mesh)
    sampler = Sampler(policy.model, batch_size=4, segment_steps=2, min_rows=1)
    prompts = [[5 + i, 17, 40 + 3 * i] for i in range(6)]
    params = SamplingParams(max_new_tokens=24, temperature=1.0, n=2,
                            stop_token_ids=tuple(range(1, 128, 3)))
    out = sampler.generate(prompts, params, jax.random.key(7))
    return out, sampler.rows_decoded


def process_records(index: int) -> list[Any]:
    """Records whose rewards depend on the process (as a timed-out verifier's could), with
    values float32 cannot hold and a missing raw_reward."""
    from jaxrl_llm.data.records import Record

    return [Record(prompt_ids=[1], completion_ids=[2, 3], reward=0.1 + index / 3,
                   raw_reward=None if i == 1 else -1e-9 * (i + index), correct=(i + index) % 2 == 0,
                   invalid=index == 1 and i == 2) for i in range(3)]


def reward_table(records: list[Any]) -> np.ndarray:
    """[reward, raw_reward (NaN: None), correct, invalid] per record, float64."""
    return np.asarray([[r.reward, np.nan if r.raw_reward is None else r.raw_reward, r.correct,
                        r.invalid] for r in records], np.float64)


def main() -> None:
    out_path = sys.argv[1]  # "{}" stands for the process index
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from jaxrl_llm.parallel.distributed import initialize

    assert initialize()  # from JAXRL_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID
    import jax

    assert jax.process_count() == 2 and len(jax.devices()) == 8
    out, rows_decoded = sample_with_drops()
    from jaxrl_llm.online.loop import shared_rewards

    shared = shared_rewards(process_records(jax.process_index()))
    np.savez(out_path.format(jax.process_index()), tokens=out.tokens, logprobs=out.logprobs, raw_logprobs=out.raw_logprobs,
             lengths=out.lengths, rows_decoded=rows_decoded,
             rewards=reward_table(shared))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
