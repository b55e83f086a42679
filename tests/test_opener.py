"""`opener.classify`: the one decision of what a model path is, and its errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxrl_llm.opener import classify, model_section


def test_each_kind_of_source(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert classify(None) == ("config", None)
    assert classify("smollm2") == ("gguf", None)
    assert classify("m.gguf") == ("gguf", "m.gguf")
    assert classify("hf") == ("hf", "hf")
    assert classify("HuggingFaceTB/SmolLM2-135M-Instruct") == ("hf", "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert classify("run") == ("checkpoint", "run")
    assert classify("run/checkpoints") == ("checkpoint", "run/checkpoints")


def test_missing_sources_name_the_key(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"--from=nope\.gguf: GGUF file not found"):
        classify("nope.gguf", key="--from")
    with pytest.raises(FileNotFoundError, match=r"--model=nowhere: .*not a checkpoint"):
        classify("nowhere", key="--model")


def test_pretrained_sources_keep_the_config_numerics() -> None:
    from jaxrl_llm.config import ExperimentConfig

    config = ExperimentConfig(model={"param_dtype": "bfloat16", "remat": "full",
                                     "scan_layers": True})
    hf = model_section(config, "hf", "some/dir")
    assert (hf.source, hf.path, hf.param_dtype, hf.remat) == ("hf", "some/dir", "bfloat16", "full")
    assert model_section(config, "gguf", None).source == "smollm2"
    assert model_section(config, "gguf", "x.gguf").source == "gguf"
