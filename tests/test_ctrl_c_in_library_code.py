"""Ctrl-C whose `KeyboardInterrupt` a library would turn into its own error (jaxrl_llm/core/signals.py
`supervise`: the command runs in a worker thread and no `KeyboardInterrupt` reaches it).

Found by the reliability sweep (`online mid-round`, Ctrl-C after 4.11 s, exit 1): the Ctrl-C
landed in a static argument's `__eq__` while JAX looked up its jit cache (the sampler's
`fused_layer_params(graphdef, ...)`), and JAX re-raised it as `ValueError: static arguments
should be comparable using __eq__`, so the command died with a traceback instead of exiting
130. This test puts the Ctrl-C exactly there, through the real `jaxrl-llm online`: the
Ctrl-C is only noted there, the round finishes, and `online` stops after it with a checkpoint
and exit 130.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from tests.faults.online_stage import ONLINE_YAML
from tests.xla_flags import ONE_DEVICE

# Sends SIGINT to itself at the first `__eq__` that JAX's jit cache calls from the sampler.
_AT_STATIC_ARG_EQ = textwrap.dedent("""
    import os, signal, sys, threading
    state = {"fired": False}

    def profile(frame, event, arg, state=state):  # bound: the module's globals go at exit
        caller = frame.f_back
        if not state["fired"] and event == "call" and frame.f_code.co_name == "__eq__" \\
                and caller is not None and caller.f_code.co_name == "generate" \\
                and caller.f_code.co_filename.endswith(("sampler.py", "continuous.py")):
            state["fired"] = True
            sys.setprofile(None)
            print("fired", flush=True)
            os.kill(os.getpid(), signal.SIGINT)

    sys.setprofile(profile)
    threading.setprofile(profile)  # the command runs in a worker thread (signals.supervise)
    from jaxrl_llm.cli import main
    code = main(["online", "--config", "online.yaml", "--no-progress"])
    print("finished", "fired" if state["fired"] else "not fired", flush=True)
    sys.exit(code)
""")


def _single_host_env() -> dict[str, str]:
    """This process's environment on one CPU device, without the launcher variables that
    `parallel.distributed.detect_cluster` reads (earlier in-process tests, e.g. libtpu's
    `plan` compiles, can leave TPU ones behind, and `online` would then try to join a pod)."""
    launcher = ("SLURM_", "TPU_", "MEGASCALE_", "CLOUD_TPU_", "JAXRL_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher)}
    return {**env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ONE_DEVICE}


@pytest.mark.slow  # a CLI subprocess interrupted mid-compile (~14 s): the default budget
def test_ctrl_c_in_a_jit_cache_lookup_exits_130(tmp_path):
    (tmp_path / "online.yaml").write_text(ONLINE_YAML)
    proc = subprocess.run([sys.executable, "-c", _AT_STATIC_ARG_EQ], cwd=tmp_path,
                          env=_single_host_env(), capture_output=True, text=True, timeout=300)
    assert proc.stdout.splitlines()[-1:] == ["finished fired"], (
        proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert proc.returncode == 130, (proc.returncode, proc.stderr[-3000:])
    assert "stopping after the current round and its checkpoint" in proc.stderr
    assert re.search(r"online: stopped by Ctrl-C \(SIGINT\) after round \d+ .*; checkpoint "
                     r"\S+/run/checkpoints/\d+; run the same command to resume", proc.stderr), \
        proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "ValueError" not in proc.stderr, proc.stderr[-3000:]
