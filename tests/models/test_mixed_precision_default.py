"""`model.compute_dtype: auto` (the default): bf16 compute on accelerators with fp32 master
weights, fp32 on CPU; `plan` resolves it for the target platform, not the planning machine."""

from __future__ import annotations

import jax.numpy as jnp

from jaxrl_llm.config import load_config
from jaxrl_llm.models.config import resolve_compute_dtype
from jaxrl_llm.weights.loading import decoder_config


def test_auto_is_bf16_on_accelerators_fp32_on_cpu() -> None:
    assert resolve_compute_dtype("auto", "tpu") == "bfloat16"
    assert resolve_compute_dtype("auto", "gpu") == "bfloat16"
    assert resolve_compute_dtype("auto", "cpu") == "float32"
    assert resolve_compute_dtype("float32", "tpu") == "float32"  # explicit wins


def test_default_config_on_this_cpu_keeps_fp32_master_weights() -> None:
    config = load_config(None)
    assert config.model.compute_dtype == "auto" and config.model.param_dtype == "auto"
    assert config.optim.master_weights_fp32
    decoder = decoder_config(config.model)
    assert decoder.compute_jnp_dtype == jnp.float32  # this machine is a CPU
    assert decoder.param_jnp_dtype == jnp.float32
