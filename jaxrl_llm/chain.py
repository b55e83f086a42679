"""The stage chain a shipped config documents, read from its header comment.

Every file in `configs/` states, in its leading comment, the exact commands that run it, one
stage per line after a `# Stages` line:

    # Stages (from the repository root):
    #   generate: launch/vllm_host.sh configs/X.yaml
    #   score:    jaxrl-llm score --config configs/X.yaml
    #   curate:   jaxrl-llm curate --config configs/X.yaml --records runs/x/scored
    #   ...

`launch/*.sh` run those lines (`python -m jaxrl_llm.chain CONFIG` prints them, `--check` first
verifies them), so the documentation and the launchers cannot drift apart; `check_chain`
verifies that each stage finds every key it reads set and that each stage reads what the one
before it wrote.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxrl_llm.cli import build_parser
from jaxrl_llm.commands.config import schema_class
from jaxrl_llm.config import load_config
from jaxrl_llm.core.paths import absolute

STAGES = ("generate", "score", "curate", "train", "export", "evaluate", "iterate", "quickstart",
          "online")
# Where each stage runs: `generate` with vLLM needs the GPU host, the rest the training mesh.
GENERATE_HOST_STAGES = frozenset({"generate"})
_HEADER = re.compile(r"^#\s*Stages\b")
_LINE = re.compile(r"^#\s+([a-z_]+):\s+(\S.*?)\s*$")


@dataclass(frozen=True)
class Stage:
    name: str
    argv: list[str]  # the command as written (launcher or `jaxrl-llm ...`)

    @property
    def text(self) -> str:
        return shlex.join(self.argv)


def read_stages(path: str | Path) -> list[Stage]:
    """The `# Stages` block of a config file's leading comment, in order."""
    stages: list[Stage] = []
    inside = False
    for line in Path(path).read_text().splitlines():
        if not line.startswith("#"):
            break  # the leading comment ends at the first YAML line
        if _HEADER.match(line):
            inside = True
            continue
        match = _LINE.match(line) if inside else None
        if match and match.group(1) in STAGES:
            stages.append(Stage(match.group(1), shlex.split(match.group(2))))
        elif inside and stages:
            inside = False
    if not stages:
        raise ValueError(f"{path}: no '# Stages' block in the leading comment (one "
                         f"'#   <stage>: <command>' line per stage, stages {STAGES})")
    return stages


def _flag(argv: Sequence[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _norm(path: str | None) -> str | None:
    return None if path is None else absolute(path).rstrip("/")


def _load(path: Path, stage: str) -> Any:
    schema = {"iterate": "iterate", "quickstart": "quickstart", "online": "online"}.get(
        stage, "experiment")
    return load_config(path, schema=schema_class(schema))


def check_chain(path: str | Path) -> list[str]:
    """Problems with a config's documented chain (empty when every stage can run): commands
    that do not parse, keys a stage reads that are unset, a stage reading other than what the
    previous stage wrote."""
    path = Path(path)
    problems: list[str] = []
    outputs: dict[str, str | None] = {}  # stage -> directory it writes
    parser = build_parser()
    for stage in read_stages(path):
        argv, where = stage.argv, f"{path} stage {stage.name!r} ({stage.text})"
        config_arg = _flag(argv, "--config") or (argv[1] if len(argv) > 1 and
                                                 argv[0].endswith(".sh") else None)
        if stage.name != "export" and (config_arg is None
                                       or Path(config_arg).name != path.name):
            problems.append(f"{where}: must read this config (--config .../{path.name})")
            continue
        if argv[0] == "jaxrl-llm":
            try:
                parser.parse_args(argv[1:])
            except SystemExit:
                problems.append(f"{where}: not a valid jaxrl-llm command line")
                continue
        elif argv[0] != "launch/vllm_host.sh":
            problems.append(f"{where}: runs {argv[0]!r}; expected jaxrl-llm or "
                            f"launch/vllm_host.sh")
            continue
        config = None if stage.name == "export" else _load(path, stage.name)
        problems += [f"{where}: {p}" for p in _stage_problems(stage, config, outputs)]
    return problems


def _stage_problems(stage: Stage, config: Any, outputs: dict[str, str | None]) -> list[str]:
    argv, name = stage.argv, stage.name
    out: list[str] = []

    def reads(value: str | None, key: str, previous: str) -> None:
        if value is None:
            out.append(f"reads nothing: set {key}")
        elif previous in outputs and _norm(value) != _norm(outputs[previous]):
            out.append(f"reads {value} but the {previous} stage writes {outputs[previous]}")

    if name == "generate":
        written = _flag(argv, "--out") or config.generate.output or config.data.records
        if written is None:
            out.append("writes nowhere: set generate.output or data.records")
        if (argv[0].endswith(".sh") or config.generate.backend == "vllm") and not config.model.path:
            out.append("vLLM samples from an HF directory: set model.path")
        outputs[name] = written
    elif name == "score":
        records = _flag(argv, "--records") or config.data.records
        reads(records, "data.records (where generate writes unless generate.output is set)",
              "generate")
        written = _flag(argv, "--out") or config.generate.score_output
        outputs[name] = written or (records.rstrip("/") + "-scored" if records else None)
    elif name == "curate":
        reads(_flag(argv, "--records") or config.data.records, "--records (the scored records)",
              "score")
        outputs[name] = _flag(argv, "--out") or config.data.curated
        if outputs[name] is None:
            out.append("writes nowhere: set data.curated")
    elif name == "train":
        records = _flag(argv, "--records") or config.data.curated or config.data.records
        reads(records, "data.curated", "curate")
        outputs[name] = config.run_dir
    elif name == "export":
        reads(_flag(argv, "--checkpoint"), "--checkpoint RUN_DIR", "train")
        outputs[name] = _flag(argv, "--out")
    elif name == "evaluate":
        model = _flag(argv, "--model")
        if model is None and not (config.model.path or config.model.source != "hf"):
            out.append("evaluates nothing: pass --model or set model.path")
        elif model is not None:
            reads(model, "--model", "export")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxrl_llm.chain",
        description="print (or check) the stage commands a config documents, one per line")
    parser.add_argument("config")
    parser.add_argument("--skip", default="", help="comma-separated stages to leave out")
    parser.add_argument("--only", default="", help="comma-separated stages to keep")
    parser.add_argument("--check", action="store_true", help="verify the chain; print nothing")
    parser.add_argument("--names", action="store_true", help="prefix each line with STAGE<tab>")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="appended to every stage that reads the config")
    args = parser.parse_args(argv)
    if args.check:
        problems = check_chain(args.config)
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    skip = set(filter(None, args.skip.split(",")))
    only = set(filter(None, args.only.split(",")))
    for stage in read_stages(args.config):
        if stage.name in skip or (only and stage.name not in only):
            continue
        extra = list(args.overrides) if stage.name != "export" else []
        line = shlex.join(stage.argv + extra)
        print(f"{stage.name}\t{line}" if args.names else line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
