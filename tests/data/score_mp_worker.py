"""One process of the two-process score test:
`python score_mp_worker.py PORT PROCESS_ID RESULT.json IN_DIR OUT_DIR [IN_DIR OUT_DIR ...]`.

Joins a 2-process JAX job on localhost (4 CPU devices each), builds the global
(data, fsdp, tensor) = (1, 4, 2) mesh over all 8 devices, and runs the score pass (SPEC §0) of
the tiny decoder on each (IN_DIR, OUT_DIR) pair in turn with 4 rows per call (2 per process).
Writes this process's metrics of every pass and one weight's sharding to RESULT.json.
"""

from __future__ import annotations

import json
import os
import sys

MESH = (1, 4, 2)
BATCH_SIZE = 4


def tiny_decoder():
    """The model both the workers and the test's single-process reference score with."""
    from flax import nnx

    from jaxrl_llm.models.config import DecoderConfig
    from jaxrl_llm.models.decoder import Decoder

    config = DecoderConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1,
                           num_heads=2, num_kv_heads=1, tie_embeddings=True)
    return Decoder(config, rngs=nnx.Rngs(0))


def main() -> None:
    port, process_id, result = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    pairs = list(zip(sys.argv[4::2], sys.argv[5::2], strict=True))
    # Set before jax initialises its backends (a fresh process: nothing has yet).
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.pop("XLA_FLAGS", None)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import jax

    jax.config.update("jax_num_cpu_devices", 4)
    from jaxrl_llm.parallel.distributed import initialize

    initialize(f"127.0.0.1:{port}", 2, process_id)
    from jaxrl_llm.config import MeshConfig
    from jaxrl_llm.parallel.mesh import make_mesh
    from jaxrl_llm.train.score import make_scorer, score_records

    assert jax.process_count() == 2 and len(jax.devices()) == 8
    mesh = make_mesh(MeshConfig(data=MESH[0], fsdp=MESH[1], tensor=MESH[2]))
    model = tiny_decoder()
    embed = make_scorer(model, temperature=1.0, mesh=mesh).params["embed"][...]
    runs = [score_records(model, src, dst, batch_size=BATCH_SIZE, mesh=mesh, progress=False)
            for src, dst in pairs]
    with open(result, "w") as f:
        json.dump({"runs": runs, "embed_spec": [str(a) for a in embed.sharding.spec]}, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
