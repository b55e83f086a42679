"""The stage commands a user runs, one thin module each: `jaxrl-llm <name>` (see `cli.py`).

    config  plan  data  generate  score  curate  train  export  evaluate  report  iterate
    quickstart  (and `vllm_host`: `python -m jaxrl_llm.generate.vllm` on a GPU host)

Each module exposes `add_arguments(parser)` and `run(args) -> int | None` and holds only
argument parsing, configuration loading and overrides, printing, and calls into the library
packages below it (`generate`, `train`, `data`, `eval`, ...). This is the top layer of the
import graph: it may import anything, and nothing in the library imports it.
"""
