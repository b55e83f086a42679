"""`jaxrl-llm <command>`: every stage of the flow as its own command.

Each command is a thin module of `jaxrl_llm/commands/` (the stage's name), which exposes
`add_arguments(parser: argparse.ArgumentParser) -> None` and `run(args) -> int | None` and
calls the library packages.
Modules are imported only when their command runs, so `--help` stays fast and a command's
heavy dependencies (jax, transformers, matplotlib) load only when needed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence

from jaxrl_llm.commands import COMMANDS

# Commands that place arrays on devices: on a TPU pod / SLURM job / JAXRL_* launch every host
# runs the same command, which must join the multi-host job before touching a device.
DEVICE_COMMANDS = frozenset({"generate", "score", "train", "export", "evaluate", "iterate",
                             "online"})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxrl-llm",
        description="Off-policy RL fine-tuning of LLMs in JAX/Flax (TOPR, FPA, PKPO).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_text in COMMANDS.items():
        module_name = f"jaxrl_llm.commands.{name}"
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        cmd.set_defaults(_module=module_name)
        # Argument definitions are cheap; importing the module pulls in only what it imports.
        importlib.import_module(module_name).add_arguments(cmd)
    return parser


def quiet_libtpu_without_tpu(env: dict[str, str] | os._Environ = os.environ) -> bool:
    """With libtpu installed (the `tpu` extra) on a host without TPU chips, JAX still loads
    libtpu, which prints "Failed to find host bounds…" and an E0000 TPU_WORKER_HOSTNAMES error
    before falling back to CPU/GPU. Telling libtpu it is alone (what `plan` does to compile
    for a pod) silences it; a TPU VM, JAX_PLATFORMS set, or libtpu's variables already set
    are left alone. Returns True when it set them."""
    if env.get("JAX_PLATFORMS") or "TPU_ACCELERATOR_TYPE" in env or "TPU_WORKER_HOSTNAMES" in env:
        return False
    if importlib.util.find_spec("libtpu") is None:
        return False
    try:
        from jax._src import hardware_utils  # jax's own TPU probe (PCI vendor ids)

        chips, _ = hardware_utils.num_available_tpu_chips_and_device_id()
    except Exception:  # a JAX without it: change nothing rather than guess
        return False
    if chips:
        return False
    env["TPU_ACCELERATOR_TYPE"] = "v5litepod-4"
    env["TPU_WORKER_HOSTNAMES"] = "localhost"
    return True


def main(argv: Sequence[str] | None = None) -> int:
    from jaxrl_llm.core.signals import supervise

    # The command runs in a worker thread; this thread takes Ctrl-C and SIGTERM (signals.py).
    return supervise(lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    # transformers (tokenizers, configs) says "PyTorch was not found. Models won't be
    # available" on import without torch: true and irrelevant here (our models are JAX).
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    parser = build_parser()
    # `key=value` overrides may sit anywhere among the flags (`train --config C a=1 --no-progress
    # b=2`): argparse stops the positional list at the first flag, so collect the rest here.
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if "=" not in a or a.startswith("-")]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*(args.overrides or []), *extra]
    if args.command not in {"config", "data", "report"}:  # the others may start a JAX backend
        quiet_libtpu_without_tpu()
    module = importlib.import_module(args._module)
    from jaxrl_llm.core.errors import ConfigError, ModelFileError
    from jaxrl_llm.core.signals import Interrupted
    from jaxrl_llm.data.records import RecordError

    try:
        if args.command in DEVICE_COMMANDS:
            from jaxrl_llm.parallel.distributed import initialize

            initialize()  # no-op on a single host (parallel/distributed.py)
            from jaxrl_llm.parallel.compile_cache import enable_compilation_cache

            enable_compilation_cache()  # TPU/GPU by default (parallel/compile_cache.py)
        code = module.run(args)
    # Bad config, input data, model/tokenizer file or a path that does not exist: no traceback.
    except (ConfigError, RecordError, ModelFileError, FileNotFoundError) as err:
        print(f"jaxrl-llm {args.command}: {err}", file=sys.stderr)
        return 2
    except Interrupted as err:  # a stage stopped at its safe point on a signal (signals.py)
        print(f"jaxrl-llm {args.command}: {err}", file=sys.stderr)
        return err.exit_code
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
