"""Attention implementations (jaxrl_llm/models/attention.py), forward + backward, one layer.

Times `self_attention` for each implementation the platform runs at a model's attention shape
and writes benchmarks/results/attention_<platform>.json. On CPU this picks `CPU_DEFAULT`
("auto" on CPU); on a GPU it compares cuDNN with XLA and the jnp path (bf16); on a TPU, splash.
Repetitions alternate between implementations (median of `--reps`) so a shared machine's
slow phases hit all of them. On a GPU a fourth row, "cudnn_causal_only", times cuDNN with the
causal mask alone (no segment-id mask, so wrong for packed rows): what the segment mask costs.

    python benchmarks/attention.py [--batch 8] [--seq 256 1024] [--dtype float32] [--reps 5]
        [--shape smollm2_135m|qwen25_05b|qwen25_15b] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxrl_llm.models.attention import resolve, self_attention

SHAPES = {"smollm2_135m": (9, 3, 64), "qwen25_05b": (14, 2, 64), "qwen25_15b": (12, 2, 128)}


def bench(impl: str, batch: int, seq: int, heads: tuple[int, int, int], dtype, reps: int):
    hq, hkv, d = heads
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (batch, seq, hq, d), dtype)
    k = jax.random.normal(ks[1], (batch, seq, hkv, d), dtype)
    v = jax.random.normal(ks[2], (batch, seq, hkv, d), dtype)
    seg = jnp.ones((batch, seq), jnp.int32)

    def loss(q, k, v):
        if impl == "cudnn_causal_only":
            out = jax.nn.dot_product_attention(q, k, v, scale=d ** -0.5, is_causal=True,
                                               implementation="cudnn")
        else:
            out = self_attention(q, k, v, seg, scale=d ** -0.5, implementation=impl)
        return jnp.sum(out.astype(jnp.float32))

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    jax.block_until_ready(step(q, k, v))

    def once() -> float:
        start = time.perf_counter()
        jax.block_until_ready(step(q, k, v))
        return time.perf_counter() - start
    return once


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--shape", choices=SHAPES, default="smollm2_135m")
    ap.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 elsewhere")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None,
                    help="default: benchmarks/results/attention_<platform>.json")
    args = ap.parse_args()
    platform = jax.default_backend()
    platform = "gpu" if platform in ("cuda", "rocm") else platform
    dtype = jnp.dtype(args.dtype or ("float32" if platform == "cpu" else "bfloat16"))
    impls = {"cpu": ["jnp", "xla"], "gpu": ["jnp", "xla", "cudnn", "cudnn_causal_only"],
             "tpu": ["jnp", "splash"]}.get(platform, ["jnp", "xla"])
    results = []
    for seq in args.seq:
        runners = {i: bench(i, args.batch, seq, SHAPES[args.shape], dtype, args.reps)
                   for i in impls}
        times = {i: [] for i in impls}
        for _ in range(args.reps):
            for i, run in runners.items():
                times[i].append(run())
        row = {"seq": seq, "median_s": {i: statistics.median(t) for i, t in times.items()},
               "times_s": times,
               "resolved": {i: resolve(i, platform=platform, dtype=dtype) for i in impls
                            if i != "cudnn_causal_only"}}
        results.append(row)
        print(json.dumps(row))
    out = {
        "device": str(jax.devices()[0].device_kind), "platform": platform,
        "shape": args.shape, "heads_kv_dim": SHAPES[args.shape], "batch": args.batch,
        "dtype": dtype.name, "pass": "forward + backward of one layer's attention",
        "load_average": os.getloadavg(), "results": results,
    }
    path = args.out or Path(__file__).parent / "results" / f"attention_{platform}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
