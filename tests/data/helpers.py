"""Constructed record sets for the data tests (ids encoded in the reward so rows are traceable)."""

from __future__ import annotations

import numpy as np

from jaxrl_llm.data.records import Record


def make_records(num: int, *, seed: int = 0, vocab: int = 50, max_prompt: int = 6,
                 max_completion: int = 7, group_size: int = 3) -> list[Record]:
    rng = np.random.default_rng(seed)
    records = []
    for i in range(num):
        p = int(rng.integers(1, max_prompt + 1))
        c = int(rng.integers(1, max_completion + 1))
        records.append(Record(
            prompt_ids=rng.integers(0, vocab, p), completion_ids=rng.integers(0, vocab, c),
            reward=float(i), correct=bool(i % 2), group_id=i // group_size, task="unit",
            behavior_logprobs=-rng.random(c) - 0.01, mu_logprobs=-rng.random(c) - 0.01,
            metadata={"i": i},
        ))
    return records
