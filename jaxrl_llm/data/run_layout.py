"""Where an `iterate` run keeps each iteration, and when an iteration's stage is complete.

Both sides of an iterate run read this: the trainer (`flows/iterate.py`) and the vLLM host
(`generate/vllm_host.py`), which may run on another machine and share only the run
directory (a local path, NFS or `gs://`). Iteration i (1-based) samples from π_{i−1}:

    run_dir/iter_0/export      π_0 as an HF directory (written for vLLM when the configured
                               model is not one already: a GGUF, a random model)
    run_dir/iter_i/records     samples of π_{i−1} (complete once its manifest.json exists)
    run_dir/iter_i/export      π_i, exported after training
    run_dir/iter_i/stages.json which of the iteration's stages completed (`StageLog`)
"""

from __future__ import annotations

import json
from typing import Any

from etils import epath

from jaxrl_llm.core.atomic import atomic_write_text
from jaxrl_llm.core.paths import as_path

STAGES_FILE = "stages.json"


class StageLog:
    """`iter_i/stages.json`: which stages completed, with their outputs and timings."""

    def __init__(self, directory: epath.Path) -> None:
        self.path = as_path(directory) / STAGES_FILE
        self.stages: dict[str, Any] = (
            json.loads(self.path.read_text()) if self.path.exists() else {}
        )

    def done(self, stage: str) -> bool:
        return stage in self.stages

    def mark(self, stage: str, info: dict[str, Any]) -> None:
        self.stages[stage] = info
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path, json.dumps(self.stages, indent=2))


def iteration_dir(config: Any, index: int) -> epath.Path:
    return as_path(config.run_dir) / f"iter_{index}"


def prompt_offset(config: Any, index: int) -> int:
    """Index in the split of iteration `index`'s first prompt (fresh prompts each iteration)."""
    return (index - 1) * config.data.num_prompts if config.iterate.fresh_prompts else 0


def sampling_seed(config: Any, index: int) -> int:
    """The seed iteration `index` samples with (either backend)."""
    return config.seed * 1000 + index


def hf_model_path(config: Any) -> str | None:
    """The configured model when it is already what vLLM loads (an HF directory or hub id)."""
    return config.model.path if config.model.source == "hf" and config.model.path else None


def policy_dir(config: Any, index: int) -> str:
    """The HF directory (or hub id) holding π_index."""
    if index == 0 and hf_model_path(config) is not None:
        return str(hf_model_path(config))
    return str(iteration_dir(config, index) / "export")


def policy_ready(config: Any, index: int) -> bool:
    """Whether π_index's export is complete: its iteration logged the export stage (the
    export directory is renamed into place whole before that)."""
    if index == 0 and hf_model_path(config) is not None:
        return True
    return StageLog(iteration_dir(config, index)).done("export")
