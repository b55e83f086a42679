"""The `plan:` section (`jaxrl-llm plan`, plan/)."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
)

from jaxrl_llm.config.base import Section


class PlanConfig(Section):
    """`jaxrl-llm plan`: the hardware to compile the train step for (no weights, no devices).

    `platform: tpu` compiles with the real TPU compiler for `topology` (needs the `tpu`
    extra, PyPI `libtpu`); `cpu` uses `num_devices` fake host devices (`XLA_FLAGS`).
    """

    # compile for fake CPU devices or, with libtpu, real TPU chips
    platform: Literal["cpu", "tpu"] = "cpu"
    topology: str | None = Field(None, description="e.g. v5e:16x16 (256 chips), v5e:2x2")
    num_devices: int | None = Field(None, gt=0, description="fake CPU devices; default: mesh")
    chip_memory_gib: float | None = Field(None, gt=0, description="HBM per chip; v5e: 16")
    # also compile the continuous sampler's own decode and prefill programs (plan/sampler.py)
    # for the sampler's devices (online.sampler_devices, or the trainer's mesh): auto = for a
    # config with an online: section
    sampler: Literal["auto", "on", "off"] = "auto"
    sampler_topology: str | None = Field(None, description="the sampler's own TPU slice (e.g. "
                                         "v5e:8x8) when it is not part of plan.topology, "
                                         "which is then the trainer's")
    sampler_prompt_len: int | None = Field(None, gt=0, description="the sampler's prompt "
                                           "tokens; default train.max_seq_len − "
                                           "generate.max_new_tokens")
