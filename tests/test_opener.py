"""The opener: what a model path is (`classify`) and its errors, and that it is the one way
commands open a model and its tokenizer."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from jaxrl_llm.policy.opener import classify, model_section


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


def _callers(function: str) -> set[str]:
    """The package files (relative to jaxrl_llm/) that call `function` by name."""
    import ast

    root = Path(__file__).resolve().parents[1] / "jaxrl_llm"
    found = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)
                if name == function:
                    found.add(str(path.relative_to(root)))
    return found


def test_commands_open_models_only_through_the_opener() -> None:
    """One way in: the weights loader is called by the opener and by train's `build_model`
    alone, checkpoints are restored for a caller by the opener alone, and tokenizers are
    chosen by the opener alone."""
    assert _callers("load_model") == {"policy/opener.py", "train/state.py"}
    assert _callers("restore_model") == {"policy/opener.py"}
    assert _callers("load_tokenizer") == {"policy/opener.py"}


def test_a_random_model_gets_the_char_tokenizer() -> None:
    import string

    from jaxrl_llm.config import ExperimentConfig
    from jaxrl_llm.core.errors import ConfigError
    from jaxrl_llm.policy.opener import open_tokenizer

    # 26 + 26 letters, 10 digits, 32 punctuation marks, space/newline/tab, and 4 specials
    size = len(string.ascii_letters) + 10 + len(string.punctuation) + 3 + 4
    assert size == 101
    assert len(open_tokenizer(ExperimentConfig())) == size
    assert len(open_tokenizer(ExperimentConfig(data={"tokenizer": "char"}))) == size
    with pytest.raises(ConfigError, match=r"model\.vocab_size=64 is smaller than the char "
                                          r"tokenizer \(101\)"):
        open_tokenizer(ExperimentConfig(model={"vocab_size": 64}))


def test_a_remote_models_local_copy_is_removed_when_the_process_exits(tmp_path: Path) -> None:
    """`--model gs://…` reads a local copy (transformers needs files); the copy is whole while
    the process runs and gone once it exits, so repeated commands do not fill /tmp."""
    source = tmp_path / "export"
    (source / "sub").mkdir(parents=True)
    (source / "config.json").write_text('{"a": 1}')
    (source / "sub" / "w.bin").write_bytes(bytes(range(256)) * 64)
    script = ("import sys; from jaxrl_llm.policy.opener import local_copy; "
              f"c = local_copy({str(source)!r}); "
              "print(c); print((c / 'config.json').read_text()); "
              "print(len((c / 'sub' / 'w.bin').read_bytes()))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    copy, config, size = out.stdout.splitlines()
    assert (config, size) == ('{"a": 1}', str(256 * 64))  # whole while the process ran
    assert copy.startswith(tempfile.gettempdir()) and not Path(copy).exists()
