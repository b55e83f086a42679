"""Test-wide set-up: CPU only, 8 fake host devices for the sharding tests, fast compiles.

XLA reads these flags once, when jax is first imported, so they are set here, before any test
module imports jax. Single-device tests are unaffected (arrays live on device 0).
"""

import os

import pytest  # imports no jax
from hypothesis import settings  # imports no jax

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# vLLM (CPU build) on the CPU too: with libtpu installed (the `tpu` extra) vLLM would detect a
# TPU platform as well and refuse to import (generate/vllm_env.py sets this for its engines).
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
# float32 dots at full precision on a GPU run (JAX_PLATFORMS=cuda), which otherwise uses TF32:
# the float32 tolerances below fail there (7 attention tests on an H100). Not on CPU, where it
# changes nothing for CPU dots but would reach the TPU compiler of `jaxrl-llm plan` (bf16 splash).
if os.environ["JAX_PLATFORMS"] != "cpu":
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
_FLAGS = {
    "xla_force_host_platform_device_count": "8",
    # The tests' tiny models spend most of their time compiling: LLVM's cheapest optimisation
    # level compiles ~3.5x faster here and the default run drops from ~12 to 8-10 minutes. Dots
    # still call the same GEMM libraries; set the flag yourself to test other levels.
    "xla_backend_optimization_level": "0",
}
for _name, _value in _FLAGS.items():
    if _name not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{_name}={_value}".strip()

# Property tests draw the same examples on every run, so CI results are reproducible; set
# HYPOTHESIS_PROFILE=explore for fresh random draws when hunting for bugs.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("explore", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_addoption(parser):
    # Give it as --reliability-report=PATH: with a space, an existing PATH is taken for a test
    # path by pytest's early parse, which then never loads this file and rejects the option.
    parser.addoption("--reliability-report", default=None, metavar="PATH",
                     help="write the reliability table (tests/reliability.py) to PATH at the end")


# The reliability table reaches the session's controller through the test reports, so it is
# the same whether the tests run in this process or in pytest-xdist workers (`-n 2`): each
# report carries the rows its test recorded as user properties, which xdist sends back.
_ROW_KEY = "reliability_row"
_rows_reported = 0
_REPORTED: list = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    global _rows_reported
    outcome = yield
    from tests.reliability import ROWS

    report = outcome.get_result()
    for row in ROWS[_rows_reported:]:
        report.user_properties.append((_ROW_KEY, dict(vars(row))))
    _rows_reported = len(ROWS)


def pytest_runtest_logreport(report):
    from tests.reliability import Row

    _REPORTED.extend(Row(**value) for key, value in report.user_properties if key == _ROW_KEY)


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--reliability-report")
    if path and not hasattr(session.config, "workerinput"):  # the controller writes it
        from tests.reliability import render

        with open(path + ".tmp", "w") as f:
            f.write(render(_REPORTED))
        os.replace(path + ".tmp", path)  # atomic: a reader never sees half a table
