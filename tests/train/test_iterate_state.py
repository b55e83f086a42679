"""`iterate` continues one optimizer across iterations: iteration 2 starts from iteration 1's
final train state (Adam moments and count, optimizer step, RNG), not a fresh one."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from jaxrl_llm.config import load_config
from jaxrl_llm.flows.iterate import IterateConfig, experiment_part, run_iterations
from jaxrl_llm.train.checkpoint import CHECKPOINT_DIR, Checkpointer
from jaxrl_llm.train.trainer import Trainer

STEPS = 2


def tiny_iterate_config(run_dir) -> IterateConfig:
    tree = {
        "run_dir": str(run_dir), "seed": 1,
        "model": {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
                  "num_layers": 1, "num_heads": 2, "num_kv_heads": 1},
        "optim": {"name": "adamw", "learning_rate": 1e-2},
        "loss": {"name": "topr"},
        "train": {"steps": STEPS, "batch_size": 8, "max_seq_len": 160, "log_every": 1,
                  "checkpoint_every": STEPS},
        "generate": {"n": 4, "max_new_tokens": 6, "batch_size": 4},
        "data": {"task": "arithmetic", "num_prompts": 2},
        "iterate": {"iterations": 2, "evaluate_initial": False, "export": False,
                    "evaluate": False},
    }
    return IterateConfig.model_validate(tree)


def leaves_named(tree, word: str) -> list[np.ndarray]:
    """Leaves of an optax state whose path mentions `word` (e.g. "count", "mu", "nu")."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [np.asarray(x) for path, x in flat if word in jax.tree_util.keystr(path)]


def saved_state(config: IterateConfig, train_dir, records=None, **kwargs):
    records = records if records is not None else train_dir.parent / "curated"
    trainer = Trainer(experiment_part(config), records=records,
                      run_dir=train_dir, progress=False, tensorboard=False, **kwargs)
    try:
        return trainer._initial_state()
    finally:
        trainer.close()


@pytest.mark.slow
def test_iteration_two_continues_iteration_one_optimizer(tmp_path):
    config = tiny_iterate_config(tmp_path / "it")
    _, results = run_iterations(config, progress=False)
    assert [r.index for r in results] == [1, 2]
    it1, it2 = (tmp_path / "it" / f"iter_{i}" / "train" for i in (1, 2))

    # Optimizer step in each iteration's final checkpoint: global, not per iteration.
    for train_dir, expected in ((it1, STEPS), (it2, 2 * STEPS)):
        ckpt = Checkpointer(train_dir / CHECKPOINT_DIR, async_save=False)
        meta = ckpt.read_meta()
        ckpt.close()
        assert meta["step"] == STEPS  # loop steps of this iteration
        assert meta["optimizer_step"] == expected
    end1, _ = saved_state(config, it1)
    end2, _ = saved_state(config, it2)
    assert [int(c) for c in leaves_named(end1.opt_state, "count")] and all(
        int(c) == STEPS for c in leaves_named(end1.opt_state, "count"))
    # Adam's bias-correction count continued: a fresh optimizer would end at STEPS again.
    assert all(int(c) == 2 * STEPS for c in leaves_named(end2.opt_state, "count"))

    # What iteration 2 started from (its trainer's first state, loop step 0) is iteration
    # 1's final state: the same non-zero first and second moments, step and RNG.
    start2, loop = saved_state(config, tmp_path / "probe", records=it2.parent / "curated",
                               init_from=it1 / CHECKPOINT_DIR)
    assert loop == 0 and int(start2.step) == STEPS
    mu_end1, mu_start2 = leaves_named(end1.opt_state, "mu"), leaves_named(start2.opt_state, "mu")
    assert mu_end1 and any(np.abs(m).max() > 0 for m in mu_end1)
    for a, b in zip(mu_end1, mu_start2, strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(leaves_named(end1.opt_state, "nu"), leaves_named(start2.opt_state, "nu"),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(start2.rng))
                                  if jax.dtypes.issubdtype(start2.rng.dtype,
                                                           jax.dtypes.prng_key)
                                  else np.asarray(start2.rng), np.asarray(end1.rng))
    # And iteration 2's moments moved on from there (it trained with them).
    assert any(not np.array_equal(a, b)
               for a, b in zip(mu_end1, leaves_named(end2.opt_state, "mu"), strict=True))
    stages = json.loads((tmp_path / "it" / "iter_2" / "stages.json").read_text())
    assert stages["train"]["steps"] == STEPS


def test_shipped_iterate_configs_load():
    from pathlib import Path

    for path in sorted((Path(__file__).resolve().parents[2] / "configs").glob("iterate_*")):
        assert load_config(path, schema=IterateConfig).iterate.iterations >= 1
