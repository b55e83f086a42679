"""Weight versions through storage as one part per trainer process (online/weight_parts.py,
Exchange.publish_part / load): every element written exactly once across the job, in the
sampling dtype, and assembled back bit for bit; parts that overlap, miss a shard or carry stray
bytes are refused naming the array. The two-process test runs two `jax.distributed` processes
over one global mesh: each writes only shards its own devices hold, about half the bytes each,
and no process gathers the model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm.online.exchange import Exchange, ExchangeError
from jaxrl_llm.online.weight_parts import assemble, local_part
from jaxrl_llm.sampling.layout import cast_for_sampling
from tests.parallel.test_sharded_sampler import make_model, on_mesh


def _reference() -> list[np.ndarray]:
    """The tiny decoder's weights cast by hand as the sampler reads them: matrices bf16,
    vectors (norm scales) float32."""
    out = []
    for a in jax.tree.leaves(nnx.state(make_model())):
        a = np.asarray(a)
        out.append(a.astype(ml_dtypes.bfloat16) if a.ndim >= 2 else a)
    return out


def test_one_process_part_of_a_sharded_model_is_every_element_once_in_bf16():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (tests/conftest.py forces 8 host devices)")
    model = on_mesh(make_model(), 8, data=4, fsdp=2, tensor=1)
    state = nnx.state(model)
    leaves, payload = local_part(cast_for_sampling(state, jnp.bfloat16))
    want = _reference()
    # 8 devices hold up to 4 replicas of each shard; each element is written once
    assert len(payload) == sum(a.nbytes for a in want)
    got = assemble([(leaves, payload)], "test")
    assert [g.dtype for g in got] == [w.dtype for w in want]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    # an fsdp-split matrix is written as its two fsdp shards
    sharded = [leaf for leaf in leaves if len(leaf[3]) == 2]
    assert sharded, [leaf[:3] for leaf in leaves]


def test_parts_that_overlap_miss_a_shard_or_carry_stray_bytes_are_refused():
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    top = [["w", "float32", [4, 3], [[[0, 2], [0, 3]]]]]
    bottom = [["w", "float32", [4, 3], [[[2, 4], [0, 3]]]]]
    halves = [(top, a[:2].tobytes()), (bottom, a[2:].tobytes())]
    np.testing.assert_array_equal(assemble(halves, "v")[0], a)
    with pytest.raises(ValueError, match=r"v: w has an element in two parts' shards"):
        assemble([halves[0], halves[0]], "v")
    with pytest.raises(ValueError, match=r"v: w has 6 elements no part wrote"):
        assemble([halves[0]], "v")
    with pytest.raises(ValueError, match=r"part 1 holds 4 bytes past its last shard"):
        assemble([halves[0], (bottom, a[2:].tobytes() + b"\0" * 4)], "v")
    with pytest.raises(ValueError, match=r"part 1 ends inside w"):
        assemble([halves[0], (bottom, a[2:].tobytes()[:-4])], "v")


def test_an_exchange_version_is_complete_only_with_every_part(tmp_path: Path):
    ex = Exchange(str(tmp_path), 1)
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    top = [["w", "float32", [4, 3], [[[0, 2], [0, 3]]]]]
    bottom = [["w", "float32", [4, 3], [[[2, 4], [0, 3]]]]]
    ex.publish_part(3, 1, 2, bottom, a[2:].tobytes(), {"run": "x"})
    assert ex.versions() == [] and ex.header(3) is None  # part 0 not written yet
    with pytest.raises(FileNotFoundError):
        ex.load(3)
    ex.publish_part(3, 0, 2, top, a[:2].tobytes(), {"run": "x"})
    assert ex.versions() == [3]
    header, arrays = ex.load(3)
    np.testing.assert_array_equal(arrays[0], a)
    assert header["leaves"] == [["w", "float32", [4, 3]]]
    # a torn part: refused, never assembled
    path = ex.part_path(3, 1, 2)
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(ExchangeError, match=r"v00000003-p001of002.bin: half-written weight "
                       r"version θ_3 \(part 1 of 2"):
        ex.load(3)
    ex.collect(versions_below=4, rounds_below=0)
    assert ex.versions() == [] and not list((tmp_path / "weights").iterdir())


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_trainer_processes_each_write_their_own_half(tmp_path: Path):
    from tests.parallel.helpers import free_port

    worker = Path(__file__).with_name("mp_weight_parts.py")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(worker), port, str(i), str(tmp_path)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(2)]
    for p in procs:
        out = p.communicate(timeout=600)[0]
        assert p.returncode == 0, out[-3000:]
    ex = Exchange(str(tmp_path), 1)
    assert ex.versions() == [0]
    want = _reference()
    total = sum(a.nbytes for a in want)
    sizes = [ex.part_header(ex.part_path(0, i, 2))["payload_bytes"] for i in range(2)]
    assert sum(sizes) == total  # every element once: no process wrote another's shards
    assert all(0.3 * total < s < 0.7 * total for s in sizes), (sizes, total)
    _, got = ex.load(0)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)
