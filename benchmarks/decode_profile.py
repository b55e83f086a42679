"""Where a decode step of our JAX sampler spends its time, from a JAX profiler trace.

SmolLM2-135M-Instruct (the packaged GGUF, exported to an HF directory and loaded as in
`benchmarks/vllm_generate.py`), batch 32, float32, the same two rows as that benchmark
(greedy 128 tokens; T = 1 until EOS). One warm-up call, one timed call, one traced call. The
trace's XLA:CPU ops are summed by kind (`ynn_fusion.17` → `ynn_fusion`: XLA's YNNPACK dot
fusions, every matmul of the step); the weight products of one decoder layer and the output
projection are then timed alone (`jax.jit` of the same products, chained over 30 weight
copies) to compare their GFLOP/s in isolation with their share of the step. Writes
benchmarks/results/decode_profile.json and .md.

    python benchmarks/decode_profile.py
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
from machine import cpu_name  # benchmarks/, this script's directory
from vllm_generate import cases, export_smollm2

RESULTS = Path(__file__).parent / "results"
# SmolLM2-135M's per-layer weight products (in, out) and the tied output projection.
LAYER_PRODUCTS = {"q and o": [(576, 576)] * 2, "k and v": [(576, 192)] * 2,
                  "gate and up": [(576, 3072)], "down": [(1536, 576)]}
OUTPUT_PRODUCT = (576, 49152)


def op_totals(trace_dir: str) -> dict[str, float]:
    """Milliseconds per op kind in the newest trace under `trace_dir`."""
    path = sorted(glob.glob(f"{trace_dir}/plugins/profile/*/*.trace.json.gz"))[-1]
    totals: collections.Counter = collections.Counter()
    for e in json.load(gzip.open(path))["traceEvents"]:
        name = e.get("name", "")
        # "$..." are Python frames, the rest of the skipped names the runtime's own waits
        if e.get("ph") != "X" or name.startswith("$") or "Thunk" in name or "Await" in name \
                or name.startswith(("end:", "PjitFunction", "CommonPjRt", "ParseArguments")):
            continue
        totals[re.sub(r"\.\d+$", "", name)] += e["dur"] / 1e3
    return dict(totals.most_common())


def isolated_rate(shapes: list[tuple[int, int]], rows: int, copies: int, repeats: int = 15) -> float:
    """GFLOP/s of `rows`-row products with these weight shapes, alone in one jitted program."""
    key = jax.random.key(0)
    ws = [[jax.random.normal(jax.random.fold_in(key, 100 * c + i), s) for i, s in enumerate(shapes)]
          for c in range(copies)]
    xs = [jax.random.normal(key, (rows, s[0])) for s in shapes]
    fn = jax.jit(lambda xs, ws: sum((x @ w)[0, 0] for layer in ws for x, w in zip(xs, layer)))
    fn(xs, ws).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(xs, ws).block_until_ready()
        times.append(time.perf_counter() - start)
    flops = 2 * rows * copies * sum(a * b for a, b in shapes)
    return flops / float(np.median(times)) / 1e9


def main() -> int:
    from transformers import AutoTokenizer

    from jaxrl_llm.sampling.sampler import Sampler, SamplingParams
    from jaxrl_llm.weights.hf import load_pretrained

    class Args:  # the rows of benchmarks/vllm_generate.py
        batch, new_tokens, eos = 32, 128, True

    out: dict = {"cpu": cpu_name(), "cores": os.cpu_count(), "dtype": "float32", "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = export_smollm2(Path(tmp) / "smollm2", "float32")
        tok = AutoTokenizer.from_pretrained(model_dir)
        model = load_pretrained(str(model_dir), dtype="float32", compute_dtype="float32")
        eos = tok.eos_token_id
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos
        for row in cases(tok, Args):
            sampler = Sampler(model, pad_token_id=pad, batch_size=len(row["prompts"]))
            params = SamplingParams(max_new_tokens=row["max_new_tokens"],
                                    temperature=row["temperature"],
                                    stop_token_ids=(eos,) if row["stop_at_eos"] else ())

            def run(sampler=sampler, prompts=row["prompts"], params=params):
                lengths = sampler.generate(prompts, params, jax.random.key(0)).lengths
                return int(np.asarray(lengths).sum())

            run()  # compiles
            start = time.perf_counter()
            tokens = run()
            seconds = time.perf_counter() - start
            trace = Path(tmp) / f"trace_{row['decoding']}"
            jax.profiler.start_trace(str(trace))
            run()
            jax.profiler.stop_trace()
            ops = op_totals(str(trace))
            total = sum(ops.values())
            out["rows"].append(dict(decoding=row["decoding"], tokens=tokens, seconds=seconds,
                                    tokens_per_s=tokens / seconds, op_ms=ops,
                                    dot_share=ops.get("ynn_fusion", 0.0) / total))
            print(f"{row['decoding']}: {tokens / seconds:.1f} tokens/s; dot fusions "
                  f"{100 * out['rows'][-1]['dot_share']:.1f} % of {total:.0f} ms of ops")
    out["isolated_gflops"] = {name: isolated_rate(shapes, 32, 30)
                              for name, shapes in LAYER_PRODUCTS.items()}
    out["isolated_gflops"]["output projection"] = isolated_rate([OUTPUT_PRODUCT], 32, 1)
    layer_flops = 2 * 32 * sum(a * b for s in LAYER_PRODUCTS.values() for a, b in s)
    out["layer_weight_products_ms_isolated"] = sum(
        2 * 32 * sum(a * b for a, b in s) / (out["isolated_gflops"][n] * 1e9) * 1e3
        for n, s in LAYER_PRODUCTS.items())
    out["layer_weight_gflop"] = layer_flops / 1e9
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "decode_profile.json").write_text(json.dumps(out, indent=2) + "\n")
    lines = [f"{out['cpu']}, {out['cores']} cores, float32, SmolLM2-135M, batch 32", "",
             "| decoding | tokens/s | ms of ops | XLA dot fusions (ynn_fusion) | next largest op kind |",
             "| --- | ---: | ---: | ---: | --- |"]
    for r in out["rows"]:
        ops = r["op_ms"]
        other = next((k for k in ops if k != "ynn_fusion"), "—")
        lines.append(f"| {r['decoding']} | {r['tokens_per_s']:.1f} | {sum(ops.values()):.0f} | "
                     f"{100 * r['dot_share']:.1f} % | {other} {ops.get(other, 0):.0f} ms |")
    lines += ["", "| weight product (32 rows, alone) | GFLOP/s |", "| --- | ---: |"]
    lines += [f"| {n} | {v:.0f} |" for n, v in out["isolated_gflops"].items()]
    lines += ["", f"One layer's weight products ({out['layer_weight_gflop']:.3f} GFLOP) alone: "
                  f"{out['layer_weight_products_ms_isolated']:.2f} ms."]
    (RESULTS / "decode_profile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
