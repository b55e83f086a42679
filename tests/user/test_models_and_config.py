"""Issue 33, models and configuration as a new user meets them: `config` shows a pretrained
source's real architecture; `export --from` turns the packaged GGUF into an HF directory that
transformers loads (files readable by others, mode 0644 under umask 022); docs/configuration.md
is the schema's own reference (every key described, kept current); a mistyped key gets a
"did you mean"; config errors come before any data is read; no PyTorch advisory."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.user.cli import SMOLLM2_CONFIG, jaxrl

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_config_shows_the_architecture_of_the_packaged_model(tmp_path: Path) -> None:
    from gguf import GGUFReader

    from jaxrl_llm.weights.packaged import smollm2_gguf_path

    (tmp_path / "c.yaml").write_text(SMOLLM2_CONFIG)
    done = jaxrl(tmp_path, "config", "--config", "c.yaml")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("# model: source=smollm2; its architecture (30 layers")
    model = yaml.safe_load(done.stdout)["model"]
    # the GGUF's own metadata, read here with the gguf library alone
    fields = GGUFReader(str(smollm2_gguf_path())).fields

    def value(key: str) -> int:
        return int(fields[key].parts[fields[key].data[0]][0])

    assert (model["num_layers"], model["hidden_size"], model["intermediate_size"],
            model["num_heads"], model["num_kv_heads"], model["vocab_size"]) == (
        value("llama.block_count"), value("llama.embedding_length"),
        value("llama.feed_forward_length"), value("llama.attention.head_count"),
        value("llama.attention.head_count_kv"), len(fields["tokenizer.ggml.tokens"].data))


@pytest.mark.slow  # 540 MB of float32 safetensors written and loaded by transformers (PyTorch)
def test_export_from_the_packaged_gguf_loads_in_transformers(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxrl_llm.weights.packaged import smollm2_gguf_path

    old = os.umask(0o022)
    try:
        done = jaxrl(tmp_path, "export", "--from", "smollm2", "--out", "smol_hf")
    finally:
        os.umask(old)
    assert done.returncode == 0, done.stderr
    for path in (tmp_path / "smol_hf").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path  # safetensors wrote 0600
    gguf = smollm2_gguf_path()
    # transformers' own GGUF loader dequantises the same file: the reference
    want_model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                      dtype=torch.float32)
    got_model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "smol_hf"), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "smol_hf"))
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}],
                                  add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    with torch.no_grad():
        want, got = want_model(ids).logits.numpy(), got_model(ids).logits.numpy()
    np.testing.assert_allclose(got, want, atol=5e-4, rtol=0)


def test_configuration_reference_is_current_and_describes_every_key() -> None:
    from jaxrl_llm.config.reference import render, undocumented
    from jaxrl_llm.flows.quickstart import QuickstartConfig

    assert undocumented(QuickstartConfig) == []
    committed = (ROOT / "docs" / "configuration.md").read_text()
    from jaxrl_llm.commands.config import SCHEMAS, schema_class

    assert committed == render({name: schema_class(name) for name in SCHEMAS}), ("docs/configuration.md is stale: run "
                                   "`jaxrl-llm config --reference > docs/configuration.md`")


def test_a_mistyped_key_gets_did_you_mean(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("optim: {learning_rat: 1.0e-5}\n")
    done = jaxrl(tmp_path, "train", "--config", "c.yaml", "train.stepz=3")
    assert done.returncode == 2
    assert "unknown key 'train.stepz' (from override 'train.stepz=3'); did you mean 'train.steps'?" in done.stderr
    assert "unknown key 'optim.learning_rat' (from file c.yaml); did you mean 'optim.learning_rate'?" in done.stderr


@pytest.mark.parametrize("override,named", [
    (["mesh.data=3", "mesh.fsdp=2"], "mesh.data=3, mesh.fsdp=2"),
    (["model.source=hf"], "model.path is not set"),
])
def test_config_errors_come_before_any_record_is_read(tmp_path: Path, override, named) -> None:
    """The records here are missing: a config error must be the one reported (it used to come
    after the records' checks, so a user could score for hours before learning it)."""
    (tmp_path / "c.yaml").write_text("run_dir: run\ndata: {records: nowhere}\n")
    done = jaxrl(tmp_path, "train", "--config", "c.yaml", *override)
    assert done.returncode == 2
    assert named in done.stderr and "nowhere" not in done.stderr, done.stderr


def test_no_pytorch_advisory_without_torch(tmp_path: Path) -> None:
    """transformers prints "PyTorch was not found. Models won't be available" on import when
    torch is missing (as for a user who installed only jaxrl_llm); hide torch to check."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(
        "import importlib.util\n_find = importlib.util.find_spec\n"
        "def find_spec(name, package=None):\n"
        "    return None if name.split('.')[0] == 'torch' else _find(name, package)\n"
        "importlib.util.find_spec = find_spec\n")
    (tmp_path / "c.yaml").write_text("data: {tokenizer: char}\n")
    env = {"PYTHONPATH": str(tmp_path / "site")}
    probe = jaxrl(tmp_path, "config", "--config", "c.yaml", **env)
    assert probe.returncode == 0, probe.stderr
    done = jaxrl(tmp_path, "generate", "--config", "c.yaml", "--gold", "--out", "gold", **env)
    assert done.returncode == 0, done.stderr
    assert "PyTorch" not in done.stderr


def test_a_mistyped_local_model_path_is_not_tried_as_a_hub_id(tmp_path: Path) -> None:
    """`models/my-modle` beside a `models/` directory is a typo of a local path: the error
    names the path and what `models/` holds, and no Hub lookup is made."""
    (tmp_path / "models" / "my-model").mkdir(parents=True)
    (tmp_path / "c.yaml").write_text("run_dir: run\ndata: {records: nowhere}\n")
    done = jaxrl(tmp_path, "train", "--config", "c.yaml", "model.source=hf",
                 "model.path=models/my-modle")
    assert done.returncode == 2
    assert "model.path='models/my-modle': no such directory" in done.stderr, done.stderr
    assert "models/ holds: my-model" in done.stderr and "hub" not in done.stderr.lower()
