"""Expert-parallel token dispatch (jaxrl_llm/models/moe_dispatch.py): all-gather + reduce-scatter
against the static-shape dropless all-to-all, one MoE layer forward + backward.

For each expert-axis size ep (the other devices data-parallel) and each dispatch, the layer
(router, top-k, grouped-matmul experts) runs jitted on a mesh of 8 devices: fake CPU devices
by default (wall time, median of `--reps`, alternating dispatches so a shared machine's slow
phases hit both), or with `--tpu` compiled for a v5e:2x4 by the real TPU compiler (libtpu; no
timing). Each row also has the compiled step's per-device temporaries (`memory_analysis()`)
and the bytes its collectives produce per device, summed over the compiled HLO's all-gather /
all-to-all / reduce-scatter / all-reduce ops (each counted once, as written).

    python benchmarks/moe_dispatch.py [--ep 2 4 8] [--tokens 512] [--d 256] [--f 256]
        [--experts 16] [--k 2] [--reps 5] [--tpu] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
from pathlib import Path

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm.models.attention import attention_mesh
from jaxrl_llm.models.config import DecoderConfig
from jaxrl_llm.models.moe import moe_forward
from jaxrl_llm.parallel.mesh import AxisSizes, make_mesh

COLLECTIVES = ("all-gather", "all-to-all", "reduce-scatter", "all-reduce")
_BYTES = {"f32": 4, "bf16": 2, "s32": 4, "u32": 4, "f16": 2, "s8": 1, "pred": 1}


def collective_bytes(hlo: str) -> dict[str, int]:
    """Bytes each kind of collective produces per device: the result shapes of every
    `kind(` / `kind-start(` op of the compiled module, summed."""
    out = dict.fromkeys(COLLECTIVES, 0)
    for line in hlo.splitlines():
        for kind in COLLECTIVES:
            match = re.search(rf"= (.*?) {kind}(-start)?\(", line)
            if match:
                for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", match.group(1)):
                    size = int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
                    out[kind] += size * _BYTES.get(dtype, 4)
    return out


def layer(config: DecoderConfig, devices: list, ep: int, tokens: int, abstract: bool):
    """(jitted loss-and-grad, args) of one MoE layer on a data × expert mesh; `abstract`:
    the args as ShapeDtypeStructs (a compile-only TPU client cannot hold arrays)."""
    mesh = make_mesh(AxisSizes(data=len(devices) // ep, expert=ep), devices)
    e, d, f = config.num_experts, config.hidden_size, config.moe_intermediate_size
    rows = len(devices)  # one row of `tokens` tokens per device
    shapes = {"router": (d, e), "gate": (e, d, f), "up": (e, d, f), "down": (e, f, d),
              "x": (rows, tokens, d)}
    batch_axes = ("data", "fsdp", "expert") if ep > 1 else ("data", "fsdp")
    specs = {"router": P(), "gate": P("expert"), "up": P("expert"), "down": P("expert"),
             "x": P(batch_axes)}
    keys = dict(zip(shapes, jax.random.split(jax.random.key(0), len(shapes))))
    arrays = {}
    for name, shape in shapes.items():
        sharding = NamedSharding(mesh, specs[name])
        if abstract:
            arrays[name] = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)
        else:
            value = jax.random.normal(keys[name], shape) * shape[-2] ** -0.5
            arrays[name] = jax.device_put(value, sharding)
    x = arrays.pop("x")
    params = arrays
    mask = jnp.ones((rows, tokens), jnp.float32)

    def loss(p, x):
        with attention_mesh(mesh):
            y, _ = moe_forward(p, x, config, mask)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), (params, x)


def run(args: argparse.Namespace) -> dict:
    if args.tpu:
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-8")
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        from jax.experimental import topologies

        devices = list(topologies.get_topology_desc(platform="tpu",
                                                    topology_name="v5e:2x4").devices)
        dtype = "bfloat16"
    else:
        devices = jax.devices("cpu")[:8]
        dtype = "float32"
    rows = []
    for ep in args.ep:
        fns = {}
        for dispatch in ("all_gather", "all_to_all"):
            config = DecoderConfig(family="qwen3_moe", hidden_size=args.d, num_heads=4,
                                   num_kv_heads=4, num_experts=args.experts,
                                   num_experts_per_tok=args.k, moe_intermediate_size=args.f,
                                   moe_dispatch=dispatch, compute_dtype=dtype)
            fn, call_args = layer(config, devices, ep, args.tokens, abstract=args.tpu)
            compiled = fn.lower(*call_args).compile()
            mem = compiled.memory_analysis()
            fns[dispatch] = (compiled, call_args)
            rows.append({"ep": ep, "dispatch": dispatch,
                         "temp_bytes": int(mem.temp_size_in_bytes),
                         "collective_bytes": collective_bytes(compiled.as_text()),
                         "times_s": []})
        if args.tpu:
            continue
        for dispatch in ("all_gather", "all_to_all"):  # warm-up
            compiled, call_args = fns[dispatch]
            jax.block_until_ready(compiled(*call_args))
        for _ in range(args.reps):
            for dispatch in ("all_gather", "all_to_all"):
                compiled, call_args = fns[dispatch]
                start = time.perf_counter()
                jax.block_until_ready(compiled(*call_args))
                row = next(r for r in rows if r["ep"] == ep and r["dispatch"] == dispatch)
                row["times_s"].append(time.perf_counter() - start)
    for row in rows:
        row["median_s"] = statistics.median(row["times_s"]) if row["times_s"] else None
        row["collective_total"] = sum(row["collective_bytes"].values())
    return {"platform": "tpu v5e:2x4 (compiled only)" if args.tpu else "cpu x8 (fake devices)",
            "load_average": os.getloadavg(), "dtype": dtype, "shape": {"tokens_per_device": args.tokens, "d": args.d,
                                      "f": args.f, "experts": args.experts, "k": args.k},
            "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--f", type=int, default=256)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tpu", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result = run(args)
    out = args.out or Path(__file__).parent / "results" / (
        f"moe_dispatch_{'tpu' if args.tpu else 'cpu'}.json")
    out.write_text(json.dumps(result, indent=2))
    for row in result["rows"]:
        median = "" if row["median_s"] is None else f"{row['median_s'] * 1e3:8.1f} ms"
        print(f"ep={row['ep']} {row['dispatch']:10s} {median} temp "
              f"{row['temp_bytes'] / 2**20:7.1f} MiB collectives "
              f"{row['collective_total'] / 2**20:7.1f} MiB")


if __name__ == "__main__":
    main()
