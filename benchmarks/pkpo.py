"""Benchmark: jitted `pkpo.sloo_minus_one` vs direct NumPy transcriptions of docs/kernels.md § PKPO estimators.

Both baselines transcribe the sorted formulas of docs/kernels.md § PKPO estimators literally, O(n²) per group: after one
sort, for every sorted index i they sum over j > i (and, for the leave-one-out
ρ(g_{−i}, k−1), over j ≠ i) with float64 binomial coefficients.
- `numpy_direct`: group by group, i by i (the formula as written; the issue's baseline).
- `numpy_vectorised`: the same sums vectorised over the groups (one mat-vec per i) — the
  fastest form of the O(n²) formula in NumPy, reported so the speed-up is not flattered.
The JAX kernel (one sort + prefix/suffix sums, O(n log n)) runs in float32 through the
public function, host-side checks included.

For each n ∈ {8, 16, 64, 256} with G = 1,024 groups and k = 8: warm-up (compile), then the
median of `--runs` (≥ 5) timed runs, alternating the implementations run by run so load from
other processes hits all alike; a run of a fast variant is a burst of 10 calls (3 at n = 256)
and reports the time per call. Also checks that all three agree.

    python benchmarks/pkpo.py [--runs 5] [--groups 1024] [--k 8] [--multithread]

Writes benchmarks/results/pkpo.json and prints a Markdown table. Targets: ≥ 100×
the NumPy version at n = 64, and JAX time growing no faster than n log n.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import scipy.special

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--multithread" not in sys.argv:
    # One XLA thread, like the NumPy baselines: on a shared machine XLA's thread pool is at
    # the mercy of other processes and its timings scatter by 5× (see --multithread).
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    ).strip()

import jax  # after XLA_FLAGS
import jax.numpy as jnp

from jaxrl_llm.losses import pkpo

SIZES = (8, 16, 64, 256)
RESULTS = Path(__file__).resolve().parent / "results" / "pkpo.json"


def numpy_sloo_minus_one(g: np.ndarray, k: int) -> np.ndarray:
    """docs/kernels.md § PKPO estimators transcribed: s_(i) − (k/n) ρ(g_{−i}, k−1) per sorted i, O(n²) per group."""
    groups, n = g.shape
    order = np.argsort(g, axis=1, kind="stable")
    x = np.take_along_axis(g, order, axis=1)
    comb = scipy.special.comb(np.arange(n + 1)[:, None], np.arange(n + 1)[None, :])  # C(a, b)
    out = np.empty_like(x)
    if k == 1:
        out = (x - (x.sum(1, keepdims=True) - x) / (n - 1)) / n
    else:
        for i in range(n):
            # s_(i) = [C(i, k−1) g_(i) + Σ_{j>i} C(j−1, k−2) g_(j)] / C(n, k)
            s_i = (comb[i, k - 1] * x[:, i] + x[:, i + 1 :] @ comb[i : n - 1, k - 2]) / comb[n, k]
            # ρ(g_{−i}, k−1) = [Σ_{j<i} C(j, k−2) g_(j) + Σ_{j>i} C(j−1, k−2) g_(j)] / C(n−1, k−1)
            rho_loo = (x[:, :i] @ comb[:i, k - 2] + x[:, i + 1 :] @ comb[i : n - 1, k - 2]) / comb[
                n - 1, k - 1
            ]
            out[:, i] = s_i - k / n * rho_loo
    result = np.empty_like(out)
    np.put_along_axis(result, order, out, axis=1)
    return result


def numpy_direct_sloo_minus_one(g: np.ndarray, k: int) -> np.ndarray:
    """docs/kernels.md § PKPO estimators transcribed group by group and index by index (k ≥ 2)."""
    groups, n = g.shape
    comb = scipy.special.comb(np.arange(n + 1)[:, None], np.arange(n + 1)[None, :])
    result = np.empty_like(g)
    for row in range(groups):
        order = np.argsort(g[row], kind="stable")
        x = g[row][order]
        out = np.empty(n)
        for i in range(n):
            s_i = (comb[i, k - 1] * x[i] + np.sum(comb[i : n - 1, k - 2] * x[i + 1 :])) / comb[n, k]
            rho_loo = (
                np.sum(comb[:i, k - 2] * x[:i]) + np.sum(comb[i : n - 1, k - 2] * x[i + 1 :])
            ) / comb[n - 1, k - 1]
            out[i] = s_i - k / n * rho_loo
        result[row, order] = out
    return result


def time_per_call(fn, calls: int = 1) -> float:
    """Seconds per call over `calls` back-to-back calls (one timed run)."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--groups", type=int, default=1024)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--multithread", action="store_true",
                        help="let XLA use its default thread pool (default: one thread)")
    args = parser.parse_args()
    if args.runs < 5:
        parser.error("--runs must be ≥ 5 (median of at least 5 runs)")

    rows = []
    rng = np.random.default_rng(0)
    for n in SIZES:
        k = min(args.k, n)
        g64 = rng.normal(size=(args.groups, n))
        g64[: args.groups // 2] = np.round(g64[: args.groups // 2])  # half the groups with ties
        g32 = jax.device_put(jnp.asarray(g64, jnp.float32))

        def run_jax(g32=g32, k=k):
            return pkpo.sloo_minus_one(g32, k).block_until_ready()

        def run_numpy(g64=g64, k=k):
            return numpy_sloo_minus_one(g64, k)

        def run_direct(g64=g64, k=k):
            return numpy_direct_sloo_minus_one(g64, k)

        got, want = np.asarray(run_jax(), np.float64), run_numpy()  # warm-up + agreement
        max_abs_err = float(np.abs(got - want).max())
        direct_err = float(np.abs(run_direct() - want).max())
        times = {"jax": [], "numpy_vectorised": [], "numpy_direct": []}
        # fast variants: each run is a burst of calls, so one scheduler hiccup on a shared
        # machine (thread wake-ups after the seconds-long direct baseline) does not dominate
        burst = 10 if n <= 64 else 3
        for _ in range(args.runs):
            times["jax"].append(time_per_call(run_jax, burst))
            times["numpy_vectorised"].append(time_per_call(run_numpy, burst))
            times["numpy_direct"].append(time_per_call(run_direct))
        med = {name: statistics.median(t) for name, t in times.items()}
        best = {name: min(t) for name, t in times.items()}
        rows.append({
            "n": n, "k": k, "groups": args.groups, "fast_calls_per_run": burst,
            "jax_median_s": med["jax"],
            "numpy_direct_median_s": med["numpy_direct"],
            "numpy_vectorised_median_s": med["numpy_vectorised"],
            "jax_min_s": best["jax"],
            "numpy_direct_min_s": best["numpy_direct"],
            "numpy_vectorised_min_s": best["numpy_vectorised"],
            "times_s": times,
            "speedup_vs_direct": med["numpy_direct"] / med["jax"],
            "speedup_vs_vectorised": med["numpy_vectorised"] / med["jax"],
            "max_abs_err_jax_f32_vs_numpy_f64": max_abs_err,
            "max_abs_err_direct_vs_vectorised": direct_err,
        })
        print(f"n={n}: jax {med['jax'] * 1e3:.2f} ms, numpy direct {med['numpy_direct'] * 1e3:.0f} "
              f"ms, numpy vectorised {med['numpy_vectorised'] * 1e3:.1f} ms", flush=True)

    for prev, cur in zip(rows, rows[1:]):
        cur["nlogn_growth_vs_prev"] = (cur["n"] * math.log(cur["n"])) / (
            prev["n"] * math.log(prev["n"])
        )
        for name in ("jax", "numpy_direct", "numpy_vectorised"):
            cur[f"{name}_growth_vs_prev"] = cur[f"{name}_median_s"] / prev[f"{name}_median_s"]
        # minima are less disturbed by other processes on a shared machine
        cur["jax_min_growth_vs_prev"] = cur["jax_min_s"] / prev["jax_min_s"]

    at64 = next(r for r in rows if r["n"] == 64)
    summary = {
        "speedup_vs_direct_at_n64": at64["speedup_vs_direct"],
        "speedup_vs_vectorised_at_n64": at64["speedup_vs_vectorised"],
        "speedup_target_at_n64": 100.0,
        "jax_growth_within_nlogn": all(
            r["jax_growth_vs_prev"] <= r["nlogn_growth_vs_prev"] for r in rows[1:]
        ),
        "jax_min_growth_within_nlogn": all(
            r["jax_min_growth_vs_prev"] <= r["nlogn_growth_vs_prev"] for r in rows[1:]
        ),
    }
    result = {
        "benchmark": "pkpo.sloo_minus_one (jit, float32) vs NumPy O(n^2) transcriptions of "
                     "docs/kernels.md § PKPO estimators (float64): group-by-group (direct) and vectorised over groups",
        "runs": args.runs,
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "load_avg_1min": os.getloadavg()[0],
                    "xla_threads": "default pool" if args.multithread else 1,
                    "jax": jax.__version__, "backend": jax.default_backend()},
        "summary": summary,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    print("\n| n | groups | JAX (ms) | NumPy direct (ms) | NumPy vectorised (ms) | speed-up vs "
          "direct | vs vectorised | JAX growth (median / min) | n log n growth | max abs err |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        growth = (f"{r['jax_growth_vs_prev']:.2f}× / {r['jax_min_growth_vs_prev']:.2f}× | "
                  f"{r['nlogn_growth_vs_prev']:.2f}×"
                  if "jax_growth_vs_prev" in r else "– | –")
        print(f"| {r['n']} | {r['groups']} | {r['jax_median_s'] * 1e3:.2f} | "
              f"{r['numpy_direct_median_s'] * 1e3:.0f} | {r['numpy_vectorised_median_s'] * 1e3:.1f} | "
              f"{r['speedup_vs_direct']:.0f}× | {r['speedup_vs_vectorised']:.1f}× | {growth} | "
              f"{r['max_abs_err_jax_f32_vs_numpy_f64']:.1e} |")
    print(f"\nat n=64: {summary['speedup_vs_direct_at_n64']:.0f}× vs direct, "
          f"{summary['speedup_vs_vectorised_at_n64']:.1f}× vs vectorised (target ≥ 100×); JAX "
          f"growth within n log n: {summary['jax_growth_within_nlogn']} (median), "
          f"{summary['jax_min_growth_within_nlogn']} (min); wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
