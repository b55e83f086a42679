"""The continuous sampler's decode program (`sampling/slot_program.decode_slots`) compiled for a
v5e topology by the real TPU compiler (libtpu, no TPU needed: as `jaxrl-llm plan` compiles the
train step), for an 8B Llama-3-shaped model in bfloat16 at 256 concurrent sequences and
8,192-token contexts (a 1,024-token prompt slot width + 7,168 generated slots per sequence),
n = 8 samples per prompt over the shared prompt cache (64 store rows, 8 staged prompts
prefilled 256 tokens per chunk beside each decode step); prints and writes the per-chip memory.
The decode program gets the fused weights the sampler builds once per call
(`decode_program.fused_layer_params`), compiled the same way. `--decode-layers scanned` (the
default: what `model.decode_layers: auto` picks on TPU) decodes under the layer scan on one
stacked cache; `unrolled` (auto's choice on CPU and GPU) gives each layer its own cache buffer
and weight copy, which the program's arguments hold beside the model's stacked weights, as the
sampler's do.

Sharding: the weights by the project's rules (`parallel/rules.py`) on a (data, fsdp, tensor)
mesh; the slots', store's and staging rows over data × fsdp and the KV heads over tensor, so
each chip holds 1/chips of the KV cache.

    python benchmarks/decode_v5e.py --topology v5e:4x8 --fsdp 8 --tensor 4
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm.config.train import MeshConfig
from jaxrl_llm.models.config import DecoderConfig
from jaxrl_llm.models.decoder import Decoder
from jaxrl_llm.parallel.memory import program_memory
from jaxrl_llm.parallel.mesh import make_mesh
from jaxrl_llm.parallel.rules import state_shardings
from jaxrl_llm.plan import _tpu_devices
from jaxrl_llm.sampling.decode_program import Program, fused_layer_params
from jaxrl_llm.sampling.prompt_cache import init_staging, init_store, kv_bytes_per_sequence
from jaxrl_llm.sampling.slot_program import decode_slots, init_slots

RESULTS = Path(__file__).parent / "results"
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                 num_heads=32, num_kv_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
                 tie_embeddings=False, scan_layers=True, param_dtype="bfloat16",
                 compute_dtype="bfloat16")


def carry_sharding(path, leaf, mesh) -> NamedSharding:
    """Rows over (data, fsdp); a cache k/v buffer's KV heads over tensor."""
    rows = ("data", "fsdp")
    name = jax.tree_util.keystr(path)
    if leaf.ndim == 0:
        return NamedSharding(mesh, P())
    if re.search(r"(\['[kv]'\]|\.[kv])\[\d+\]$", name):  # a layer's [R, Hkv, D, S] / [R, Hkv, S, D]
        return NamedSharding(mesh, P(rows, "tensor"))
    if name.endswith((".k", ".v", "['k']", "['v']")):  # the stack [L, R, Hkv, D, S] / [L, R, Hkv, S, D]
        return NamedSharding(mesh, P(None, rows, "tensor"))
    return NamedSharding(mesh, P(rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--topology", default="v5e:4x8")
    ap.add_argument("--data", type=int, default=1)
    ap.add_argument("--fsdp", type=int, default=8)
    ap.add_argument("--tensor", type=int, default=4)
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--prompt", type=int, default=1024, help="prompt slots of the context")
    ap.add_argument("--store-rows", type=int, default=64, help="shared prompt store rows")
    ap.add_argument("--staged", type=int, default=8, help="prompts prefilled at a time")
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk (tokens)")
    ap.add_argument("--decode-layers", default="scanned", choices=("scanned", "unrolled"),
                    help="model.decode_layers (auto: scanned on TPU)")
    ap.add_argument("--out", default=str(RESULTS / "decode_v5e.json"))
    args = ap.parse_args(argv)
    devices = _tpu_devices(args.topology)
    mesh = make_mesh(MeshConfig(data=args.data, fsdp=args.fsdp, tensor=args.tensor), devices)
    config = DecoderConfig(**LLAMA3_8B, decode_layers=args.decode_layers)
    abstract = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    shardings = state_shardings(state, mesh)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         state, shardings)
    max_new = args.context - args.prompt
    program = Program(max_new_tokens=max_new, n=8, greedy=False, top_k=0, use_top_p=False)

    def empty():  # these read only the model's config (init_cache)
        carry = init_slots(abstract, slots=args.slots, gen_len=max_new,
                           cache_dtype=jnp.bfloat16, max_new=max_new, vocab=config.vocab_size,
                           pad_token_id=0, key=jax.random.key(0), return_logits=False,
                           staging=init_staging(abstract, args.staged, args.prompt,
                                                jnp.bfloat16))
        return carry, init_store(abstract, args.store_rows, args.prompt, jnp.bfloat16)

    shard = lambda tree: jax.tree_util.tree_map_with_path(
        lambda path, a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                             sharding=carry_sharding(path, a, mesh)), tree)
    carry, store = map(shard, jax.eval_shape(empty))
    scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype, sharding=NamedSharding(mesh, P()))
    start = time.perf_counter()
    with jax.set_mesh(mesh):
        fused = fused_layer_params.lower(graphdef, state).compile()
        layer_params = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            jax.eval_shape(lambda st: fused_layer_params(graphdef, st), state),
            fused.output_shardings)
        lowered = decode_slots.lower(
            graphdef, state, layer_params, carry, store, scalar(jnp.int32), scalar(jnp.int32),
            scalar(jnp.float32), scalar(jnp.float32),
            jax.ShapeDtypeStruct((1,), jnp.int32, sharding=NamedSharding(mesh, P())),
            program=program, pad_token_id=0, return_logits=False, chunk=args.chunk)
        compiled = lowered.compile()
    seconds = time.perf_counter() - start
    memory = program_memory(compiled)
    # unrolled: jit drops the stacked layer weights (unused beside the per-layer copy) from
    # the program's arguments; the sampler's caller still holds them: resident = peak + these.
    # scanned: the fused projections are a copy (a concatenation), so the unfused q/k/v and
    # gate/up stay apart; the rest of the stack is the program's own argument.
    per_chip = lambda tree: sum(
        math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
        for a in jax.tree.leaves(tree))
    stacked = per_chip(state["layers"])
    fused_away = per_chip([a for path, a in jax.tree_util.tree_leaves_with_path(state["layers"])
                           if re.search(r"\['(q|k|v|gate|up)'\]", jax.tree_util.keystr(path))])
    held_apart = stacked if args.decode_layers == "unrolled" else fused_away
    figure = dict(itemsize=2, prompt_width=args.prompt, max_new_tokens=max_new,
                  slots=args.slots, prompt_rows=args.store_rows, staging_rows=args.staged)
    kv = kv_bytes_per_sequence(config, **figure)
    copied = kv_bytes_per_sequence(config, **figure, shared=False)
    result = dict(topology=args.topology, chips=len(devices), mesh=dict(
        data=args.data, fsdp=args.fsdp, tensor=args.tensor), model="Llama-3-8B shape, bfloat16",
        decode_layers=args.decode_layers,
        slots=args.slots, context=args.context, prompt=args.prompt, n=8,
        store_rows=args.store_rows, staged=args.staged, chunk=args.chunk, compile_s=seconds,
        per_chip_gib=dict(arguments=memory.argument / 2**30, outputs=memory.output / 2**30,
                          aliased=memory.alias / 2**30, temporaries=memory.temp / 2**30,
                          peak=memory.peak / 2**30,
                          layer_weights_copy=per_chip(layer_params) / 2**30,
                          stacked_layer_weights=stacked / 2**30,
                          resident=(memory.peak + held_apart) / 2**30),
        kv_cache_gib_total=kv * args.slots / 2**30, kv_bytes_per_sequence=kv,
        kv_bytes_per_sequence_copied=copied)
    print(json.dumps(result, indent=2))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
