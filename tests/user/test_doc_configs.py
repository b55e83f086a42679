"""Issue 42, item 1: every example config in README.md and docs/ runs as written.

A ```yaml block is a config when its top-level keys include a key of a config schema
(`model`, `data`, `train`, ..., `iterate`, `online`, `sft`). Each one is either run here —
`jaxrl-llm config` on it, then the first command the surrounding text gives, from a temporary
working directory holding the files the text names — or listed in FRAGMENTS with the reason it
cannot run alone. A config block that is neither fails the test, so a new example cannot
be added without running it. Tiny overrides keep the fast runs fast; the README's SmolLM2
config also runs exactly as written (slow).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.user.cli import jaxrl

ROOT = Path(__file__).resolve().parents[2]
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
FENCE = re.compile(r"^```ya?ml\n(.*?)^```", re.S | re.M)
# A GSM8K-format row, as README.md and docs/tasks.md describe the user's file.
GSM8K_ROWS = [{"question": "Ana buys 3 packs of 8 markers and gives away 5. How many are left?",
               "answer": "3 * 8 = <<3*8=24>>24.\n24 - 5 = <<24-5=19>>19.\n#### 19"},
              {"question": "A farmer has 12 eggs and sells half. How many are left?",
               "answer": "12 / 2 = <<12/2=6>>6.\n#### 6"}]
# A random model of the default size, one sample of 4 tokens: the stage runs in seconds.
TINY = ["model.source=random", "generate.n=1", "generate.max_new_tokens=4", "data.num_prompts=1"]


def config_keys() -> set[str]:
    from jaxrl_llm.flows.quickstart import QuickstartConfig
    from jaxrl_llm.online.config import OnlineConfig

    return set(QuickstartConfig.model_fields) | set(OnlineConfig.model_fields)


def config_blocks() -> dict[tuple[str, str], str]:
    """(file relative to the repository, the block's first line) -> the block, for every
    ```yaml block of README.md and docs/*.md that is a config."""
    keys, out = config_keys(), {}
    for path in DOCS:
        for block in FENCE.findall(path.read_text()):
            parsed = yaml.safe_load(block)  # a block that does not parse fails here
            if isinstance(parsed, dict) and keys & set(parsed):
                where = (str(path.relative_to(ROOT)), block.splitlines()[0])
                assert where not in out, f"two config blocks open with {where}: tell them apart"
                out[where] = block
    return out


def python_block(doc: str, after: str) -> str:
    """The ```python block of `doc` that follows the line `after` (the file it shows)."""
    text = (ROOT / doc).read_text()
    match = re.search(re.escape(after) + r"\n\n```python\n(.*?)^```", text, re.S | re.M)
    assert match, f"{doc}: no ```python block after {after!r}"
    return match.group(1)


@dataclass
class Run:
    """How the text around a block tells the user to run it."""

    config: str  # the file name the text uses for the config
    command: list[str]  # the first stage, as the text gives it (then `overrides`)
    files: dict[str, str] = field(default_factory=dict)  # files the text names, in the cwd
    overrides: list[str] = field(default_factory=list)
    pythonpath_cwd: bool = False  # the text says `PYTHONPATH=. jaxrl-llm …`
    writes: str | None = None  # the record directory the stage must have written


GSM8K_JSONL = "".join(json.dumps(r) + "\n" for r in GSM8K_ROWS)
RUNS = {
    # "`jaxrl-llm generate|score|curate|train --config my.yaml`": the first is generate,
    # which writes data.records (generate.output unset).
    ("README.md", "name: my_gsm8k"): Run(
        "my.yaml", ["generate", "--config", "my.yaml"],
        {"train.jsonl": GSM8K_JSONL, "test.jsonl": GSM8K_JSONL}, TINY,
        writes="runs/my_gsm8k/records"),
    # The data section of a config; the chain's first stage is generate (no data.records here).
    ("docs/tasks.md", "data:"): Run(
        "c.yaml", ["generate", "--config", "c.yaml", "--out", "records"],
        {"my_gsm8k.jsonl": GSM8K_JSONL}, TINY, writes="records"),
    # "`PYTHONPATH=. jaxrl-llm generate --config C …`" with the module the same page shows
    # (its example factory `make_task`), placed at the import path the block names.
    ("docs/custom_tasks.md", "data:"): Run(
        "c.yaml", ["generate", "--config", "c.yaml", "--out", "records"],
        {"my_package/__init__.py": "",
         "my_package/rewards.py": python_block("docs/custom_tasks.md", "`my_tasks/vowels.py`:")},
        TINY, pythonpath_cwd=True, writes="records"),
    # The environments section ("Every command that samples runs episodes"): its first stage is
    # generate. A chat template needs a chat model: the packaged SmolLM2-135M.
    ("README.md", "data: {task: countdown, chat_template: true}"): Run(
        "c.yaml", ["generate", "--config", "c.yaml", "--out", "records"], {},
        ["model.source=smollm2", *TINY[1:]], writes="records"),
    ("docs/environments.md", "data:"): Run(
        "c.yaml", ["generate", "--config", "c.yaml", "--out", "records"], {}, TINY,
        writes="records"),
}
FRAGMENTS = {
    ("docs/integrations.md", "model:"): "a Hugging Face Hub id: it needs the network or that "
    "model in the HF cache (tests/models/test_hub_ids.py resolves Hub ids offline from a local cache)",
}


def test_every_config_block_is_run_or_a_listed_fragment() -> None:
    found = set(config_blocks())
    assert not set(RUNS) & set(FRAGMENTS)
    unlisted = found - set(RUNS) - set(FRAGMENTS)
    assert not unlisted, (f"config blocks neither run nor listed as fragments: {unlisted}; add "
                          "each to RUNS (how the text says to run it) or FRAGMENTS (why not)")
    gone = (set(RUNS) | set(FRAGMENTS)) - found
    assert not gone, f"listed blocks no longer in the docs: {gone}"
    assert all(len(reason) > 20 for reason in FRAGMENTS.values())


def _run(tmp_path: Path, where: tuple[str, str], overrides: list[str]) -> None:
    run, block = RUNS[where], config_blocks()[where]
    for name, text in run.files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / run.config).write_text(block)
    env = {}
    if run.pythonpath_cwd:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (".", os.environ.get("PYTHONPATH")) if p)
    shown = jaxrl(tmp_path, "config", "--config", run.config, *overrides, **env)
    assert shown.returncode == 0, shown.stderr[-3000:]
    done = jaxrl(tmp_path, *run.command, *overrides, **env)
    assert done.returncode == 0, f"{where}: {done.stderr[-3000:]}"
    if run.writes:
        assert (tmp_path / run.writes / "manifest.json").exists(), (run.writes, done.stdout)


# The README's GSM8K block and the environments page's run in the default suite; the other
# docs pages' blocks (the same `generate` stage on other task sources, ≈ 12 s each) and the
# README's SmolLM2 episode block with the slow tests.
SLOW_RUNS = {("docs/tasks.md", "data:"), ("docs/custom_tasks.md", "data:"),
             ("README.md", "data: {task: countdown, chat_template: true}")}


@pytest.mark.parametrize("where", [pytest.param(w, marks=pytest.mark.slow) if w in SLOW_RUNS else w
                                   for w in sorted(RUNS)], ids=lambda w: f"{w[0]}:{w[1]}")
def test_config_block_runs_its_first_stage(tmp_path: Path, where: tuple[str, str]) -> None:
    _run(tmp_path, where, RUNS[where].overrides)


@pytest.mark.slow
def test_readme_smollm2_config_runs_as_written(tmp_path: Path) -> None:
    """The README's own config, no override: the packaged SmolLM2 samples 4 completions for
    each of the two questions of train.jsonl."""
    _run(tmp_path, ("README.md", "name: my_gsm8k"), [])
    from jaxrl_llm.data.shards import read_manifest

    assert read_manifest(tmp_path / "runs/my_gsm8k/records").num_records == 8
