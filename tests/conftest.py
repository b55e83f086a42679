"""Test-wide set-up: CPU only, 8 fake host devices for the sharding tests.

XLA reads these flags once, when jax is first imported, so they are set here, before any test
module imports jax. Single-device tests are unaffected (arrays live on device 0).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
