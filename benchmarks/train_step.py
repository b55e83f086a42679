"""Train-step throughput: jaxrl_llm's jitted TOPR step vs the same step in PyTorch.

SmolLM2-135M shape (30 layers, d 576, ffn 1536, 9 heads / 3 KV, V 49,152, tied), batch
8×256, fp32, TOPR loss (TOPR arXiv:2503.14286 eq. 11, sequence ratio) with AdamW, on this machine's CPU:

- JAX: `make_train_step` (chunked log-probs, docs/kernels.md § Token log-probs) on a 1-device mesh.
- PyTorch: transformers' `LlamaForCausalLM` with the same config, full logits, the same
  TOPR loss (taper form, docs/kernels.md § TOPR family), `torch.optim.AdamW`, `torch.set_num_threads(2)`.
- Peak: this run's jitted fp32 2048×2048 matmul FLOP/s.
- Bound: the step's matmul FLOPs at XLA's own rate on the step's shapes, alone and plus one
  optimizer pass timed alone, every other op free: the MFU this machine allows the step.
- Dots: each framework's own fp32 matmul FLOP/s on the step's shapes (`MATMUL_SHAPES`,
  measured in its child process), which separates the BLAS each framework calls from the
  model code around it.

Each framework runs in its own child process, one after the other (memory), timing `--steps`
steps after one warm-up step; with `--rounds R` the two alternate R times (JAX, PyTorch, JAX,
…) so that slow phases of a shared machine hit both. Reported: the median over all timed
steps, tokens/s, the JAX / PyTorch ratio, and MFU = 6·N·tokens / step time / matmul peak (the
larger of the peaks measured before and after). Each figure carries the load average.

    python benchmarks/train_step.py [--steps 3] [--rounds 1] [--scan-layers] [--remat none|full|dots]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np

B, T = 8, 256
SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
             num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
             rms_norm_eps=1e-5, tie_embeddings=True, max_position_embeddings=2048)
PROMPT = 64
# (m, k, n) of the step's matmuls at B·T = 2048 rows: q/o, MLP up/gate, MLP down, an LM-head
# vocabulary chunk, and the LM head's weight gradient.
MATMUL_SHAPES = ((2048, 576, 576), (2048, 576, 1536), (2048, 1536, 576), (2048, 576, 4096),
                 (576, 2048, 4096))


def make_numpy_batch(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, SHAPE["vocab_size"], (B, T + 1)).astype(np.int32)
    mask = np.zeros((B, T), np.float32)
    mask[:, PROMPT - 1 :] = 1.0
    mu = np.where(mask > 0, -10.8 + 0.1 * rng.normal(size=(B, T)), 0.0).astype(np.float32)
    rewards = np.where(np.arange(B) % 3 == 0, -1.0, 1.0).astype(np.float32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask, "mu": mu,
            "rewards": rewards}


def matmul_peak(n: int = 2048, reps: int = 10) -> float:
    import jax
    import jax.numpy as jnp

    a = jnp.asarray(np.random.default_rng(0).normal(size=(n, n)), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


def shape_rates(matmul, reps: int = 5) -> dict[str, float]:
    """FLOP/s of `matmul(m, k, n) -> zero-arg timed callable` per shape (median of `reps`)."""
    out = {}
    for m, k, n in MATMUL_SHAPES:
        run = matmul(m, k, n)
        run()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        out[f"{m}x{k}x{n}"] = 2 * m * k * n / statistics.median(times)
    return out


def step_matmul_flops(chunk: int) -> float:
    """Matmul FLOPs the JAX step executes (2·m·k·n per product): every layer's projections and
    attention products forward and twice that backward, and the LM head forward, recomputed
    per vocabulary chunk in the backward, and its two gradient products. `chunk` only decides
    whether the head is recomputed (a single chunk is not)."""
    s, rows = SHAPE, B * T
    d, f, hd = s["hidden_size"], s["intermediate_size"], s["head_dim"]
    proj = d * hd * (2 * s["num_heads"] + 2 * s["num_kv_heads"]) + 3 * d * f
    attn = 2 * 2 * B * s["num_heads"] * T * T * hd  # QKᵀ and PV, full (masked) square
    layer_fwd = 2 * rows * proj + attn
    head = 2 * rows * d * s["vocab_size"]
    head_passes = 3 if chunk >= s["vocab_size"] else 4
    return 3 * s["num_layers"] * layer_fwd + head_passes * head


def optimizer_seconds(state, config, reps: int = 5) -> float:
    """Median time of the configured optimizer's update + apply on the step's parameters:
    memory-bound work (read p, g, m, v; write p, m, v) that no matmul speed-up removes."""
    import jax
    import optax

    from jaxrl_llm.train.optim import make_optimizer

    tx, _ = make_optimizer(config.optim, config.train.steps)
    grads = jax.tree.map(lambda p: p * 1e-3, state.params)

    @jax.jit
    def apply(params, opt_state):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params, opt_state = jax.block_until_ready(apply(state.params, tx.init(state.params)))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        params, opt_state = jax.block_until_ready(apply(params, opt_state))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def jax_matmul(m: int, k: int, n: int):
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(k, n)), jnp.float32)
    f = jax.jit(lambda x, y: x @ y)
    return lambda: f(a, b).block_until_ready()


def torch_matmul(m: int, k: int, n: int):
    import torch

    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
    return lambda: a @ b


def setup_jax(args, nb):
    import jax

    from jaxrl_llm.config import config_from_dict
    from jaxrl_llm.data.batch import Batch
    from jaxrl_llm.parallel.mesh import make_mesh
    from jaxrl_llm.train.state import count_params, create_train_state
    from jaxrl_llm.train.step import make_train_step

    config = config_from_dict({
        "model": {**SHAPE, "family": "llama", "scan_layers": args.scan_layers,
                  "remat": args.remat},
        "loss": {"name": "topr", "logprob_chunk_size": args.chunk},
        "optim": {"name": "adamw", "learning_rate": 1e-6, "clip_norm": 1.0},
        "mesh": {"data": 1, "fsdp": 1, "tensor": 1},
        "train": {"batch_size": B, "max_seq_len": T},
    })
    mesh = make_mesh(config.mesh, jax.devices()[:1])
    state = create_train_state(config, mesh)
    n_params = count_params(state.params)
    step = make_train_step(config, mesh, state)
    batch = Batch(
        inputs=nb["inputs"], targets=nb["targets"],
        positions=np.tile(np.arange(T, dtype=np.int32), (B, 1)),
        segment_ids=np.ones((B, T), np.int32), loss_mask=nb["mask"],
        behavior_logprobs=nb["mu"], mu_logprobs=nb["mu"],
        ref_logprobs=np.zeros((B, T), np.float32), rewards=nb["rewards"],
        correct=nb["rewards"] > 0, group_ids=np.arange(B, dtype=np.int32),
        record_mask=np.ones(B, np.float32), pair_index=np.zeros((0, 2), np.int32),
    )
    batch = jax.device_put(batch, jax.devices()[0])
    holder = {"state": state}

    def run() -> float:
        holder["state"], metrics = step(holder["state"], batch)
        return float(jax.block_until_ready(metrics)["loss"])

    run.optimizer_seconds = lambda: optimizer_seconds(holder["state"], config)
    return n_params, run


def setup_torch(args, nb):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(args.torch_threads)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=SHAPE["vocab_size"], hidden_size=SHAPE["hidden_size"],
        intermediate_size=SHAPE["intermediate_size"], num_hidden_layers=SHAPE["num_layers"],
        num_attention_heads=SHAPE["num_heads"], num_key_value_heads=SHAPE["num_kv_heads"],
        head_dim=SHAPE["head_dim"], rope_theta=SHAPE["rope_theta"],
        rms_norm_eps=SHAPE["rms_norm_eps"], tie_word_embeddings=True,
        max_position_embeddings=SHAPE["max_position_embeddings"],
    )
    model = LlamaForCausalLM(cfg).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    inputs = torch.from_numpy(nb["inputs"]).long()
    targets = torch.from_numpy(nb["targets"]).long()
    mask = torch.from_numpy(nb["mask"])
    mu = torch.from_numpy(nb["mu"])
    rewards = torch.from_numpy(nb["rewards"])

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=inputs).logits
        logp = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None])[..., 0]
        seq = (logp * mask).sum(-1)
        ell = seq - (mu * mask).sum(-1)
        # TOPR taper form (docs/kernels.md § TOPR family): positives a=b=1 → 1 + ℓ; negatives a=0, b=1.
        r = torch.exp(ell)
        rho = torch.where(rewards >= 0, 1 + ell, torch.where(r > 1, 1 + ell, r))
        loss = (-rewards * rho / mask.sum(-1)).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return float(loss.detach())

    return sum(p.numel() for p in model.parameters()), step


def median_dots(res: dict) -> float:
    """Median GFLOP/s over the step's matmul shapes and every round."""
    return statistics.median(v for one in res["rounds"]
                             for v in one["matmul_flops_by_shape"].values()) / 1e9


def timed(fn) -> tuple[float, float]:
    t0 = time.perf_counter()
    value = fn()
    return time.perf_counter() - t0, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--scan-layers", action="store_true")
    parser.add_argument("--remat", default="none", choices=("none", "full", "dots"))
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument("--torch-threads", type=int, default=2)
    parser.add_argument("--skip-torch", action="store_true")
    parser.add_argument("--only", choices=("jax", "torch"), help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "train_step.json"))
    args = parser.parse_args()

    if args.only:
        # Child process: one framework, its own memory (JAX + PyTorch together exceed what a
        # shared 24 GB machine leaves free).
        nb = make_numpy_batch()
        if args.only == "torch":
            import torch

            torch.set_num_threads(args.torch_threads)
        dots = shape_rates(jax_matmul if args.only == "jax" else torch_matmul)
        n_params, run = (setup_jax if args.only == "jax" else setup_torch)(args, nb)
        first, loss = timed(run)  # compile (JAX) and warm-up
        out = {"params": n_params, "matmul_flops_by_shape": dots, "first_step_s": first, "losses": [loss], "step_times_s": []}
        for _ in range(args.steps):
            seconds, loss = timed(run)
            out["step_times_s"].append(seconds)
            out["losses"].append(loss)
        if args.only == "jax":
            out["optimizer_s"] = run.optimizer_seconds()
        print("RESULT " + json.dumps(out))
        return

    load_before = os.getloadavg()
    peak = matmul_peak()
    res: dict[str, dict] = {}
    for round_index in range(args.rounds):
        for name in ["jax"] + ([] if args.skip_torch else ["torch"]):
            cmd = [sys.executable, __file__, "--only", name, "--steps", str(args.steps),
                   "--remat", args.remat, "--chunk", str(args.chunk),
                   "--torch-threads", str(args.torch_threads)]
            if args.scan_layers:
                cmd.append("--scan-layers")
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                raise SystemExit(f"{name} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
            one = json.loads(lines[-1][len("RESULT "):])
            one["load_average_after"] = os.getloadavg()
            if round_index == 0:
                res[name] = one | {"rounds": [one]}
            else:
                res[name]["rounds"].append(one)
                res[name]["step_times_s"] = res[name]["step_times_s"] + one["step_times_s"]
    jax_res, torch_res = res["jax"], res.get("torch")
    if torch_res is not None:
        torch_res["threads"] = args.torch_threads
    peak_after = matmul_peak()
    tokens = B * T
    n = jax_res["params"]
    jax_step = statistics.median(jax_res["step_times_s"])
    peak_used = max(peak, peak_after)
    result = {
        "shape": SHAPE, "batch": [B, T], "dtype": "float32", "loss": "topr",
        "optimizer": "adamw", "rounds": args.rounds, "variant": {"scan_layers": args.scan_layers, "remat": args.remat,
                                          "logprob_chunk_size": args.chunk},
        "matmul_peak_flops": [peak, peak_after],
        "jax": jax_res | {"median_step_s": jax_step, "tokens_per_s": tokens / jax_step,
                          "mfu": 6 * n * tokens / jax_step / peak_used},
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "note": "JAX and PyTorch run one after the other in child processes of one run "
                "(together they exceed the free memory); load averages are recorded because the "
                "2-core machine may be shared.",
    }
    lines = [
        "| implementation | median step (s) | tokens/s | MFU vs matmul peak | "
        "own fp32 dots on the step's shapes (median GFLOP/s) |",
        "| --- | --- | --- | --- | --- |",
        f"| jaxrl_llm (jit, chunked log-probs, chunk {args.chunk}) | {jax_step:.2f} | "
        f"{tokens / jax_step:.0f} | {result['jax']['mfu']:.0%} | {median_dots(jax_res):.0f} |",
    ]
    if torch_res is not None:
        t_step = statistics.median(torch_res["step_times_s"])
        result["torch"] = torch_res | {"median_step_s": t_step, "tokens_per_s": tokens / t_step,
                                       "mfu": 6 * n * tokens / t_step / peak_used}
        result["jax_over_torch_tokens_per_s"] = t_step / jax_step
        lines.append(f"| PyTorch transformers LlamaForCausalLM ({args.torch_threads} threads) | "
                     f"{t_step:.2f} | {tokens / t_step:.0f} | {result['torch']['mfu']:.0%} | "
                     f"{median_dots(torch_res):.0f} |")
        result["jax_over_torch_dots"] = median_dots(jax_res) / median_dots(torch_res)
        lines.append(f"\nJAX / PyTorch tokens/s: {result['jax_over_torch_tokens_per_s']:.2f}×; "
                     f"JAX / PyTorch fp32 dot speed on the step's shapes: "
                     f"{result['jax_over_torch_dots']:.2f}×")
    lines.append(f"matmul peak: {peak_used / 1e9:.0f} GFLOP/s; N = {n / 1e6:.1f} M params; "
                 f"load average before/after: {load_before[0]:.1f} / {os.getloadavg()[0]:.1f}")
    # Bounds on the MFU this machine allows the JAX step: its matmuls at XLA's own measured
    # rate on the step's shapes, alone and plus one optimizer pass, every other op free.
    dot_flops = step_matmul_flops(args.chunk)
    dots_s = dot_flops / (median_dots(jax_res) * 1e9)
    opt_s = statistics.median(one["optimizer_s"] for one in jax_res["rounds"])
    result["jax"] |= {"matmul_flops": dot_flops, "matmul_floor_s": dots_s, "optimizer_s": opt_s,
                      "mfu_bound_matmuls": 6 * n * tokens / dots_s / peak_used,
                      "mfu_bound_matmuls_optimizer": 6 * n * tokens / (dots_s + opt_s) / peak_used}
    lines.append(
        f"bound: the step's {dot_flops / 1e12:.2f} TFLOP of matmuls ({dot_flops / (6 * n * tokens):.2f}× "
        "6·N·tokens: attention products and the LM-head recompute) take "
        f"{dots_s:.1f} s at XLA's {median_dots(jax_res):.0f} GFLOP/s on these shapes, so MFU ≤ "
        f"{result['jax']['mfu_bound_matmuls']:.0%} with every other op free; adding the "
        f"optimizer pass (clip + AdamW, {opt_s:.2f} s jitted alone): MFU ≤ "
        f"{result['jax']['mfu_bound_matmuls_optimizer']:.0%}. The other "
        f"{jax_step - dots_s - opt_s:.1f} s of the step are normalisations, activations, softmaxes, "
        "residual adds and overlap losses")
    result["table"] = "\n".join(lines)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    Path(args.out).with_suffix(".md").write_text(
        f"# Train step, SmolLM2-135M shape, {B}×{T}, fp32, TOPR + AdamW (CPU)\n\n"
        f"`python benchmarks/train_step.py {' '.join(sys.argv[1:])}`\n\n"
        + result["table"] + "\n\n" + result["note"] + "\n"
    )
    print(result["table"])


if __name__ == "__main__":
    main()
