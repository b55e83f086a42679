"""Issue 42 item 7, what checkpoints cost on disk: `train.checkpoint_dtype: bfloat16` stores the
parameters in half the bytes (measured from the files the trainer wrote), the default keeps one
checkpoint (`train.keep_checkpoints` is honoured after many saves), and a run resumes from a
bfloat16 checkpoint, starting from the rounded weights, with a warning that it is not bit-exact."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

from jaxrl_llm.train.checkpoint import CHECKPOINT_DIR, Checkpointer
from jaxrl_llm.train.trainer import Trainer
from tests.train.test_trainer import records, tiny_config  # noqa: F401 (records: a fixture)


def _train(run: Path, recs: Path, model: dict | None = None, **train: object):
    trainer = Trainer(tiny_config(run, recs, model=model, **train), progress=False,
                      tensorboard=False)
    try:
        return trainer.run(), trainer.checkpointer.all_steps()
    finally:
        trainer.close()


def _bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def test_bfloat16_params_take_half_the_bytes(tmp_path: Path) -> None:
    # weights-like values (normal, 2^20 of them): what the files hold, Orbax's compression included
    params = {"w": jax.random.normal(jax.random.key(0), (1024, 1024))}
    sizes = {}
    for dtype in ("float32", "bfloat16"):
        with Checkpointer(tmp_path / dtype, async_save=False, params_dtype=dtype) as ckpt:
            ckpt.save(1, {"params": params}, force=True)
        sizes[dtype] = _bytes(tmp_path / dtype / "1" / "state")
    raw = 4 * 2**20
    # float32 hardly compresses (random mantissas); bfloat16 is at most half of it
    assert 0.85 * raw <= sizes["float32"] <= 1.01 * raw, sizes
    assert sizes["bfloat16"] <= 0.5 * sizes["float32"], sizes


# Wide enough (≈ 0.6M parameters) that the 2 bytes a parameter bfloat16 drops dwarf how
# Orbax's OCDBT store happens to split the arrays into data files and b-tree nodes, which
# follows the timing of its concurrent writes: on the 11k-parameter default model the same
# save varied by ±8 KB of a 23 KB difference from one run to the next.
WIDE = {"hidden_size": 256, "intermediate_size": 512}


def test_the_trainer_stores_bfloat16_params(tmp_path: Path, records: Path) -> None:  # noqa: F811
    sizes, counts = {}, {}
    for dtype in ("float32", "bfloat16"):
        result, steps = _train(tmp_path / dtype, records, model=WIDE, steps=2,
                               checkpoint_dtype=dtype)
        sizes[dtype] = _bytes(tmp_path / dtype / CHECKPOINT_DIR / str(steps[-1]) / "state")
        counts[dtype] = sum(x.size for x in jax.tree.leaves(result.state.params))
    assert counts["float32"] == counts["bfloat16"]
    params = counts["float32"]
    assert params > 500_000, params
    # The AdamW moments are float32 either way (the same values: casting happens at the save):
    # the files differ by the 2 bytes a parameter that bfloat16 drops, within what compression
    # and Orbax's layout take or give (measured: 1.06 × 2 bytes a parameter).
    saved = sizes["float32"] - sizes["bfloat16"]
    assert 0.9 * 2 * params <= saved <= 1.15 * 2 * params, (sizes, params)


def test_keep_checkpoints_is_honoured(tmp_path: Path, records: Path) -> None:  # noqa: F811
    _, steps = _train(tmp_path / "default", records, steps=5, checkpoint_every=1)
    assert steps == [5]  # the default keeps the newest only
    assert sorted(os.listdir(tmp_path / "default" / CHECKPOINT_DIR)) == ["5"]
    _, steps = _train(tmp_path / "two", records, steps=5, checkpoint_every=1, keep_checkpoints=2)
    assert steps == [4, 5]


def test_resume_from_a_bfloat16_checkpoint(tmp_path: Path, records: Path, capsys) -> None:  # noqa: F811
    first, _ = _train(tmp_path / "run", records, steps=2, checkpoint_dtype="bfloat16")
    trainer = Trainer(tiny_config(tmp_path / "run", records, steps=4, checkpoint_dtype="bfloat16"),
                      progress=False, tensorboard=False)
    try:
        state, step = trainer._initial_state()
        assert step == 2
        assert "not bit-exact" in capsys.readouterr().err
        # the resumed weights are the trained float32 weights rounded to bfloat16, in float32
        for got, trained in zip(jax.tree.leaves(state.params), jax.tree.leaves(first.state.params)):
            want = np.asarray(trained).astype(ml_dtypes.bfloat16).astype(np.float32)
            assert np.asarray(got).dtype == np.float32
            np.testing.assert_array_equal(np.asarray(got), want)
        resumed = trainer.run()
    finally:
        trainer.close()
    assert resumed.step == 4 and trainer.checkpointer.all_steps() == [4]
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(resumed.state.params))
