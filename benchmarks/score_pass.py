"""The score pass against a plain forward pass of the same tokens, SmolLM2-135M on this CPU.

`score_records` (train/score.py: μ at the sampling temperature and π_ref at T = 1 for every
completion token, the sampler-vs-trainer mismatch, shards written) against the least a
forward pass must do for the same records: one jitted forward per batch of the same rows
padded to the same length buckets, full logits, `log_softmax` and a gather of the
completion tokens at one temperature. Records: GSM8K 8-shot sized (prompt 600–700 tokens,
completion 40–250), random tokens, 8 per batch, scored at T = 0.7. Each side runs twice in one
process: the first run includes its compiles, the second reuses them.

    python benchmarks/score_pass.py [--records 64] [--unrolled] [--out benchmarks/results/score_pass.json]

`--unrolled`: the layers unrolled (`model.scan_layers=false`, the default for pretrained
models before scanned layers became their default) instead of scanned.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BATCH, TEMPERATURE = 8, 0.7


def make_records(n: int, vocab: int) -> list:
    import numpy as np

    from jaxrl_llm.data.records import Record

    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        p, c = int(rng.integers(600, 700)), int(rng.integers(40, 250))
        lp = (-rng.random(c) - 0.01).astype(np.float32)
        out.append(Record(prompt_ids=rng.integers(0, vocab, p), completion_ids=rng.integers(0, vocab, c),
                          reward=1.0, group_id=i // 4, behavior_logprobs=lp, raw_logprobs=lp))
    return out


def forward_fn(model):
    """One jitted plain forward: full logits, log_softmax at TEMPERATURE, target gather."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def logprobs(inputs, targets, positions, segment_ids):
        hidden = model(inputs, positions=positions, segment_ids=segment_ids)
        logits = model.logits(hidden).astype(jnp.float32) / TEMPERATURE
        return jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]

    return logprobs


def plain_forward(logprobs, records) -> tuple[float, int]:
    """Seconds and padded tokens of one forward per batch (the scorer's buckets)."""
    import numpy as np

    from jaxrl_llm.data.collate import collate, record_row
    from jaxrl_llm.sampling.sampler import default_bucket

    start, tokens = time.perf_counter(), 0
    for i in range(0, len(records), BATCH):
        rows = [record_row(r) for r in records[i:i + BATCH]]
        length = default_bucket(max(r["inputs"].size for r in rows))
        b = collate(rows, BATCH, (length,))
        np.asarray(logprobs(b.inputs, b.targets, b.positions, b.segment_ids))
        tokens += BATCH * length
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=64)
    parser.add_argument("--unrolled", action="store_true", help="model.scan_layers=false")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/score_pass.json"))
    args = parser.parse_args()
    from benchmarks.machine import cpu_name
    from jaxrl_llm.config import ModelConfig
    from jaxrl_llm.data.shards import SamplingInfo, write_records
    from jaxrl_llm.train.score import score_records
    from jaxrl_llm.weights.loading import load_model

    model = load_model(ModelConfig(source="smollm2", scan_layers=not args.unrolled,
                                   remat="none")).model
    records = make_records(args.records, model.config.vocab_size)
    forward = forward_fn(model)
    result = {"benchmark": __doc__.splitlines()[0], "cpu": cpu_name(), "records": args.records,
              "batch": BATCH, "temperature": TEMPERATURE,
              "completion_tokens": int(sum(r.completion_ids.size for r in records)),
              "scan_layers": model.config.scan_layers}
    with tempfile.TemporaryDirectory() as tmp:
        write_records(Path(tmp, "recs"), records, vocab_size=model.config.vocab_size,
                      sampling=SamplingInfo(backend="jax", temperature=TEMPERATURE))
        for run in ("cold", "warm"):
            start = time.perf_counter()
            score_records(model, str(Path(tmp, "recs")), str(Path(tmp, f"scored-{run}")),
                          batch_size=BATCH, progress=False)
            result[f"score_{run}_s"] = time.perf_counter() - start
            result[f"forward_{run}_s"], result["padded_tokens"] = plain_forward(forward, records)
            result[f"score_over_forward_{run}"] = result[f"score_{run}_s"] / result[f"forward_{run}_s"]
            result[f"load_average_{run}"] = os.getloadavg()
            print(json.dumps(result), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
