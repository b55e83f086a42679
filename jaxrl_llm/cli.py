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


def main(argv: Sequence[str] | None = None) -> int:
    from jaxrl_llm.core.signals import EXIT_SIGINT, CtrlCOutsideImports

    # Ctrl-C while jaxlib or array_record initialise crashed the process (SIGSEGV/SIGABRT)
    # instead of exiting 130: a Ctrl-C that lands inside an import is re-delivered after it.
    with CtrlCOutsideImports() as ctrl_c:
        try:
            code = _main(argv)
            if code != EXIT_SIGINT:  # (130: the command reported its Ctrl-C itself)
                ctrl_c.raise_pending()
            return code
        # KeyboardInterrupt: Ctrl-C before the command started (nothing written). Another
        # error after the guard raised one: a library turned that Ctrl-C into its own error
        # (JAX: a ValueError when it lands in a static argument's __eq__ in a jit cache lookup).
        except (KeyboardInterrupt, Exception) as err:
            if not isinstance(err, KeyboardInterrupt) and not ctrl_c.raised:
                raise
            print("jaxrl-llm: interrupted (Ctrl-C)", file=sys.stderr)
            return EXIT_SIGINT


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
    module = importlib.import_module(args._module)
    from jaxrl_llm.core.errors import ConfigError, ModelFileError
    from jaxrl_llm.core.signals import EXIT_SIGINT, Interrupted, exit_code, last_signal
    from jaxrl_llm.data.records import RecordError
    from jaxrl_llm.train.preemption import Preempted

    try:
        if args.command in DEVICE_COMMANDS:
            from jaxrl_llm.parallel.distributed import initialize

            initialize()  # no-op on a single host (parallel/distributed.py)
        code = module.run(args)
    # Bad config, input data, model/tokenizer file or a path that does not exist: no traceback.
    except (ConfigError, RecordError, ModelFileError, FileNotFoundError) as err:
        print(f"jaxrl-llm {args.command}: {err}", file=sys.stderr)
        return 2
    except Preempted as err:  # SIGTERM / Ctrl-C: checkpointed; exits as `train` does
        print(f"jaxrl-llm {args.command}: {err}", file=sys.stderr)
        return exit_code(last_signal())
    except Interrupted as err:  # generate / score stopped at a batch boundary (signals.py)
        print(f"jaxrl-llm {args.command}: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:  # Ctrl-C outside a stage's safe points: nothing half-written
        print(f"jaxrl-llm {args.command}: interrupted (Ctrl-C)", file=sys.stderr)
        return EXIT_SIGINT
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
