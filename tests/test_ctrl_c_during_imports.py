"""Ctrl-C while a compiled extension initialises (jaxrl_llm/core/signals.py `CtrlCOutsideImports`).

Python raises `KeyboardInterrupt` at the next bytecode, which can be inside jaxlib's MLIR
bindings while they build their enums: the extension is left half-built and the process
aborts (SIGABRT) or segfaults instead of exiting 130 — found by the reliability sweep
(`curate`, Ctrl-C after 0.43 s, exit -11). These tests put the Ctrl-C exactly there.

Without the guard the same script (`import jax` under `_AT_MLIR_INIT`) aborted (-6) in 24 of
24 runs here, but once, in a CI run on a loaded machine, it exited 0 with no output: the
`KeyboardInterrupt` was swallowed and the Ctrl-C lost. Where Python processes the signal
depends on timing, so that control is not a test; the guard's answer to the second outcome is
`test_a_swallowed_ctrl_c_is_raised_again_at_the_end`.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Sends SIGINT to itself at the first enum the `_mlir` extension creates while it initialises.
_AT_MLIR_INIT = textwrap.dedent("""
    import os, signal, sys
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
            os.kill(os.getpid(), signal.SIGINT)

    sys.meta_path.insert(0, Arm())
    sys.setprofile(profile)
    {body}
    print("fired" if state["fired"] else "not fired", flush=True)
    sys.exit(code)
""")


def _run(body: str, cwd: Path) -> subprocess.CompletedProcess:
    script = _AT_MLIR_INIT.replace("{body}", body)
    return subprocess.run([sys.executable, "-c", script], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def test_ctrl_c_inside_jaxlib_init_exits_130_through_the_cli(tmp_path):
    config = REPO / "configs" / "generate_cpu_arithmetic.yaml"
    proc = _run(f"from jaxrl_llm.cli import main\ncode = main(['config', '--config', {str(config)!r}])",
                tmp_path)
    assert proc.returncode == 130, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "fired" in proc.stdout.splitlines()[-1]
    assert "interrupted (Ctrl-C)" in proc.stderr
    assert "Traceback" not in proc.stderr and "ImportError" not in proc.stderr


def test_a_swallowed_ctrl_c_is_raised_again_at_the_end(tmp_path):
    script = textwrap.dedent("""
        import os, signal, time
        from jaxrl_llm.core.signals import CtrlCOutsideImports
        with CtrlCOutsideImports(retry_s=60.0) as guard:
            try:  # as a library's broad `except` would: the KeyboardInterrupt is dropped
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(30)
                print("no KeyboardInterrupt")
            except BaseException:
                print("swallowed", flush=True)
            try:
                guard.raise_pending()
                print("lost")
            except KeyboardInterrupt:
                print("raised at the end")
            guard.raise_pending()  # once: nothing is left to raise
            print("done")
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.stdout.splitlines() == ["swallowed", "raised at the end", "done"], \
        proc.stdout + proc.stderr


def test_a_ctrl_c_inside_an_import_arrives_after_it(tmp_path):
    (tmp_path / "slow_module.py").write_text(textwrap.dedent("""
        import os, signal
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the middle of this module's import
        total = sum(range(2_000_000))
        COMPLETE = True
    """))
    script = textwrap.dedent("""
        import sys, time
        from jaxrl_llm.core.signals import CtrlCOutsideImports
        with CtrlCOutsideImports():
            try:
                import slow_module
                print("imported", slow_module.COMPLETE, flush=True)
                time.sleep(30)  # the re-delivered Ctrl-C ends this within ~0.05 s
                print("no Ctrl-C")
            except KeyboardInterrupt:
                print("KeyboardInterrupt after the import", "slow_module" in sys.modules)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.stdout.splitlines() == ["imported True", "KeyboardInterrupt after the import True"], \
        proc.stdout + proc.stderr


def test_a_ctrl_c_still_waiting_when_the_command_ends_is_not_lost(tmp_path):
    (tmp_path / "kill_at_end.py").write_text(textwrap.dedent("""
        import os, signal
        os.kill(os.getpid(), signal.SIGINT)
    """))
    script = textwrap.dedent("""
        from jaxrl_llm.core.signals import CtrlCOutsideImports
        with CtrlCOutsideImports(retry_s=60.0) as guard:  # no re-delivery before the end
            import kill_at_end
            try:
                guard.raise_pending()
                print("lost")
            except KeyboardInterrupt:
                print("raised at the end")
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.stdout.strip() == "raised at the end", proc.stdout + proc.stderr
    assert proc.returncode == 0
