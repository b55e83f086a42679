"""The continuous sampler's own decode and prefill programs compiled for a v5e topology by the
real TPU compiler (libtpu, no TPU needed), through the library's path: `jaxrl_llm.plan.sampler.
make_sampler_plan`, what `jaxrl-llm plan` runs for a config that samples. The decode layout is
the one the sampler derives itself (`sampling/layout.py`: slots, prompt store and staging rows
over the slot groups, KV heads and weight heads over tensor, the weights in bfloat16), from the
mesh `--data` × `--fsdp` × `--tensor` or from `--decode-data` × `--decode-tensor`; nothing here
builds a sharding.

Defaults: an 8B Llama-3-shaped model in bfloat16 at 8,192-token contexts (a 1,024-token prompt
+ 7,168 new tokens), n = 8, 256 slots on v5e:4x8 (32 chips: 4 slot groups × tensor 8).
`--model qwen3-8b` takes Qwen3-8B's shape. `--decode-layers scanned` (the default: what
`model.decode_layers: auto` picks on TPU) decodes under the layer scan on one stacked cache;
`unrolled` (auto's choice on CPU and GPU) gives each layer its own cache buffer and weight copy.

    python benchmarks/decode_v5e.py --topology v5e:4x8 --tensor 8
    python benchmarks/decode_v5e.py --topology v5e:16x16 --tensor 8 --slots 2048
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxrl_llm.config import load_config
from jaxrl_llm.parallel.mesh import make_mesh
from jaxrl_llm.plan import _tpu_devices
from jaxrl_llm.plan.sampler import format_sampler_plan, make_sampler_plan
from jaxrl_llm.weights.loading import decoder_config

RESULTS = Path(__file__).parent / "results"
MODELS = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                      max_position_embeddings=8192, rope_theta=500000.0, tie_embeddings=False),
    "qwen3-8b": dict(family="qwen3", vocab_size=151936, hidden_size=4096,
                     intermediate_size=12288, num_layers=36, num_heads=32, num_kv_heads=8,
                     head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
                     tie_embeddings=False),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--topology", default="v5e:4x8")
    ap.add_argument("--model", default="llama3-8b", choices=sorted(MODELS))
    ap.add_argument("--data", type=int, default=-1, help="mesh.data (-1: the rest)")
    ap.add_argument("--fsdp", type=int, default=1, help="mesh.fsdp (decodes as slot groups)")
    ap.add_argument("--tensor", type=int, default=8, help="mesh.tensor")
    ap.add_argument("--decode-data", type=int, default=None, help="generate.decode_data")
    ap.add_argument("--decode-tensor", type=int, default=None, help="generate.decode_tensor")
    ap.add_argument("--slots", type=int, default=256, help="generate.batch_size × n (n = 8)")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--prompt", type=int, default=1024, help="prompt slots of the context")
    ap.add_argument("--store-rows", type=int, default=None,
                    help="shared prompt store rows in all (default: the sampler's)")
    ap.add_argument("--staged", type=int, default=None,
                    help="prompts prefilled at a time (refill_slots = staged × n)")
    ap.add_argument("--chunk", type=int, default=256, help="generate.prefill_chunk (tokens)")
    ap.add_argument("--decode-layers", default="scanned", choices=("scanned", "unrolled"),
                    help="model.decode_layers (auto: scanned on TPU)")
    ap.add_argument("--out", default=str(RESULTS / "decode_v5e.json"))
    args = ap.parse_args(argv)
    n = 8
    overrides = [f"model.{k}={v}" for k, v in MODELS[args.model].items()] + [
        "model.source=random", "model.scan_layers=true", "model.param_dtype=bfloat16",
        "model.compute_dtype=bfloat16", f"model.decode_layers={args.decode_layers}",
        f"mesh.data={args.data}", f"mesh.fsdp={args.fsdp}", f"mesh.tensor={args.tensor}",
        f"generate.n={n}", f"generate.batch_size={args.slots // n}",
        f"generate.max_new_tokens={args.context - args.prompt}",
        f"generate.prefill_chunk={args.chunk}", f"train.max_seq_len={args.context}",
        "plan.platform=tpu", f"plan.topology={args.topology}"]
    if args.decode_data:
        overrides.append(f"generate.decode_data={args.decode_data}")
    if args.decode_tensor:
        overrides.append(f"generate.decode_tensor={args.decode_tensor}")
    config = load_config(None, overrides)
    devices = _tpu_devices(args.topology)
    mesh = make_mesh(config.mesh, devices)
    plan = make_sampler_plan(config, decoder_config(config.model), mesh, 16 * 2**30,
                             prompt_rows=args.store_rows,
                             refill_slots=None if args.staged is None else args.staged * n)
    print(format_sampler_plan(plan), end="")
    gib = lambda b: b / 2**30
    result = dict(
        topology=args.topology, chips=len(devices), model=f"{args.model} shape, bfloat16",
        mesh=dict(mesh.shape), decode_layout=plan.layout, decode_layers=args.decode_layers,
        slots=plan.slots, slots_per_group=plan.slots // plan.groups, context=args.context,
        prompt=plan.prompt_width, n=n, store_rows=plan.prompt_rows,
        staged=plan.staging_rows, chunk=args.chunk, compile_s=plan.compile_seconds,
        per_chip_gib=dict(
            kv_cache=gib(plan.kv_bytes_per_chip), weights=gib(plan.weight_bytes_per_chip),
            resident=gib(plan.resident_bytes_per_chip), peak=gib(plan.peak_bytes),
            arguments=gib(plan.decode["argument"]), outputs=gib(plan.decode["output"]),
            aliased=gib(plan.decode["alias"]), temporaries=gib(plan.decode["temp"]),
            prefill_temporaries=gib(plan.prefill["temp"])),
        headroom_gib=gib(16 * 2**30 - plan.peak_bytes), fits=plan.fits,
        decode_flops_per_chip=plan.decode_flops_per_chip)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
