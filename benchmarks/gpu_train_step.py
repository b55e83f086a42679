"""Train-step throughput on one GPU: jaxrl_llm (bf16 compute, fp32 master weights, cuDNN
attention) vs transformers' PyTorch model (bf16, `sdpa` attention) on the same GPU.

Shapes: SmolLM2-135M, Qwen2.5-0.5B and Qwen2.5-1.5B (random weights), batches 8×1024 and
8×4096, TOPR loss (TOPR arXiv:2503.14286 eq. 11, taper form) with AdamW and global-norm
clipping. Reported per case: median step time over `--steps` timed steps after a warm-up,
tokens/s, the JAX / PyTorch ratio, and MFU = (6·N·tokens + causal attention FLOPs) / step time
/ the chip's dense bf16 peak (`PEAKS`, by device name), and `mfu_primerl_formula` with prime-rl's
6·N + 12·L·H·d·T FLOPs per token (attention counted over all T keys). Each framework runs in its own child
process (memory). Writes benchmarks/results/gpu_train_step_<device>.json.

    python benchmarks/gpu_train_step.py [--shapes smollm2_135m qwen25_05b qwen25_15b qwen3_06b]
        [--batches 8x1024 8x4096] [--steps 5] [--remat none|full|dots] [--no-scan-layers]

`--smoke` runs a tiny shape on whatever device is present (CPU included) to check the script.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SHAPES = {
    "smollm2_135m": dict(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_embeddings=True),
    "qwen25_05b": dict(family="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                       num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_embeddings=True),
    "qwen25_15b": dict(family="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                       num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_embeddings=True),
    # prime-rl's trainer benchmark model (Qwen3-0.6B: q/k RMSNorm, no q/k/v bias).
    "qwen3_06b": dict(family="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                      num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                      rope_theta=1000000.0, rms_norm_eps=1e-6, tie_embeddings=True),
    "tiny": dict(family="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
                 rms_norm_eps=1e-5, tie_embeddings=True),
}
# Dense bf16 peak FLOP/s by device-name substring (NVIDIA datasheets, SXM parts).
PEAKS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12}


def numpy_batch(b: int, t: int, vocab: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (b, t + 1)).astype(np.int32)
    mask = np.zeros((b, t), np.float32)
    mask[:, t // 8:] = 1.0  # the first eighth is the prompt
    mu = np.where(mask > 0, -10.0 + 0.1 * rng.normal(size=(b, t)), 0.0).astype(np.float32)
    rewards = np.where(np.arange(b) % 3 == 0, -1.0, 1.0).astype(np.float32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask, "mu": mu,
            "rewards": rewards}


def attention_flops(shape: dict, b: int, t: int) -> float:
    """Causal QKᵀ and PV, forward + backward: 3 · 2 matmuls · 2·Hq·D·(t/2) per token."""
    return 3 * 4 * shape["num_layers"] * shape["num_heads"] * shape["head_dim"] * (t / 2) * b * t


def primerl_flops_per_token(shape: dict, n_params: int, t: int) -> float:
    """The FLOPs per token prime-rl's trainer benchmark divides by: 6·N + 12·L·H·d·T
    (every query attending to all T keys, forward + backward)."""
    return 6 * n_params + 12 * shape["num_layers"] * shape["num_heads"] * shape["head_dim"] * t


def run_jax(shape: dict, b: int, t: int, args) -> tuple[int, callable]:
    import jax

    from jaxrl_llm.config import config_from_dict
    from jaxrl_llm.data.batch import Batch
    from jaxrl_llm.models.attention import resolve
    from jaxrl_llm.parallel.mesh import make_mesh
    from jaxrl_llm.train.state import count_params, create_train_state
    from jaxrl_llm.train.step import make_train_step

    config = config_from_dict({
        "model": {**shape, "max_position_embeddings": max(t, 2048), "scan_layers": args.scan_layers,
                  "remat": args.remat, "param_dtype": "auto", "compute_dtype": args.compute_dtype,
                  "attention": "auto"},
        "loss": {"name": "topr", "logprob_chunk_size": 16384},
        "optim": {"name": "adamw", "learning_rate": 1e-6, "clip_norm": 1.0},
        "mesh": {"data": 1, "fsdp": 1, "tensor": 1},
        "train": {"batch_size": b, "max_seq_len": t,
                  "micro_batch_size": b // args.micro_batches},
    })
    mesh = make_mesh(config.mesh, jax.devices()[:1])
    state = create_train_state(config, mesh)
    nb = numpy_batch(b, t, shape["vocab_size"])
    batch = jax.device_put(Batch(
        inputs=nb["inputs"], targets=nb["targets"],
        positions=np.tile(np.arange(t, dtype=np.int32), (b, 1)),
        segment_ids=np.ones((b, t), np.int32), loss_mask=nb["mask"],
        behavior_logprobs=nb["mu"], mu_logprobs=nb["mu"],
        ref_logprobs=np.zeros((b, t), np.float32), rewards=nb["rewards"],
        correct=nb["rewards"] > 0, group_ids=np.arange(b, dtype=np.int32),
        record_mask=np.ones(b, np.float32), pair_index=np.zeros((0, 2), np.int32),
    ), jax.devices()[0])
    step = make_train_step(config, mesh, state)
    holder = {"state": state}
    print("attention:", resolve("auto", dtype="bfloat16"), file=sys.stderr)

    def one() -> float:
        holder["state"], metrics = step(holder["state"], batch)
        return float(jax.block_until_ready(metrics)["loss"])
    return count_params(state.params), one


def hf_model(shape: dict, max_positions: int, **config: object):
    """transformers' model of a `SHAPES` entry, random weights (seed 0), sdpa attention."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    cls, cfg_cls = {"qwen2": (Qwen2ForCausalLM, Qwen2Config),
                    "qwen3": (Qwen3ForCausalLM, Qwen3Config)}.get(
                        shape["family"], (LlamaForCausalLM, LlamaConfig))
    cfg = cfg_cls(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                  intermediate_size=shape["intermediate_size"],
                  num_hidden_layers=shape["num_layers"], num_attention_heads=shape["num_heads"],
                  num_key_value_heads=shape["num_kv_heads"], head_dim=shape["head_dim"],
                  rope_theta=shape["rope_theta"], rms_norm_eps=shape["rms_norm_eps"],
                  tie_word_embeddings=shape["tie_embeddings"],
                  max_position_embeddings=max_positions, attn_implementation="sdpa", **config)
    torch.manual_seed(0)
    return cls(cfg)


def run_torch(shape: dict, b: int, t: int, args) -> tuple[int, callable]:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):  # initialised where it runs (a 1.5B model's CPU init is slow)
        model = hf_model(shape, max(t, 2048)).to(dtype=torch.bfloat16).train()
    if args.remat == "full":
        model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    nb = {k: torch.from_numpy(v).to(device) for k, v in
          numpy_batch(b, t, shape["vocab_size"]).items()}

    def one() -> float:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        # `--micro-batches m`: m backward passes of b/m rows each (the full-vocabulary
        # logits of 8×4096 tokens do not fit otherwise); the same loss, the mean over rows.
        for rows in torch.arange(b, device=device).chunk(args.micro_batches):
            logits = model(input_ids=nb["inputs"][rows].long()).logits
            logp = torch.log_softmax(logits.float(), -1).gather(
                -1, nb["targets"][rows].long()[..., None])[..., 0]
            mask, rewards = nb["mask"][rows], nb["rewards"][rows]
            ell = (logp * mask).sum(-1) - (nb["mu"][rows] * mask).sum(-1)
            r = torch.exp(ell)
            rho = torch.where(rewards >= 0, 1 + ell, torch.where(r > 1, 1 + ell, r))
            loss = (-rewards * rho / mask.sum(-1)).sum() / b
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        return total
    return sum(p.numel() for p in model.parameters()), one


def child(framework: str, shape_name: str, b: int, t: int, args) -> dict:
    setup = run_jax if framework == "jax" else run_torch
    n_params, one = setup(SHAPES[shape_name], b, t, args)
    one()  # compile / warm up
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        one()
        times.append(time.perf_counter() - start)
    if framework == "jax":
        import jax
        device = jax.devices()[0].device_kind
        peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0)
    else:
        import torch
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    return {"framework": framework, "params": n_params, "median_s": statistics.median(times),
            "times_s": times, "device": device, "peak_memory_gib": peak / 2**30}


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("jax", "jaxlib", "flax", "optax", "torch", "transformers"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["smollm2_135m", "qwen25_05b", "qwen25_15b"])
    ap.add_argument("--batches", nargs="+", default=["8x1024", "8x4096"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--remat", default="dots", choices=("none", "full", "dots"))
    ap.add_argument("--scan-layers", default=True, action=argparse.BooleanOptionalAction,
                    help="JAX model.scan_layers (--no-scan-layers: layers unrolled in the "
                         "program, compiled longer, scheduled across layers)")
    ap.add_argument("--micro-batches", type=int, default=1,
                    help="split each batch into this many backward passes, gradients "
                         "accumulated (each framework retried with 2, 4, 8 after running "
                         "out of memory)")
    ap.add_argument("--compute-dtype", default="auto",
                    help="JAX model.compute_dtype (auto: bfloat16 on a GPU)")
    ap.add_argument("--frameworks", nargs="+", default=["jax", "torch"])
    ap.add_argument("--smoke", action="store_true", help="tiny shape, 2×128, any device")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.child:
        fw, name, b, t = args.child
        print(json.dumps(child(fw, name, int(b), int(t), args)))
        return
    if args.smoke:
        args.shapes, args.batches, args.steps = ["tiny"], ["2x128"], 1
    rows = []
    for name in args.shapes:
        for bt in args.batches:
            b, t = map(int, bt.split("x"))
            row = {"shape": name, "batch": [b, t]}
            for fw in args.frameworks:
                micro = args.micro_batches
                while True:
                    cmd = [sys.executable, __file__, "--child", fw, name, str(b), str(t),
                           "--steps", str(args.steps), "--remat", args.remat,
                           "--compute-dtype", args.compute_dtype,
                           "--micro-batches", str(micro),
                           "--scan-layers" if args.scan_layers else "--no-scan-layers"]
                    out = subprocess.run(cmd, capture_output=True, text=True)
                    oom = any(m in out.stderr for m in ("OutOfMemoryError", "RESOURCE_EXHAUSTED"))
                    if not (out.returncode and oom and micro < min(b, 8)):
                        break
                    micro *= 2
                if out.returncode:
                    # The exception's message, not JAX's traceback-filtering footer.
                    lines = [ln for ln in out.stderr.strip().splitlines()
                             if ln and not ln.startswith(("  ", "---", "For simplicity"))]
                    row[fw] = {"error": lines[-3:]}
                    continue
                res = json.loads(out.stdout.strip().splitlines()[-1])
                res["micro_batches"] = micro
                tokens = b * t
                flops = 6 * res["params"] * tokens + attention_flops(SHAPES[name], b, t)
                peak = next((p for k, p in PEAKS.items() if k in res["device"]), None)
                res["tokens_per_s"] = tokens / res["median_s"]
                res["mfu"] = None if peak is None else flops / res["median_s"] / peak
                pr_flops = primerl_flops_per_token(SHAPES[name], res["params"], t) * tokens
                res["mfu_primerl_formula"] = (None if peak is None
                                              else pr_flops / res["median_s"] / peak)
                row[fw] = res
            if "tokens_per_s" in row.get("jax", {}) and "tokens_per_s" in row.get("torch", {}):
                row["jax_over_torch"] = row["jax"]["tokens_per_s"] / row["torch"]["tokens_per_s"]
            rows.append(row)
            print(json.dumps(row))
    device = next((r[fw]["device"] for r in rows for fw in args.frameworks
                   if "device" in r.get(fw, {})), "unknown")
    out = Path(args.out or Path(__file__).parent / "results" /
               f"gpu_train_step_{device.replace(' ', '_')}.json")
    if not args.smoke:
        out.write_text(json.dumps({"device": device, "remat": args.remat,
                                   "scan_layers": args.scan_layers,
                                   "versions": versions(), "rows": rows},
                                  indent=2) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
