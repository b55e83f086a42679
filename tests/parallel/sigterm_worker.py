"""One process of the two-process SIGTERM test: `python sigterm_worker.py CONFIG PROGRESS DELAY`.

Runs the real `jaxrl-llm train --config CONFIG` (which joins the job through the JAXRL_*
variables the test sets) and exits with its code. Each step writes the step number to
PROGRESS (so the test knows when to send SIGTERM) and sleeps DELAY seconds (so the run is
still going when the hosts agree on the stop step).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.pop("XLA_FLAGS", None)


def main() -> int:
    config, progress, delay = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
    from jaxrl_llm.cli import main as cli_main
    from jaxrl_llm.train import trainer as trainer_module

    base = trainer_module.Trainer

    def on_step(step: int, trainer: object) -> None:
        progress.write_text(str(step))
        time.sleep(delay)

    class ThrottledTrainer(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: object, **kwargs: object) -> None:
            kwargs["on_step"] = on_step
            super().__init__(*args, **kwargs)

    trainer_module.Trainer = ThrottledTrainer  # what `jaxrl-llm train` instantiates
    return cli_main(["train", "--config", config, "--no-progress"])


if __name__ == "__main__":
    sys.exit(main())
