"""Ctrl-C while a compiled extension initialises, or while a library would catch it
(jaxrl_llm/core/signals.py `supervise`).

Python raises `KeyboardInterrupt` at the next bytecode, which can be inside jaxlib's MLIR
bindings while they build their enums: the extension is left half-built and the process
aborts (SIGABRT) or segfaults instead of exiting 130 — found by the reliability sweep
(`curate`, Ctrl-C after 0.43 s, exit -11). These tests put the Ctrl-C exactly there.

Without a guard the same script (`import jax` under `_AT_MLIR_INIT`) aborted (-6) in 24 of
24 runs here, but once, in a CI run on a loaded machine, it exited 0 with no output: the
`KeyboardInterrupt` was swallowed and the Ctrl-C lost. Now the command runs in a worker thread
and the main thread takes the signal, so no `KeyboardInterrupt` reaches the import or the
library: `test_a_ctrl_c_a_library_would_swallow_still_exits_130`.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Sends SIGINT to itself at the first enum the `_mlir` extension creates while it initialises.
_AT_MLIR_INIT = textwrap.dedent("""
    import os, signal, sys, threading
    state = {"armed": False, "fired": False}

    class Arm:
        def find_spec(self, name, path=None, target=None):
            if name == "jaxlib.mlir._mlir_libs._mlir":
                state["armed"] = True
            return None

    def profile(frame, event, arg):
        if state["armed"] and not state["fired"] and event == "call" \\
                and frame.f_code.co_name == "_create_":
            state["fired"] = True
            sys.setprofile(None)
            print("fired", flush=True)
            os.kill(os.getpid(), signal.SIGINT)

    sys.meta_path.insert(0, Arm())
    sys.setprofile(profile)
    threading.setprofile(profile)  # the command runs in a worker thread
    {body}
    print("finished", "fired" if state["fired"] else "not fired", flush=True)
    sys.exit(code)
""")


def _run(body: str, cwd: Path) -> subprocess.CompletedProcess:
    script = _AT_MLIR_INIT.replace("{body}", body)
    return subprocess.run([sys.executable, "-c", script], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def test_ctrl_c_inside_jaxlib_init_exits_130_through_the_cli(tmp_path):
    config = REPO / "configs" / "generate_cpu_arithmetic.yaml"
    # `score` imports JAX before it reads its records (the `config` command no longer imports
    # JAX at all); the records are absent, so a lost Ctrl-C ends in exit 2, not in a long run
    missing = str(tmp_path / "no_records")
    proc = _run(f"from jaxrl_llm.cli import main\ncode = main(['score', '--config', {str(config)!r}, "
                f"'data.records={missing}'])", tmp_path)
    assert proc.returncode == 130, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert proc.stdout.splitlines() == ["fired"]  # and the command never got further
    assert "interrupted (Ctrl-C)" in proc.stderr
    assert "Traceback" not in proc.stderr and "ImportError" not in proc.stderr


def _supervised(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run `command` (the body of a function) as `cli.main` runs a command."""
    script = "import os, signal, sys, time\nfrom jaxrl_llm.core.signals import supervise\n" \
        "def command():\n" + textwrap.indent(textwrap.dedent(command), "    ") + \
        "\nsys.exit(supervise(command))\n"
    return subprocess.run([sys.executable, "-c", script], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_a_ctrl_c_a_library_would_swallow_still_exits_130(tmp_path):
    proc = _supervised("""
        try:  # as a library's broad `except` would: a KeyboardInterrupt would be dropped
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)
            print("slept through the Ctrl-C", flush=True)
        except BaseException:
            print("swallowed", flush=True)
        return 0
    """, tmp_path)
    assert (proc.returncode, proc.stdout) == (130, ""), proc.stdout + proc.stderr
    assert "interrupted (Ctrl-C)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_ctrl_c_inside_an_import_exits_130_without_finishing_it(tmp_path):
    (tmp_path / "slow_module.py").write_text(textwrap.dedent("""
        import os, signal, time
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the middle of this module's import
        time.sleep(30)
        print("imported", flush=True)
    """))
    proc = _supervised("import slow_module\nprint('after the import', flush=True)\nreturn 0",
                       tmp_path)
    assert (proc.returncode, proc.stdout) == (130, ""), proc.stdout + proc.stderr
    assert "interrupted (Ctrl-C)" in proc.stderr
