"""Benchmark: chunked `token_logprobs` vs the naive `log_softmax(H @ W)` gather, value+grad.

Default sizes are SmolLM2-135M's (B=8, T=1024, d=576, V=49,152), float32 on CPU. For each
variant the script compiles `value_and_grad` of `Σ g ⊙ logp` w.r.t. (hidden, unembed), reads
the compiled executable's `memory_analysis()` (argument + output + temp bytes) and times the
median of `--runs` runs after a warm-up, alternating the variants run by run so that load from
other processes hits both alike. Unless `--no-rss`, each variant also runs once in a fresh
subprocess that reports its peak resident set size.

    python benchmarks/kernels.py            # full size, default chunk size (a few minutes)
    python benchmarks/kernels.py --quick    # small sizes, seconds
    python benchmarks/kernels.py --tune --batch 2   # sweep chunk sizes (at B=2 to save time)

Writes benchmarks/results/kernels.json (kernels_quick.json / kernels_tune.json for the
variants, or `--out`) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
from machine import cpu_name  # benchmarks/, this script's directory

from jaxrl_llm.losses.logprobs import DEFAULT_CHUNK_SIZE, token_logprobs

FULL = {"B": 8, "T": 1024, "d": 576, "V": 49_152}
QUICK = {"B": 2, "T": 256, "d": 128, "V": 8_000}
TUNE_CHUNKS = (1024, 2048, 4096, 8192)
RESULTS = Path(__file__).resolve().parent / "results" / "kernels.json"


def naive_logprobs(hidden, unembed, targets):
    """The baseline: full float32 logits, log_softmax, gather."""
    logits = jnp.einsum("btd,dv->btv", hidden, unembed)
    return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets[..., None], -1)[
        ..., 0
    ]


def make_step(variant: str, chunk_size: int):
    """Jitted `(hidden, unembed, targets, cot) -> (Σ cot·logp, (dH, dW))`."""

    def loss(hidden, unembed, targets, cot):
        if variant == "naive":
            logp = naive_logprobs(hidden, unembed, targets)
        else:
            logp = token_logprobs(hidden, unembed, targets, chunk_size=chunk_size)
        return jnp.sum(cot * logp)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def make_inputs(sizes: dict[str, int], seed: int = 0):
    b, t, d, v = sizes["B"], sizes["T"], sizes["d"], sizes["V"]
    k_h, k_w, k_y, k_g = jax.random.split(jax.random.key(seed), 4)
    hidden = jax.random.normal(k_h, (b, t, d), jnp.float32)
    unembed = jax.random.normal(k_w, (d, v), jnp.float32) / jnp.sqrt(d)
    targets = jax.random.randint(k_y, (b, t), 0, v)
    cot = jax.random.uniform(k_g, (b, t), jnp.float32)
    return hidden, unembed, targets, cot


def compile_variant(variant: str, chunk_size: int, inputs):
    compiled = make_step(variant, chunk_size).lower(*inputs).compile()
    mem = compiled.memory_analysis()
    memory = {
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "temp_bytes": int(mem.temp_size_in_bytes),
    }
    memory["peak_bytes"] = sum(memory.values())
    return compiled, memory


def run_once(compiled, inputs) -> float:
    start = time.perf_counter()
    jax.block_until_ready(compiled(*inputs))
    return time.perf_counter() - start


def measured_rss(variant: str, chunk_size: int, sizes: dict[str, int]) -> int:
    """Peak RSS (bytes) of a fresh process that runs one value+grad of the variant."""
    cmd = [
        sys.executable, __file__, "--rss-child", variant, "--chunk-size", str(chunk_size),
        "--sizes", json.dumps(sizes),
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return int(out.stdout.strip().splitlines()[-1])


def rss_child(variant: str, chunk_size: int, sizes: dict[str, int]) -> None:
    inputs = make_inputs(sizes)
    compiled, _ = compile_variant(variant, chunk_size, inputs)
    run_once(compiled, inputs)
    print(peak_rss_bytes())


def peak_rss_bytes() -> int:
    """This process's own high-water RSS. `ru_maxrss` is not used on Linux: a child forked
    from a large parent inherits the parent's high-water mark across exec."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB elsewhere
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def time_variants(compiled: dict, inputs, runs: int) -> dict[str, list[float]]:
    """Warm up each, then alternate the variants run by run."""
    for fn in compiled.values():
        run_once(fn, inputs)
    times = {name: [] for name in compiled}
    for run in range(runs):
        for name, fn in compiled.items():
            times[name].append(run_once(fn, inputs))
        print(f"run {run + 1}/{runs}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()),
              flush=True)
    return times


def machine_info() -> dict:
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "platform": platform.platform(),
    }


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"small sizes {QUICK}")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per variant (≥ 5)")
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    parser.add_argument("--tune", action="store_true", help=f"also sweep chunk sizes {TUNE_CHUNKS}")
    parser.add_argument("--batch", type=int, default=None, help="override B (e.g. to tune faster)")
    parser.add_argument("--no-rss", action="store_true", help="skip the subprocess RSS runs")
    parser.add_argument("--out", type=Path, default=None, help=f"results file (default {RESULTS})")
    parser.add_argument("--rss-child", choices=("naive", "chunked"), help=argparse.SUPPRESS)
    parser.add_argument("--sizes", type=json.loads, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.rss_child:
        rss_child(args.rss_child, args.chunk_size, args.sizes)
        return 0
    if args.runs < 5:
        parser.error("--runs must be ≥ 5 (medians of fewer runs are not reported)")
    sizes = dict(QUICK if args.quick else FULL)
    if args.batch:
        sizes["B"] = args.batch
    stem = "kernels" + ("_quick" if args.quick else "") + ("_tune" if args.tune else "")
    out = args.out or RESULTS.with_name(f"{stem}.json")
    info = machine_info()
    inputs = make_inputs(sizes)
    b, t, v = sizes["B"], sizes["T"], sizes["V"]
    print(f"sizes {sizes}: naive logits are {mib(b * t * v * 4)} of float32", flush=True)

    default_chunk = min(args.chunk_size, v)
    chunks = sorted({default_chunk, *(c for c in TUNE_CHUNKS if args.tune and c <= v)})
    default_name = f"chunked_{default_chunk}"
    compiled, memory = {}, {}
    for name, chunk in [("naive", 0)] + [(f"chunked_{c}", c) for c in chunks]:
        start = time.perf_counter()
        compiled[name], memory[name] = compile_variant(
            "naive" if chunk == 0 else "chunked", chunk, inputs
        )
        print(f"compiled {name} in {time.perf_counter() - start:.1f} s", flush=True)

    times = time_variants(compiled, inputs, args.runs)
    rss = {}
    if not args.no_rss:
        for name, chunk in (("naive", 0), (default_name, default_chunk)):
            rss[name] = measured_rss("naive" if chunk == 0 else "chunked", chunk, sizes)

    naive_median = statistics.median(times["naive"])
    variants = {}
    for name in compiled:
        median = statistics.median(times[name])
        variants[name] = {
            "chunk_size": None if name == "naive" else int(name.split("_")[1]),
            "times_s": times[name],
            "median_s": median,
            "time_ratio_vs_naive": median / naive_median,
            "memory": memory[name],
            "memory_ratio_vs_naive": memory[name]["peak_bytes"] / memory["naive"]["peak_bytes"],
            "peak_rss_bytes": rss.get(name),
        }
    # Per-run ratios (naive and chunked ran back to back) are robust to load drifting.
    paired = [c / n for c, n in zip(times[default_name], times["naive"])]
    result = {
        "benchmark": "token_logprobs value+grad, chunked vs naive log_softmax gather, float32",
        "sizes": sizes,
        "naive_logits_bytes": b * t * v * 4,
        "runs": args.runs,
        "default_chunk_size": variants[default_name]["chunk_size"],
        "summary": {
            "time_ratio": variants[default_name]["time_ratio_vs_naive"],
            "paired_time_ratio_median": statistics.median(paired),
            "memory_ratio": variants[default_name]["memory_ratio_vs_naive"],
            "rss_ratio": (rss[default_name] / rss["naive"]) if rss else None,
            "targets": "memory_ratio ≤ 0.25 at time_ratio ≤ 1.4",
        },
        "variants": variants,
        "machine": {**info, "load_average_at_end": os.getloadavg()},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")

    print()
    print("| variant | chunk | median time (s) | time ÷ naive | compiled peak (arg+out+temp) "
          "| memory ÷ naive | peak RSS |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, row in variants.items():
        rss_text = mib(row["peak_rss_bytes"]) if row["peak_rss_bytes"] else "–"
        print(
            f"| {name.split('_')[0]}{' (default)' if name == default_name else ''} "
            f"| {row['chunk_size'] or '–'} | {row['median_s']:.2f} "
            f"| {row['time_ratio_vs_naive']:.2f} | {mib(row['memory']['peak_bytes'])} "
            f"| {row['memory_ratio_vs_naive']:.3f} | {rss_text} |"
        )
    print(f"\npaired per-run time ratio (median): {result['summary']['paired_time_ratio_median']:.2f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
