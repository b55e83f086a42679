"""A CPU machine with the `tpu` extra installed (README's test line installs it): a command
that starts JAX prints none of libtpu's "no TPU here" noise, and a TPU VM is left alone."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from jaxrl_llm.cli import quiet_libtpu_without_tpu
from tests.faults.harness import command
from tests.user.test_memory_check import TINY
from tests.xla_flags import ONE_DEVICE

LIBTPU_NOISE = ("Failed to find host bounds", "TPU_WORKER_HOSTNAMES", "InitGoogle")
needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="the tpu extra (libtpu) is not installed")


@needs_libtpu
def test_a_command_on_a_cpu_host_prints_no_libtpu_noise(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_PLATFORMS", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES")}
    env["XLA_FLAGS"] = ONE_DEVICE
    # the noise is real without the fix: plain JAX on this host prints it
    plain = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                           cwd=tmp_path, capture_output=True, text=True, timeout=300)
    if not any(s in plain.stderr for s in LIBTPU_NOISE):
        pytest.skip("this libtpu/JAX pair is quiet on its own here")
    # `plan` of a tiny config on this host's devices starts JAX's backend and compiles
    (tmp_path / "c.yaml").write_text(TINY)
    done = subprocess.run(command(["plan", "--config", "c.yaml", "plan.num_devices=1"]),
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert not any(s in done.stderr for s in LIBTPU_NOISE), done.stderr


def test_left_alone_when_the_platform_or_libtpu_variables_are_given():
    for given in ({"JAX_PLATFORMS": "cpu"}, {"TPU_ACCELERATOR_TYPE": "v5litepod-8"},
                  {"TPU_WORKER_HOSTNAMES": "10.0.0.1,10.0.0.2"}):
        env = dict(given)
        assert quiet_libtpu_without_tpu(env) is False
        assert env == given
