"""The commands a user runs, one thin module each: `jaxrl-llm <name>` (see `cli.py`).

`COMMANDS` below is the list of every command, in the order of the flow; `cli.py` builds its
parser from it. `vllm` has sub-actions (`install`, `check`, `generate` in `vllm_generate.py`,
`host`).

Each module exposes `add_arguments(parser)` and `run(args) -> int | None` and holds only
argument parsing, configuration loading and overrides, printing, and calls into the library
packages below it (`generate`, `train`, `data`, `eval`, ...). This is the top layer of the
import graph: it may import anything, and nothing in the library imports it. Importing this
package imports none of its modules (`cli.py` imports a command's module when it builds the
parser), so `jaxrl-llm --help` stays fast.
"""

from __future__ import annotations

# name -> one-line help; the command is implemented by `jaxrl_llm.commands.<name>`.
COMMANDS: dict[str, str] = {
    "config": "print the resolved configuration of any config (experiment, iterate, quickstart)",
    "plan": "compile the train step for a mesh/TPU topology; per-device memory and FLOPs",
    "data": "inspect record shards: show | stats | export-jsonl",
    "generate": "sample completions (jax or vllm) and write scored records",
    "score": "write μ per-token log-probs with the trainer's numerics",
    "curate": "select a training set from records (curation, group transforms)",
    "report": "PNG plots and a Markdown summary of a run directory",
    "train": "train on scored records; resumes from the latest checkpoint",
    "export": "write a training checkpoint as an HF directory (atomic)",
    "evaluate": "pass@k, pass@1 ± SE, maj@K ± 2 SE, invalid rate -> eval.json",
    "iterate": "generate → score → curate → train → export → evaluate, per iteration",
    "online": "sample → reward → update in one program, with a staleness knob; resumes",
    "quickstart": "the whole flow on CPU in minutes: SFT, TOPR, before/after table",
    "vllm": "vLLM: install (GPU or CPU build) | check | generate (records once) | host (an "
            "iterate run's sampler)",
}
