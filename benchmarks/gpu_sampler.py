"""The sampler on one GPU: jaxrl_llm's `ContinuousSampler` against transformers' `generate`
with a static KV cache (which transformers compiles itself on a GPU: `torch.compile` of the
decode step), bfloat16, random weights of a `gpu_train_step.SHAPES` model loaded by both.

Workloads at `--concurrency` C concurrent sequences (256 by default):

- greedy: C distinct prompts, exactly 128 new tokens (no stop);
- eos_n8: T = 1 until a stop token (≤ 256 new), C / 8 prompts × n = 8 samples;
- longtail: T = 1 until a stop token (≤ 512 new), 2·C sequences (C / 2 prompts × n = 4):
  lengths from a few tokens to 512, the RL shape; twice the concurrency, so a sampler that
  refills its slots runs the second half while the first half's stragglers finish.

With random weights the next-token distribution is close to uniform, so "until EOS" is made
by a stop set: `stop_ids` draws vocab/mean ids, and a sequence ends after emitting any of them
(lengths geometric with the workload's mean, capped at max_new). Both frameworks get the same
prompts and stop set; their draws differ, so tokens/s counts each one's own completion tokens
(stop token included) and the mean lengths are reported beside it. transformers runs a static
batch of C sequences until its longest ends (eos_n8: C; longtail: two batches of C, one after
the other); ours runs C slots. Prompts: random ids, 16 to 64 tokens (distinct per prompt).

Per workload: median of `--runs` timed calls after one warm-up call (compiles), tokens/s, the
JAX / PyTorch ratio, and each framework's peak device memory (JAX's allocator peak in use;
torch.cuda.max_memory_allocated). Each framework runs in a child process of its own.
Writes benchmarks/results/gpu_sampler_<device>.json.

    python benchmarks/gpu_sampler.py [--shapes smollm2_135m qwen25_05b] [--concurrency 256]
    python benchmarks/gpu_sampler.py --smoke    # tiny shape and sizes, any device (the check)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).parent / "results"
PAD = 0  # the pad id both frameworks get; never a stop id
# name: (sequences per concurrency, n, temperature, max_new, mean length of the stop set)
WORKLOADS = {"greedy": (1, 1, 0.0, 128, None),
             "eos_n8": (1, 8, 1.0, 256, 64),
             "longtail": (2, 4, 1.0, 512, 96)}
_MODELS: dict = {}  # a child's model, by directory


def stop_ids(vocab: int, mean: int | None) -> tuple[int, ...]:
    """vocab / mean distinct ids (never PAD): under a near-uniform next-token distribution a
    sequence then ends at each step with probability ≈ 1 / mean."""
    if mean is None:
        return ()
    ids = np.random.default_rng(1).choice(np.arange(1, vocab), size=vocab // mean, replace=False)
    return tuple(int(i) for i in np.sort(ids))


def prompts_for(name: str, conc: int, vocab: int) -> list[list[int]]:
    per_conc, n, *_ = WORKLOADS[name]
    count = per_conc * conc // n
    rng = np.random.default_rng(2)
    return [rng.integers(1, vocab, int(rng.integers(16, 65))).tolist() for _ in range(count)]


def save_random_model(shape_name: str, directory: str) -> None:
    from gpu_train_step import SHAPES, hf_model  # benchmarks/, this script's directory

    hf_model(SHAPES[shape_name], 2048, pad_token_id=PAD).save_pretrained(
        directory, safe_serialization=True)


def jax_runner(model_dir: str, name: str, conc: int, vocab: int, args):
    import jax

    from jaxrl_llm.sampling.continuous import ContinuousSampler
    from jaxrl_llm.sampling.sampler import SamplingParams
    from jaxrl_llm.weights.hf import load_pretrained

    if model_dir not in _MODELS:  # loaded once per child, for every workload
        _MODELS[model_dir] = load_pretrained(model_dir, dtype="bfloat16",
                                             compute_dtype="bfloat16")
    model = _MODELS[model_dir]
    _, n, temp, new, mean = WORKLOADS[name]
    shapes = {k: v for k, v in (("cache_windows", args.cache_windows),
                                ("min_rows", args.min_rows)) if v is not None}
    sampler = ContinuousSampler(model, slots=conc, pad_token_id=PAD,
                                prefill_chunk=args.prefill_chunk, **shapes)
    params = SamplingParams(max_new_tokens=new, temperature=temp, n=n,
                            stop_token_ids=stop_ids(vocab, mean))
    prompts = prompts_for(name, conc, vocab)

    def run() -> np.ndarray:
        # The same key every call: the same lengths, so the timed calls run the programs
        # the warm-up compiled (segment widths and row counts follow the lengths).
        out = sampler.generate(prompts, params, jax.random.key(0))
        return np.asarray(out.lengths).reshape(-1)  # host copy: the device work has ended

    def peak() -> float:
        stats = jax.devices()[0].memory_stats() or {}
        return stats.get("peak_bytes_in_use", 0) / 2**30
    return run, peak, jax.devices()[0].device_kind


def torch_runner(model_dir: str, name: str, conc: int, vocab: int, args):
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if model_dir not in _MODELS:
        _MODELS[model_dir] = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.bfloat16).to(device).eval()
    model = _MODELS[model_dir]
    _, n, temp, new, mean = WORKLOADS[name]
    stops = list(stop_ids(vocab, mean))
    prompts = prompts_for(name, conc, vocab)
    per_batch = conc // n  # prompts per static batch of `conc` sequences
    batches = []
    for start in range(0, len(prompts), per_batch):
        chunk = prompts[start:start + per_batch]
        width = max(map(len, chunk))  # left-padded, as generate expects for decoder-only models
        ids = torch.tensor([[PAD] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk],
                            device=device)
        batches.append((ids, mask, width))
    sampling = (dict(do_sample=False) if temp == 0 else
                dict(do_sample=True, temperature=temp, top_k=0, top_p=1.0))
    if not stops:
        sampling["min_new_tokens"] = new

    def run() -> np.ndarray:
        torch.manual_seed(0)
        lengths = []
        for ids, mask, width in batches:
            with torch.no_grad():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=new,
                                     num_return_sequences=n, pad_token_id=PAD,
                                     eos_token_id=stops or None,
                                     cache_implementation="static", **sampling)
            completion = out[:, width:].cpu().numpy()  # waits for the GPU
            ended = np.isin(completion, stops) if stops else np.zeros_like(completion, bool)
            lengths.append(np.where(ended.any(1), ended.argmax(1) + 1, new))
        return np.concatenate(lengths)

    def peak() -> float:
        return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
    name_ = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return run, peak, name_


def child(framework: str, shape_name: str, model_dir: str, args) -> dict:
    from gpu_train_step import SHAPES  # benchmarks/, this script's directory

    vocab = SHAPES[shape_name]["vocab_size"]
    rows = {}
    device = "unknown"
    for name in args.workloads:
        make = jax_runner if framework == "jax" else torch_runner
        run, peak, device = make(model_dir, name, args.concurrency, vocab, args)
        start = time.perf_counter()
        run()  # warm-up: compiles (JAX; transformers' static-cache torch.compile)
        warm = time.perf_counter() - start
        print(f"{framework} {shape_name} {name}: first call {warm:.1f} s", file=sys.stderr,
              flush=True)
        times, lengths = [], None
        for _ in range(args.runs):
            start = time.perf_counter()
            lengths = run()
            times.append(time.perf_counter() - start)
        tokens = int(lengths.sum())
        rows[name] = dict(times_s=times, median_s=statistics.median(times), tokens=tokens,
                          tokens_per_s=tokens / statistics.median(times),
                          sequences=int(lengths.size), mean_length=float(lengths.mean()),
                          max_length=int(lengths.max()), first_call_s=warm,
                          peak_memory_gib=peak())
        print(f"{framework} {shape_name} {name}: {tokens} tokens in "
              f"{statistics.median(times):.2f} s", file=sys.stderr, flush=True)
    return {"device": device, "rows": rows}


def main() -> None:
    from gpu_train_step import versions  # benchmarks/, this script's directory

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["smollm2_135m", "qwen25_05b"])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--prefill-chunk", type=int, default=128)
    # Fewer compiled shapes for a short GPU loan: each cache window and tail row count is its
    # own full-model decode program (59 compiles, 6 of them decode programs, at 256 slots on
    # the long tail); on a GPU a wider window or more rows per step cost little.
    ap.add_argument("--cache-windows", type=int, default=None,
                    help="ContinuousSampler cache_windows (default: its own)")
    ap.add_argument("--min-rows", type=int, default=None,
                    help="ContinuousSampler min_rows (default: its own; = --concurrency: "
                         "the tail never shrinks)")
    ap.add_argument("--frameworks", nargs="+", default=["jax", "torch"])
    ap.add_argument("--timeout", type=float, default=None, help="seconds per child")
    ap.add_argument("--smoke", action="store_true", help="tiny shape and sizes, any device")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args)))
        return
    if args.smoke:
        args.shapes, args.concurrency, args.runs = ["tiny"], 16, 1
    results: dict = {"concurrency": args.concurrency, "versions": versions(), "shapes": {},
                     "sampler_options": {"prefill_chunk": args.prefill_chunk,
                                         "cache_windows": args.cache_windows,
                                         "min_rows": args.min_rows}}
    device = "unknown"
    for shape_name in args.shapes:
        with tempfile.TemporaryDirectory() as model_dir:
            save_random_model(shape_name, model_dir)
            per = {}
            for fw in args.frameworks:
                cmd = [sys.executable, __file__, "--child", fw, shape_name, model_dir,
                       "--workloads", *args.workloads, "--concurrency", str(args.concurrency),
                       "--runs", str(args.runs), "--prefill-chunk", str(args.prefill_chunk)]
                # The child's stderr goes to ours as it runs (its progress is in the log
                # even when --timeout stops it).
                try:
                    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True,
                                         timeout=args.timeout)
                except subprocess.TimeoutExpired:
                    per[fw] = {"error": [f"over --timeout {args.timeout} s"]}
                    continue
                if out.returncode:
                    per[fw] = {"error": [f"exit status {out.returncode} (its stderr is above)"]}
                    continue
                per[fw] = json.loads(out.stdout.strip().splitlines()[-1])
                device = per[fw]["device"] if per[fw]["device"] != "unknown" else device
            for name in args.workloads:
                j, t = (per.get(fw, {}).get("rows", {}).get(name, {}) for fw in ("jax", "torch"))
                if "tokens_per_s" in j and "tokens_per_s" in t:
                    per.setdefault("ratio", {})[name] = j["tokens_per_s"] / t["tokens_per_s"]
            results["shapes"][shape_name] = per
            print(json.dumps({shape_name: per}), flush=True)
    results["device"] = device
    out = Path(args.out or RESULTS / f"gpu_sampler_{device.replace(' ', '_')}.json")
    if not args.smoke or args.out:
        out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {out}")
    for shape_name, per in results["shapes"].items():  # the short table, last
        for name in args.workloads:
            j, t = (per.get(fw, {}).get("rows", {}).get(name, {}) for fw in ("jax", "torch"))
            print(f"{shape_name:14s} {name:9s} jax {j.get('tokens_per_s', 0):10.0f} tok/s "
                  f"torch {t.get('tokens_per_s', 0):10.0f} tok/s "
                  f"ratio {per.get('ratio', {}).get(name, float('nan')):.2f}")


if __name__ == "__main__":
    main()
