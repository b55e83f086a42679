"""One process of the two-process test: `python mp_worker.py PORT PROCESS_ID OUT.npz`.

Joins a 2-process JAX job on localhost (4 CPU devices each, gloo collectives), builds the
global (2, 2, 2) mesh over all 8 devices, loads only this process's rows of the batch, runs
one sharded TOPR step and writes the loss, grad norm and the gathered updated params.
"""

from __future__ import annotations

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.pop("XLA_FLAGS", None)

import jax

jax.config.update("jax_num_cpu_devices", 4)


def main() -> None:
    port, process_id, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    from jaxrl_llm.parallel.distributed import global_batch, initialize, process_row_slice

    initialize(f"127.0.0.1:{port}", 2, process_id)
    import numpy as np
    from flax import nnx
    from jax.experimental import multihost_utils

    from jaxrl_llm.data.batch import array_fields
    from jaxrl_llm.parallel.mesh import make_mesh
    from jaxrl_llm.train.state import create_train_state
    from jaxrl_llm.train.step import make_train_step
    from tests.parallel.helpers import make_batch, make_config
    from tests.parallel.toy_model import ToyLM

    assert jax.process_count() == 2 and len(jax.devices()) == 8
    config = make_config("topr", (2, 2, 2))
    mesh = make_mesh(config.mesh)
    with nnx.use_eager_sharding(False):
        model = ToyLM(rngs=nnx.Rngs(0))
    state = create_train_state(config, mesh, model)
    full = make_batch()
    rows = process_row_slice(full.batch_size)
    local = full.replace(**{
        name: getattr(full, name)[rows]
        for name in array_fields(full) if name != "pair_index"
    })
    step = make_train_step(config, mesh, state)
    new_state, metrics = step(state, global_batch(local, mesh))
    params = multihost_utils.process_allgather(new_state.params, tiled=True)
    flat = {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    np.savez(out, loss=np.asarray(metrics["loss"]), grad_norm=np.asarray(metrics["grad_norm"]),
             **{f"param{k}": v for k, v in flat.items()})
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
