"""One process of the two-process sampler test: `python mp_sampler_worker.py PORT PROCESS_ID
OUT.npz`, or `python mp_sampler_worker.py - 0 OUT.npz` for the one-process reference on 8 devices.

Each process has 4 CPU devices (gloo collectives); the model's weights are placed on the global
`mesh: {data: 8}` over all 8, the continuous sampler decodes in 8 slot groups (one per device,
4 on each process), and every process writes the gathered outputs and the processes whose
devices hold the decode layout's slot groups.
"""

from __future__ import annotations

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.pop("XLA_FLAGS", None)

import jax

TWO = sys.argv[1] != "-"
jax.config.update("jax_num_cpu_devices", 4 if TWO else 8)


def main() -> None:
    port, process_id, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    if TWO:
        from jaxrl_llm.parallel.distributed import initialize

        initialize(f"127.0.0.1:{port}", 2, process_id)
    import numpy as np

    from jaxrl_llm.sampling.continuous import ContinuousSampler
    from jaxrl_llm.sampling.sampler import SamplingParams
    from tests.parallel.test_sharded_sampler import PROMPTS, STOPS, make_model, on_mesh

    assert len(jax.devices()) == 8
    model = on_mesh(make_model(), 8, data=8, fsdp=1, tensor=1)
    sampler = ContinuousSampler(model, slots=16, prompt_buckets=(8,))
    params = SamplingParams(max_new_tokens=12, temperature=1.0, n=2, stop_token_ids=STOPS,
                            top_k=20, top_p=0.9)
    got = sampler.generate(PROMPTS, params, jax.random.key(11))
    # Which processes' devices decoded: every slot group's KV shard and where it lives.
    layout = sampler.decode_layout
    owners = sorted({d.process_index for d in layout.mesh.devices.flat})
    np.savez(out, tokens=got.tokens, logprobs=got.logprobs, raw_logprobs=got.raw_logprobs,
             lengths=got.lengths, groups=layout.groups, owners=np.asarray(owners),
             local_devices=len(jax.local_devices()))
    if TWO:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
