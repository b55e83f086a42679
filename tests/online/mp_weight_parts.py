"""One trainer process of the two-process weight-part test: `python mp_weight_parts.py PORT
PROCESS_ID EXCHANGE`. Each process has 4 CPU devices; the tiny decoder's weights are placed on
the global `mesh: {data: 4, fsdp: 2}` over all 8 (the multi-host trainer's layout) and each
process writes its own part of θ_0 in bfloat16 (`online/weight_parts.py`), as
`StorageTrainer.publish` does, gathering nothing."""

from __future__ import annotations

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.pop("XLA_FLAGS", None)

import jax

jax.config.update("jax_num_cpu_devices", 4)


def main() -> None:
    port, process_id, root = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    from jaxrl_llm.parallel.distributed import initialize

    initialize(f"127.0.0.1:{port}", 2, process_id)
    import jax.numpy as jnp
    from flax import nnx

    from jaxrl_llm.online.exchange import Exchange
    from jaxrl_llm.online.weight_parts import local_part
    from jaxrl_llm.sampling.layout import cast_for_sampling
    from tests.parallel.test_sharded_sampler import make_model, on_mesh

    model = on_mesh(make_model(), 8, data=4, fsdp=2, tensor=1)
    leaves, payload = local_part(cast_for_sampling(nnx.state(model), jnp.bfloat16))
    Exchange(root, 60).publish_part(0, jax.process_index(), jax.process_count(), leaves,
                                    payload, {"run": "test", "incarnation": "mp"})
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
