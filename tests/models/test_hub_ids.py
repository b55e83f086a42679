"""`model.path` as a Hugging Face Hub id, resolved offline from a cache directory the test
builds in huggingface_hub's layout (models--org--name/{refs,snapshots}); no network."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import yaml
from flax import nnx

from jaxrl_llm.cli import main as cli_main
from jaxrl_llm.config import ConfigError, ModelConfig
from jaxrl_llm.models.config import DecoderConfig
from jaxrl_llm.models.decoder import Decoder
from jaxrl_llm.models.tokenizer import train_bpe_tokenizer
from jaxrl_llm.weights import hf
from jaxrl_llm.weights.hub import is_hub_id, resolve_model_dir
from jaxrl_llm.weights.loading import load_model

REPO = "tiny-org/tiny-llama"
MAIN, PINNED = "a" * 40, "b" * 40  # commit hashes of two snapshots


def _snapshot(root: Path, commit: str, seed: int, tokenizer) -> Path:
    config = DecoderConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_layers=1,
                           num_heads=2, num_kv_heads=1, tie_embeddings=True)
    snap = root / f"models--{REPO.replace('/', '--')}" / "snapshots" / commit
    hf.save_pretrained(Decoder(config, rngs=nnx.Rngs(seed)), snap, tokenizer=tokenizer)
    return snap


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    """A hub cache with REPO at two commits; refs/main -> MAIN."""
    root = tmp_path_factory.mktemp("hf") / "hub"
    tok = train_bpe_tokenizer(["What is 3 + 4? The answer is 7."] * 20, 300)
    _snapshot(root, MAIN, 0, tok)
    _snapshot(root, PINNED, 1, tok)
    refs = root / f"models--{REPO.replace('/', '--')}" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text(MAIN)
    return root


@pytest.fixture
def offline(hub_cache, monkeypatch) -> Path:
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub_cache


def _embedding(snapshot: Path) -> np.ndarray:
    return safetensors.numpy.load_file(str(snapshot / "model.safetensors"))[
        "model.embed_tokens.weight"]


def test_hub_id_shape():
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and is_hub_id(REPO)
    for local in ("runs/x/hf", "/abs/dir", "./a/b", "gs://bucket/x", "model.gguf", "a/b.gguf",
                  "justname"):
        assert not is_hub_id(local), local


def test_hub_id_resolves_main_and_pinned_revision(offline):
    snaps = offline / f"models--{REPO.replace('/', '--')}" / "snapshots"
    assert Path(resolve_model_dir(REPO)) == snaps / MAIN
    assert Path(resolve_model_dir(REPO, revision=PINNED)) == snaps / PINNED
    for commit, revision in ((MAIN, None), (PINNED, PINNED)):
        model = load_model(ModelConfig(source="hf", path=REPO, revision=revision)).model
        np.testing.assert_array_equal(np.asarray(model.embed[...]),
                                      _embedding(snaps / commit))


def test_missing_hub_id_offline_names_id_and_cache(offline):
    with pytest.raises(ConfigError) as err:
        load_model(ModelConfig(source="hf", path="nobody/missing-model"))
    assert "nobody/missing-model" in str(err.value) and str(offline) in str(err.value)
    assert "HF_HUB_OFFLINE" in str(err.value)
    with pytest.raises(ConfigError, match=f"{REPO}.*revision 'v9'"):
        resolve_model_dir(REPO, revision="v9")


def test_generate_with_a_hub_id(offline, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    Path("gen.yaml").write_text(yaml.safe_dump({
        "model": {"source": "hf", "path": REPO, "revision": PINNED},
        "data": {"task": "arithmetic", "num_prompts": 2},
        "generate": {"n": 2, "max_new_tokens": 4, "batch_size": 4, "output": "recs"},
    }))
    assert cli_main(["generate", "--config", "gen.yaml"]) == 0
    assert "wrote 4 records" in capsys.readouterr().out
    assert cli_main(["generate", "--config", "gen.yaml", "--out", "recs2",
                     "model.path=nobody/missing-model"]) == 2
    err = capsys.readouterr().err
    assert "model.path='nobody/missing-model'" in err and str(offline) in err
