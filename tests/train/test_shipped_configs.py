"""Every shipped config loads through `jaxrl-llm config`, documents its stage chain, and each
documented stage finds the keys it reads (and reads what the stage before it wrote)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jaxrl_llm.chain import check_chain, read_stages
from tests.xla_flags import ONE_DEVICE

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
PAPER = [p for p in CONFIGS if p.name.startswith(("topr_", "fpa_", "pkpo_"))]


def test_there_are_shipped_configs():
    assert len(CONFIGS) >= 10 and len(PAPER) == 12


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_command_shows_every_shipped_config(path):
    proc = subprocess.run([sys.executable, "-m", "jaxrl_llm.cli", "config", "--config",
                           str(path.relative_to(ROOT))],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    shown = yaml.safe_load(proc.stdout)
    raw = yaml.safe_load(path.read_text())
    # Every top-level section of the file is shown (none was dropped by a narrower schema).
    assert set(raw) <= set(shown), set(raw) - set(shown)
    assert shown["name"] == raw["name"]


def test_config_command_names_an_unknown_key_and_the_schema(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"iterate": {"iterations": 2}, "trian": {"steps": 3}}))
    proc = subprocess.run([sys.executable, "-m", "jaxrl_llm.cli", "config", "--config",
                           str(bad)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "unknown key 'trian'" in proc.stderr and "'iterate' config" in proc.stderr
    assert "unknown key 'iterate'" not in proc.stderr


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_documented_stage_chain_has_its_keys(path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the documented commands run from the repository root
    stages = read_stages(path)
    names = [s.name for s in stages]
    if path in PAPER:
        assert names == ["generate", "score", "curate", "train", "export", "evaluate"]
    assert check_chain(path.relative_to(ROOT)) == []


def test_chain_check_catches_a_missing_key(tmp_path, monkeypatch):
    """The v5e-256 config as first shipped (no data.records, no curated set): refused."""
    source = ROOT / "configs" / "topr_gsm8k_llama3_8b_v5e256.yaml"
    (tmp_path / "configs").mkdir()
    text = source.read_text()
    text = re.sub(r"^  (records|curated): .*\n", "", text, flags=re.M)
    text = re.sub(r"^  (output|score_output): .*\n", "", text, flags=re.M)
    (tmp_path / "configs" / source.name).write_text(text)
    monkeypatch.chdir(tmp_path)
    problems = check_chain(Path("configs") / source.name)
    joined = "\n".join(problems)
    assert "stage 'generate'" in joined and "set generate.output" in joined
    assert "stage 'score'" in joined and "data.records" in joined
    assert "stage 'curate'" in joined and "set data.curated" in joined


def test_chain_check_catches_a_broken_link(tmp_path, monkeypatch):
    source = ROOT / "configs" / "topr_countdown_qwen25_05b_1gpu.yaml"
    (tmp_path / "configs").mkdir()
    text = source.read_text().replace("train --config configs/topr_countdown_qwen25_05b_1gpu"
                                      ".yaml --records runs/topr_countdown_qwen25_05b_1gpu/"
                                      "curated", "train --config configs/topr_countdown_"
                                      "qwen25_05b_1gpu.yaml --records runs/elsewhere")
    (tmp_path / "configs" / source.name).write_text(text)
    monkeypatch.chdir(tmp_path)
    problems = check_chain(Path("configs") / source.name)
    assert len(problems) == 1 and "stage 'train'" in problems[0]
    assert "reads runs/elsewhere but the curate stage writes" in problems[0]


def test_scale_page_shows_the_v5e256_chain_verbatim():
    """docs/scale.md (the page the README's Scale section links) shows the v5e-256 config's
    chain as its header states it, and every launcher line of the README and that page names a
    shipped config with a documented chain."""
    scale = (ROOT / "docs" / "scale.md").read_text()
    documented = [s.text for s in read_stages(ROOT / "configs"
                                              / "topr_gsm8k_llama3_8b_v5e256.yaml")]
    lines = [line.split("  #")[0].strip() for line in scale.splitlines()]
    at = lines.index(documented[0])
    assert lines[at:at + len(documented)] == documented
    launchers = 0
    for page in (ROOT / "README.md", ROOT / "docs" / "scale.md"):
        for line in (line.split("  #")[0].strip() for line in page.read_text().splitlines()):
            config = re.search(r"configs/\S+\.yaml", line)
            if line.startswith(("launch/", "sbatch", "STAGES=")) and config:
                assert read_stages(ROOT / config.group(0)), (page.name, line)
                launchers += 1
    assert launchers >= 5  # the pod, SLURM, local and pipeline launchers of docs/scale.md


@pytest.mark.slow
def test_local_launcher_runs_the_cpu_chain(tmp_path):
    """`launch/local.sh configs/generate_cpu_arithmetic.yaml` runs generate → score → curate
    from a fresh directory with the config's relative paths."""
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    shutil.copytree(ROOT / "launch", tmp_path / "launch")
    env = dict(os.environ, VENV=str(ROOT / ".venv"), PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = ONE_DEVICE
    proc = subprocess.run(["bash", "launch/local.sh", "configs/generate_cpu_arithmetic.yaml"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ran = [line for line in proc.stderr.splitlines() if line.startswith("+ ")]
    assert [line.split()[2] for line in ran] == ["generate", "score", "curate"]
    data = tmp_path / "runs" / "data"
    for name in ("cpu_arithmetic", "cpu_arithmetic-scored", "cpu_arithmetic-curated"):
        assert (data / name / "manifest.json").is_file(), name
