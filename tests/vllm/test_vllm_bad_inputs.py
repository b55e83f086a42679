"""Bad input to the vLLM backend, as a user meets it (`jaxrl-llm generate`, a temp directory,
relative paths): each is a one-line error naming the cause and the fix, exit 2, before any
engine starts, and nothing is left that a later stage could read as complete."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

YAML = """\
name: bad
model: {{source: hf, path: {model}}}
generate: {{backend: vllm, n: 2, max_new_tokens: {max_new}, output: data/records}}
data: {{task: arithmetic, num_prompts: 4}}
"""


def generate(cwd: Path, model: Path, max_new: int = 8, *extra: str) -> subprocess.CompletedProcess:
    (cwd / "c.yaml").write_text(YAML.format(model=model, max_new=max_new))
    exe = Path(sys.executable).with_name("jaxrl-llm")
    return subprocess.run([str(exe), "generate", "--config", "c.yaml", *extra], cwd=cwd,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True,
                          text=True, timeout=300)


def refused(proc: subprocess.CompletedProcess, *words: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert all(w in proc.stderr for w in words), proc.stderr
    return proc.stderr


def test_generation_longer_than_the_models_context(tmp_path, tiny_hf) -> None:
    refused(generate(tmp_path, tiny_hf, 1000), "max_position_embeddings 256",
            "generate.max_new_tokens")
    assert not (tmp_path / "data" / "records" / "manifest.json").exists()


def test_generation_longer_than_the_rope_scaled_context(tmp_path, tiny_hf) -> None:
    """model.rope_scaling replaces the file's 256 positions: YaRN 2 × 32 = 64 (computed here)
    is the context vLLM would get, and 100 new tokens exceed it."""
    yarn = "model.rope_scaling={rope_type: yarn, factor: 2.0, original_max_position_embeddings: 32}"
    refused(generate(tmp_path, tiny_hf, 100, yarn),
            "max_position_embeddings 64 (after model.rope_scaling)", "generate.max_new_tokens")
    assert not (tmp_path / "data" / "records" / "manifest.json").exists()


def test_model_directory_without_weights(tmp_path, tiny_hf) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_hf, broken)
    (broken / "model.safetensors").unlink()
    refused(generate(tmp_path, broken), "broken", "no *.safetensors")


def test_shards_without_manifest_or_progress(tmp_path, tiny_hf) -> None:
    out = tmp_path / "data" / "records"
    out.mkdir(parents=True)
    (out / "records-00000.array_record").write_bytes(b"half a shard")
    refused(generate(tmp_path, tiny_hf), "data/records", "--overwrite")
    assert (out / "records-00000.array_record").exists()  # nothing of the user's is deleted


@pytest.mark.parametrize("key", ["generate.dtype=float64", "generate.vllm_kv_cache_gib=0"])
def test_config_values_vllm_cannot_take(tmp_path, tiny_hf, key) -> None:
    refused(generate(tmp_path, tiny_hf, 8, key), key.split("=")[0])
