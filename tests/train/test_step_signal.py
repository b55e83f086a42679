"""`Policy.step` (and so every online mode, which trains through it) counts the learning
signal of each batch and says when there is none, as `jaxrl-llm train` refuses records with
none (data/signal.py): `signal/raised` is the number of records the loss pushes up (TOPR:
R − loss.baseline > 0, TOPR eq. 7; GRPO: records of groups with unequal rewards, FPA eq. 34),
`signal/none` 1 when that is zero; after `NO_SIGNAL_STREAK` such updates in a row a warning
names the composition and `train.allow_no_signal`, which silences it."""

from __future__ import annotations

import jax
import numpy as np

from jaxrl_llm.api import load_policy
from jaxrl_llm.config import config_from_dict
from jaxrl_llm.data.records import Record
from jaxrl_llm.data.signal import NO_SIGNAL_STREAK
from jaxrl_llm.parallel.mesh import make_mesh

TREE = {"seed": 0,
        "model": {"vocab_size": 128, "hidden_size": 16, "intermediate_size": 32,
                  "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
                  "max_position_embeddings": 64},
        "optim": {"name": "sgd", "learning_rate": 0.1},
        "train": {"batch_size": 6, "max_seq_len": 16}}


def _records(rewards: list[float], groups: list[int]) -> list[Record]:
    rng = np.random.default_rng(0)
    return [Record(prompt_ids=rng.integers(1, 64, 3).astype(np.int32),
                   completion_ids=rng.integers(1, 64, 4).astype(np.int32), reward=r,
                   correct=r > 0, group_id=g, behavior_logprobs=np.full(4, -4.0, np.float32),
                   mu_logprobs=np.full(4, -4.0, np.float32))
            for r, g in zip(rewards, groups, strict=True)]


def _policy(loss: str, **train: object):
    config = config_from_dict({**TREE, "loss": {"name": loss},
                               "train": {**TREE["train"], **train}})
    return load_policy(config=config, mesh=make_mesh(config.mesh, jax.devices()[:1]))


def test_topr_counts_what_it_raises_and_warns_after_a_streak_without(capsys):
    policy = _policy("topr")
    # R − 0 > 0 for 2 of 6 records: signal
    got = policy.step(_records([1, -1, 1, -1, -1, -1], [0, 0, 1, 1, 2, 2]))
    assert got["signal/raised"] == 2 and got["signal/none"] == 0
    negatives = _records([-1.0] * 6, [0, 0, 1, 1, 2, 2])
    for i in range(NO_SIGNAL_STREAK):
        got = policy.step(negatives)
        assert got["signal/raised"] == 0 and got["signal/none"] == 1
        said = capsys.readouterr().err
        assert ("warning:" in said) == (i == NO_SIGNAL_STREAK - 1), (i, said)
    assert (f"{NO_SIGNAL_STREAK} updates in a row had nothing to learn; the latest batch: 0 "
            "of 6 (0 %) records are positive") in said
    assert "loss.name=topr raises only records with R − loss.baseline > 0" in said
    assert "train.allow_no_signal=true" in said
    policy.step(negatives)  # the streak goes on: said once, not every update
    assert "warning:" not in capsys.readouterr().err


def test_grpo_counts_records_in_groups_with_unequal_rewards(capsys):
    policy = _policy("grpo")
    # groups 0 and 2 mixed (4 records), group 1 all equal
    got = policy.step(_records([1, -1, -1, -1, 1, 1e-3], [0, 0, 1, 1, 2, 2]))
    assert got["signal/raised"] == 4 and got["signal/none"] == 0
    equal = _records([1, 1, -1, -1, 0, 0], [0, 0, 1, 1, 2, 2])
    for _ in range(NO_SIGNAL_STREAK):
        assert policy.step(equal)["signal/none"] == 1
    said = capsys.readouterr().err
    assert ("loss.name=grpo uses group-relative advantages: an all-equal group gives each of "
            "its records advantage 0, so it learns from 0 records in 0 groups") in said


def test_allow_no_signal_silences_the_warning(capsys):
    policy = _policy("topr", allow_no_signal=True)
    for _ in range(NO_SIGNAL_STREAK + 1):
        assert policy.step(_records([-1.0] * 6, [0, 0, 1, 1, 2, 2]))["signal/none"] == 1
    assert "warning:" not in capsys.readouterr().err
