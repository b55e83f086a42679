"""The trainer loop never waits on the device for metrics: step N's metrics are read only after
step N+1 has been dispatched, and checkpoint metadata (a device read) is built only on saves."""

from __future__ import annotations

import json

from jaxrl_llm.train import trainer as trainer_mod
from jaxrl_llm.train.trainer import Trainer
from tests.train.test_trainer import records, tiny_config  # noqa: F401 (records: a fixture)


def test_step_n_plus_1_is_dispatched_before_step_n_metrics_are_read(
        tmp_path, records, monkeypatch):  # noqa: F811
    events: list[tuple[str, int]] = []
    real_cached, real_fetch = trainer_mod.cached_train_step, trainer_mod.fetch_metrics
    real_meta = Trainer._meta
    metas: list[int] = []

    def cached(config, mesh, state):
        step_fn = real_cached(config, mesh, state)

        def dispatch(state, batch):
            out = step_fn(state, batch)
            events.append(("dispatch", sum(e == "dispatch" for e, _ in events) + 1))
            return out
        return dispatch

    def fetch(metrics):
        events.append(("read", sum(e == "read" for e, _ in events) + 1))
        return real_fetch(metrics)

    def meta(self, step, state):
        metas.append(step)
        return real_meta(self, step, state)

    monkeypatch.setattr(trainer_mod, "cached_train_step", cached)
    monkeypatch.setattr(trainer_mod, "fetch_metrics", fetch)
    monkeypatch.setattr(Trainer, "_meta", meta)
    config = tiny_config(tmp_path / "run", records, steps=5, log_every=2, checkpoint_every=4)
    trainer = Trainer(config, progress=False, tensorboard=False)
    try:
        result = trainer.run()
    finally:
        trainer.close()

    # dispatch 1, dispatch 2, read 1, dispatch 3, read 2, ..., dispatch 5, read 4, read 5
    want = [("dispatch", 1)]
    for n in range(2, 6):
        want += [("dispatch", n), ("read", n - 1)]
    assert events == want + [("read", 5)]
    # Metadata: once for the logger's run config, then only on the saves (step 4, final 5).
    assert metas == [0, 4, 5]
    assert trainer.checkpointer.all_steps() == [5]  # train.keep_checkpoints: 1 by default
    # Rows still carry each step's own metrics at that step (log_every 2, plus the last).
    rows = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4, 5]
    assert all("loss" in r for r in rows) and result.last_row["step"] == 5
