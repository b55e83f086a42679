"""`jaxrl-llm generate` on the packaged SmolLM2-135M with a pretrained model's default config
(layers scanned for training: `model.scan_layers: true`, `remat: full`) against the same command
with `model.scan_layers: false`, and optionally the same commands at an older commit
(`--ref`), in one run on the same machine.

The sampler decodes with the layers unrolled, each on its own KV-cache buffer, whatever the
config's layout (models/kv_cache.py). Before that (`--ref 84d6972`), a scanned model decoded
under a `lax.scan` over a stacked cache, which copies each layer's slice out of the stack and
back every step. Each arm is the user's command as a subprocess in its own temporary
directory (relative paths, a config file), T = 1 until EOS or 128 tokens, n = 8 samples of
`--prompts` arithmetic prompts, 16 decode slots (batch_size 2 × n); the wall time includes
loading and compiling, as the user waits for them. The arms alternate `--runs` times (medians).
Every arm's completions are read back: `identical` says whether they equal the first arm's,
token for token.

    python benchmarks/generate_layout.py [--prompts 16] [--runs 1] [--ref 84d6972]
        [--out benchmarks/results/generate_layout.json]
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
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]


def config(prompts: int, scan_layers: bool) -> dict[str, Any]:
    return {"name": "generate_layout", "seed": 0,
            "model": {"source": "smollm2", "scan_layers": scan_layers},
            "generate": {"backend": "jax", "n": 8, "temperature": 1.0, "max_new_tokens": 128,
                         "batch_size": 2, "output": "runs/data/samples"},
            "data": {"task": "arithmetic", "num_prompts": prompts}}


def run(code: Path, tree: dict[str, Any], cwd: Path) -> tuple[float, list[list[int]]]:
    """One `generate` of the package at `code` in `cwd`: wall seconds and the completions."""
    cwd.mkdir(parents=True)
    (cwd / "generate.yaml").write_text(yaml.safe_dump(tree))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(code)}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "jaxrl_llm.cli", "generate", "--config",
                           "generate.yaml"], cwd=cwd, env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"generate failed in {cwd}:\n{done.stderr[-3000:]}")
    from jaxrl_llm.data.shards import read_records

    records = read_records(cwd / "runs/data/samples")
    return wall, [list(map(int, r.completion_ids)) for r in records]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--ref", default="", help="an older commit whose arms run too")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/generate_layout.json"))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        codes = {"now": ROOT}
        if args.ref:
            old = Path(tmp) / "ref"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old),
                            args.ref], check=True, capture_output=True)
            codes[args.ref] = old
        arms = [(code, scan) for code in codes for scan in (True, False)]
        walls: dict[str, list[float]] = {}
        first: list[list[int]] | None = None
        identical: dict[str, bool] = {}
        try:
            for repeat in range(args.runs):
                for code, scan in arms:
                    name = f"{code} scan_layers={str(scan).lower()}"
                    wall, completions = run(codes[code], config(args.prompts, scan),
                                            Path(tmp) / f"{repeat}-{len(walls)}-{code}-{scan}")
                    first = completions if first is None else first
                    identical[name] = identical.get(name, True) and completions == first
                    walls.setdefault(name, []).append(wall)
                    tokens = sum(map(len, completions))
                    print(f"{name}: {wall:.1f} s, {tokens} tokens", file=sys.stderr, flush=True)
        finally:
            if args.ref:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                str(codes[args.ref])], check=False)
    base = statistics.median(walls["now scan_layers=false"])
    rows = [dict(arm=name, wall_s=statistics.median(w), runs=w,
                 over_now_unrolled=statistics.median(w) / base, identical=identical[name])
            for name, w in walls.items()]
    meta = dict(prompts=args.prompts, n=8, max_new_tokens=128, slots=16, ref=args.ref,
                tokens=sum(map(len, first or [])), cores=len(os.sched_getaffinity(0)),
                load_average_after=os.getloadavg())
    Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
    for row in rows:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
