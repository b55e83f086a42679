"""Does the sampler use the mesh? Per-device KV-cache bytes and per-device FLOPs of the
continuous sampler's compiled decode program (`jaxrl_llm.plan.sampler.make_sampler_plan`: the
library's own programs and layout, compiled, never run) on 1, 2, 4 and 8 fake CPU devices, in
one process:

- before: the layout the sampler had before issue 54 (`DecodeLayout(mesh)`: every slot,
  store row and KV buffer replicated on every device; what `mesh: {data: N}` gave);
- after: the layout the sampler derives from `mesh:` now (`layout.from_mesh`): slots, store
  rows and staging rows split over data × fsdp, KV heads over tensor.

Models: SmolLM2-135M's shape (3 KV heads: slot parallelism only) and Qwen2.5-0.5B's (2 KV
heads: also data × tensor at 8 devices), random weights never created (abstract shapes).
Writes results/sampler_sharding.{json,md}.

    python benchmarks/sampler_sharding.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

from jaxrl_llm.config import load_config
from jaxrl_llm.parallel.mesh import make_mesh
from jaxrl_llm.plan.sampler import make_sampler_plan
from jaxrl_llm.sampling.layout import DecodeLayout
from jaxrl_llm.weights.loading import decoder_config

RESULTS = Path(__file__).parent / "results"
SHAPES = {
    "SmolLM2-135M": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_layers=30, num_heads=9, num_kv_heads=3, tie_embeddings=True),
    "Qwen2.5-0.5B": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
                         tie_embeddings=True, family="qwen2"),
}
# (model, devices, mesh sizes)
ROWS = [("SmolLM2-135M", n, dict(data=n, fsdp=1, tensor=1)) for n in (1, 2, 4, 8)] + [
    ("Qwen2.5-0.5B", 1, dict(data=1, fsdp=1, tensor=1)),
    ("Qwen2.5-0.5B", 8, dict(data=4, fsdp=1, tensor=2)),
]


def config_for(model: str, sizes: dict[str, int], *, slots: int, prompt: int, new: int):
    overrides = [f"model.{k}={v}" for k, v in SHAPES[model].items()] + [
        "model.source=random", "model.max_position_embeddings=4096",
        f"mesh.data={sizes['data']}", f"mesh.fsdp={sizes['fsdp']}",
        f"mesh.tensor={sizes['tensor']}", f"generate.batch_size={slots // 8}", "generate.n=8",
        f"generate.max_new_tokens={new}", f"train.max_seq_len={prompt + new}",
        "generate.prefill_chunk=64"]
    return load_config(None, overrides)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # 256 slots, n = 8: every layout stages 8 prompts in all (≥ 1 per slot group), so the
    # prefill chunk beside each step is the same work at every device count
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--out", default=str(RESULTS / "sampler_sharding.json"))
    args = ap.parse_args(argv)
    rows = []
    for model, n, sizes in ROWS:
        config = config_for(model, sizes, slots=args.slots, prompt=args.prompt, new=args.new)
        decoder = decoder_config(config.model)
        mesh = make_mesh(config.mesh, jax.devices()[:n])
        row = dict(model=model, devices=n, mesh=sizes)
        for name, layout in (("before", DecodeLayout(mesh) if n > 1 else None),
                             ("after", None)):
            plan = make_sampler_plan(config, decoder, mesh, None, layout=layout)
            row[name] = dict(layout=plan.layout, kv_bytes=plan.kv_bytes_per_chip,
                             flops=plan.decode_flops_per_chip, peak_bytes=plan.peak_bytes,
                             weight_bytes=plan.weight_bytes_per_chip)
            print(f"{model} {n} devices {name}: {plan.layout}: KV "
                  f"{plan.kv_bytes_per_chip / 2**20:.1f} MiB, decode "
                  f"{plan.decode_flops_per_chip / 1e9:.2f} GFLOP per device", flush=True)
        rows.append(row)
    result = dict(slots=args.slots, prompt=args.prompt, new_tokens=args.new, n=8,
                  dtype="float32", rows=rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(render(result))
    print(render(result))
    return 0


def render(result: dict) -> str:
    """One table: per-device KV bytes and decode FLOPs, before and after, and their ratios
    to the same model on one device."""
    ones = {r["model"]: r for r in result["rows"] if r["devices"] == 1}
    lines = [f"{result['slots']} slots, {result['prompt']}-token prompts + "
             f"{result['new_tokens']} new tokens, n = {result['n']}, float32; per device, "
             "from the compiled decode program (`plan.sampler.make_sampler_plan`)", "",
             "| model | devices | mesh | layout after | KV MiB before | KV MiB after | "
             "KV ÷ 1 device | GFLOP before | GFLOP after | FLOPs ÷ 1 device |",
             "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["rows"]:
        one = ones[r["model"]]["after"]
        before = r.get("before") or r["after"]
        mesh = " ".join(f"{k}={v}" for k, v in r["mesh"].items() if v != 1) or "—"
        lines.append(
            f"| {r['model']} | {r['devices']} | {mesh} | {r['after']['layout']} | "
            f"{before['kv_bytes'] / 2**20:.1f} | {r['after']['kv_bytes'] / 2**20:.1f} | "
            f"{r['after']['kv_bytes'] / one['kv_bytes']:.3f} | {before['flops'] / 1e9:.2f} | "
            f"{r['after']['flops'] / 1e9:.2f} | {r['after']['flops'] / one['flops']:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
