"""Orbax checkpoints: round trip with the grain iterator, keep-last-K, a kill during an async
save, and restore onto a different mesh shape."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm.train.checkpoint import Checkpointer, abstract_like
from jaxrl_llm.train.metrics_log import MetricsLogger


def make_state(seed: int) -> dict:
    key = jax.random.key(seed)
    return {
        "params": {"w": jax.random.normal(key, (16, 8)), "b": jnp.full((8,), float(seed))},
        "opt": {"mu": jnp.ones((16, 8)) * seed, "count": jnp.array(seed, jnp.int32)},
        "rng": jax.random.key_data(jax.random.key(seed + 100)),
    }


def test_round_trip_with_iterator_meta_and_keep_last(tmp_path):
    dataset = grain.MapDataset.range(50).seed(3).shuffle().batch(2).to_iter_dataset()
    iterator = iter(dataset)
    consumed = [next(iterator).tolist() for _ in range(3)]
    ckpt = Checkpointer(tmp_path / "ckpt", save_every=2, keep=2)
    assert not ckpt.save(3, make_state(3))  # not due
    for step in (2, 4, 6):
        assert ckpt.save(step, make_state(step), data_iterator=iterator,
                         meta={"config": {"seed": 1}})
    ckpt.wait()
    assert ckpt.all_steps() == [4, 6] and ckpt.latest_step() == 6
    upcoming = [next(iterator).tolist() for _ in range(2)]

    fresh = iter(dataset)
    restored = Checkpointer(tmp_path / "ckpt").restore(
        abstract_like(make_state(0)), data_iterator=fresh
    )
    assert restored.step == 6 and restored.meta == {"step": 6, "config": {"seed": 1}}
    expected = make_state(6)
    for got, want in zip(jax.tree.leaves(restored.state), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert [next(fresh).tolist() for _ in range(2)] == upcoming
    assert consumed[0] != upcoming[0]
    with pytest.raises(FileNotFoundError, match="step 2 not in"):
        ckpt.restore(None, step=2)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        Checkpointer(tmp_path / "empty").restore(None)
    ckpt.close()


KILL_SCRIPT = textwrap.dedent(
    """
    import glob, os, signal, sys, time
    import jax, jax.numpy as jnp
    from jaxrl_llm.train.checkpoint import Checkpointer

    ckpt = Checkpointer(sys.argv[1], save_every=1, keep=5)
    ckpt.save(1, {"w": jnp.full((1024, 1024), 1.0)})
    ckpt.wait()
    # ~256 MB, and the kill waits for the save's temporary directory: it lands mid-write
    # however loaded the machine is (killed before that, the save would not have started)
    ckpt.save(2, {"w": jnp.full((8192, 8192), 2.0)})
    deadline = time.monotonic() + 120  # a bound on a hung save only
    while not glob.glob(os.path.join(sys.argv[1], "2.orbax-checkpoint-tmp*")):
        if time.monotonic() > deadline:
            sys.exit("no temporary directory for step 2 within 120 s")
        time.sleep(0.001)
    print("SAVING", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_kill_during_async_save_keeps_previous_checkpoint(tmp_path):
    directory = tmp_path / "ckpt"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(directory)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert "SAVING" in proc.stdout
    names = sorted(p.name for p in directory.iterdir())
    assert "1" in names and "2" not in names, names
    assert any(name.startswith("2.orbax-checkpoint-tmp") for name in names), names

    ckpt = Checkpointer(directory, save_every=1)
    assert ckpt.latest_step() == 1
    restored = ckpt.restore(abstract_like({"w": jnp.zeros((1024, 1024))}))
    np.testing.assert_array_equal(np.asarray(restored.state["w"]), 1.0)
    # Saving step 2 again replaces the stale partial directory.
    assert ckpt.save(2, {"w": jnp.full((8, 8), 3.0)})
    ckpt.wait()
    assert ckpt.latest_step() == 2
    ckpt.close()


BLOB_KILL_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    import jax.numpy as jnp
    from jaxrl_llm.train import checkpoint
    from jaxrl_llm.train.checkpoint import Checkpointer

    ckpt = Checkpointer(sys.argv[1], save_every=1, keep=5, async_save=sys.argv[3] == "async")
    ckpt.save(1, {"w": jnp.full((256, 256), 1.0)}, meta={"q": 1}, blobs={"queue": b"one"})
    ckpt.wait()
    write = checkpoint._BytesHandler.save

    def killed(self, directory, args):  # the state's save has begun; the queue's now
        if sys.argv[2] == "after":
            write(self, directory, args)
        print("SAVING", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    checkpoint._BytesHandler.save = killed
    ckpt.save(2, {"w": jnp.full((256, 256), 2.0)}, meta={"q": 2}, blobs={"queue": b"two"})
    ckpt.wait()
    """
)


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill_while_saving_a_blob_resumes_the_previous_step_whole(tmp_path, when, mode):
    """A `blobs` item (the online loop's queue) is committed with its step's state: a kill
    before or after its bytes are written, the state's save under way, leaves step 1's state,
    meta and blob, never step 1's state with step 2's queue."""
    directory = tmp_path / "ckpt"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.run([sys.executable, "-c", BLOB_KILL_SCRIPT, str(directory), when, mode],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL and "SAVING" in proc.stdout, proc.stderr[-2000:]
    with Checkpointer(directory, save_every=1) as ckpt:
        assert ckpt.all_steps() == [1]
        restored = ckpt.restore(abstract_like({"w": jnp.zeros((256, 256))}))
        np.testing.assert_array_equal(np.asarray(restored.state["w"]), 1.0)
        assert restored.meta["q"] == 1 and ckpt.read_blob("queue") == b"one"
        # a step saved without blobs has none; their names cannot shadow the step's own items
        assert ckpt.save(2, {"w": jnp.zeros(2)})
        ckpt.wait()
        assert ckpt.read_blob("queue", 2) is None
        with pytest.raises(ValueError, match="checkpoint's own item"):
            ckpt.save(3, {"w": jnp.zeros(2)}, blobs={"meta": b""})


def mesh(shape: tuple[int, int, int]) -> jax.sharding.Mesh:
    return jax.make_mesh(shape, ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)


def test_restore_onto_a_different_mesh_shape(tmp_path):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (fake) devices")
    state = make_state(5)
    save_mesh = mesh((2, 4, 1))
    save_specs = {"params": {"w": P("fsdp", "data"), "b": P("fsdp")},
                  "opt": {"mu": P("fsdp", None), "count": P()}, "rng": P()}
    shard = lambda specs, m: jax.tree.map(lambda s: NamedSharding(m, s), specs,
                                         is_leaf=lambda x: isinstance(x, P))
    sharded = jax.device_put(state, shard(save_specs, save_mesh))
    with Checkpointer(tmp_path / "ckpt", save_every=1) as ckpt:
        ckpt.save(1, sharded)

    new_mesh = mesh((1, 2, 4))
    new_specs = {"params": {"w": P("fsdp", "tensor"), "b": P("tensor")},
                 "opt": {"mu": P(None, "tensor"), "count": P()}, "rng": P()}
    target_shardings = shard(new_specs, new_mesh)
    restored = Checkpointer(tmp_path / "ckpt").restore(abstract_like(state, target_shardings))
    for got, want, sharding in zip(jax.tree.leaves(restored.state), jax.tree.leaves(state),
                                   jax.tree.leaves(target_shardings)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert got.sharding == sharding


def test_metrics_log_jsonl_tensorboard_and_resume_truncation(tmp_path):
    with MetricsLogger(tmp_path) as log:
        for step in (10, 20, 30):
            log.log(step, {"loss": np.float32(step / 10), "bad": float("nan")})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [10, 20, 30]
    assert rows[1]["loss"] == 2.0 and rows[1]["bad"] is None
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    # Resuming from step 20 drops the row logged after the checkpoint by the killed run.
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 40, "lo')  # torn line
    with MetricsLogger(tmp_path, resume_step=20, tensorboard=False) as log:
        log.log(30, {"loss": 3.5})
    rows = [json.loads(line) for line in Path(tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(10, 1.0), (20, 2.0), (30, 3.5)]
