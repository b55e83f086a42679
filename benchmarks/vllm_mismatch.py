"""Sampler-vs-trainer mismatch on real vLLM records: how far vLLM's per-token log-probs are from
the trainer's own (`jaxrl-llm score`) for SmolLM2-135M-Instruct, by engine dtype, sampling
temperature and vLLM's `logprobs_mode`.

For each (dtype ∈ {float32, bfloat16}, logprobs_mode ∈ {processed, raw}, T ∈ {1, 0.7}):
`jaxrl-llm generate` with `generate.backend: vllm` (32 arithmetic prompts × 4 samples, chat
template, ≤ 64 tokens), then `jaxrl-llm score` (the trainer's float32 numerics) and its report:
mean and max |Δ log p| per token, the worst sequence's |Δ Σ log p|, k3 KL(sampler ‖ trainer)
and the ESS fraction. `processed_logprobs` are at the sampling temperature and are compared
with the trainer's μ at that temperature; `raw_logprobs` are vLLM's unprocessed (T = 1) ones,
compared with the trainer's T = 1 log-probs. The commands run as a user runs them, in a
temporary directory. Writes benchmarks/results/vllm_mismatch.json and .md.

    python benchmarks/vllm_mismatch.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
CONFIG = """\
name: mismatch
seed: 0
model: {{source: hf, path: {model}}}
generate: {{backend: vllm, n: 4, max_new_tokens: 64, output: records}}
data: {{task: arithmetic, num_prompts: {prompts}, chat_template: true, records: records}}
"""
KEYS = ("mismatch/mean_abs_logprob_diff", "mismatch/max_abs_prob_diff",
        "mismatch/max_abs_seq_logprob_diff", "mismatch/kl_sampler_trainer",
        "mismatch/ess_fraction", "mismatch/num_tokens")


def jaxrl(cwd: Path, *args: str) -> str:
    exe = Path(sys.executable).with_name("jaxrl-llm")
    done = subprocess.run([str(exe), *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if done.returncode:
        raise SystemExit(f"jaxrl-llm {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--out", default=str(RESULTS / "vllm_mismatch.json"))
    args = ap.parse_args(argv)
    from vllm_generate import export_smollm2  # benchmarks/, this script's directory

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        model = export_smollm2(cwd / "smollm2", "float32")
        (cwd / "c.yaml").write_text(CONFIG.format(model=model, prompts=args.prompts))
        for dtype in ("float32", "bfloat16"):
            for mode in ("processed_logprobs", "raw_logprobs"):
                for temperature in (1.0, 0.7):
                    name = f"{dtype}-{mode}-T{temperature}"
                    jaxrl(cwd, "generate", "--config", "c.yaml", "--out", name,
                          f"generate.dtype={dtype}", f"generate.vllm_logprobs_mode={mode}",
                          f"generate.temperature={temperature}")
                    out = jaxrl(cwd, "score", "--config", "c.yaml", "--records", name,
                                "--out", f"{name}-scored", f"generate.temperature={temperature}")
                    report = json.loads(out[out.index("{"):])
                    rows.append(dict(dtype=dtype, logprobs_mode=mode, temperature=temperature,
                                     **{k.split("/", 1)[1]: report[k] for k in KEYS}))
                    print(json.dumps(rows[-1]), flush=True)
    Path(args.out).write_text(json.dumps(dict(model="SmolLM2-135M-Instruct (packaged GGUF → HF, float32)",
                                              prompts=args.prompts, samples=4, rows=rows), indent=2) + "\n")
    lines = ["| vLLM dtype | logprobs_mode | T | mean \\|Δ log p\\| per token | worst sequence \\|Δ Σ log p\\| | k3 KL | ESS fraction |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['dtype']} | {r['logprobs_mode'].split('_')[0]} | {r['temperature']} | "
              f"{r['mean_abs_logprob_diff']:.2g} | {r['max_abs_seq_logprob_diff']:.2g} | "
              f"{r['kl_sampler_trainer']:.2g} | {r['ess_fraction']:.4f} |" for r in rows]
    Path(args.out).with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
