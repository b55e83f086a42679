"""The continuous sampler's decode program writes each step's keys and values into the
generated-slot cache in place when compiled for TPU: `python benchmarks/decode_v5e.py` (run as
a user runs it, on a small v5e topology) at two context lengths reports the same temporaries
while the cache (donated: in and out in one buffer) grows by its known size. A scatter into
the cache's minor slot axis made the TPU compiler copy the whole cache every step (7 GiB per
chip at 8B × 256 × 8,192: 15.0 GiB peak where 8.0 fits). Both layouts: the layers decoded under
their scan on one stacked cache (`model.decode_layers: auto` on TPU) and unrolled."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl_llm.plan import libtpu_available

ROOT = Path(__file__).resolve().parents[2]
LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128  # benchmarks/decode_v5e.py's Llama-3-8B shape
SLOTS, PROMPT, CHIPS = 32, 256, 4


def per_chip(tmp_path: Path, context: int, layers: str) -> dict[str, float]:
    out = tmp_path / f"decode_{context}_{layers}.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks/decode_v5e.py"), "--topology",
                    "v5e:2x2", "--fsdp", "2", "--tensor", "2", "--slots", str(SLOTS),
                    "--context", str(context), "--prompt", str(PROMPT), "--store-rows", "8",
                    "--staged", "2", "--chunk", "128", "--decode-layers", layers, "--out", str(out)],
                   check=True, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    return json.loads(out.read_text())["per_chip_gib"]


def generated_cache_gib(context: int) -> float:
    """Keys + values of every layer's generated slots, bfloat16, split over the chips."""
    return 2 * LAYERS * SLOTS * KV_HEADS * HEAD_DIM * (context - PROMPT) * 2 / CHIPS / 2**30


@pytest.mark.slow
@pytest.mark.skipif(not libtpu_available(), reason="needs the `tpu` extra (PyPI libtpu)")
@pytest.mark.parametrize("layers", ["scanned", "unrolled"])
def test_decode_program_keeps_the_generated_cache_in_place(tmp_path, layers):
    short, long = per_chip(tmp_path, 2048, layers), per_chip(tmp_path, 4096, layers)
    grown = generated_cache_gib(4096) - generated_cache_gib(2048)
    assert grown == pytest.approx(2.0)
    assert long["aliased"] - short["aliased"] == pytest.approx(grown, rel=0.01)
    # in place: no temporary grows with the cache (a copy would add 2 GiB here)
    assert abs(long["temporaries"] - short["temporaries"]) < 0.05 * grown, (short, long)
