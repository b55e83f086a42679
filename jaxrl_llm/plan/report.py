"""What `jaxrl-llm plan` reports: per-device memory and FLOPs of the compiled train step
(`PlanReport`, filled by `plan.make_plan`), the public TPU chip figures it is judged against,
and the Markdown table it prints (`format_report`, also in docs/plan.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

GIB = 1024**3
# HBM per chip by TPU generation (public Cloud TPU specs), used when plan.chip_memory_gib is
# not set.
CHIP_MEMORY_GIB = {"v4": 32.0, "v5e": 16.0, "v5litepod": 16.0, "v5p": 95.0, "v6e": 32.0}
# Peak dense bf16 FLOP/s and HBM bytes/s per chip (public Cloud TPU specs), for the roofline.
CHIP_PEAK = {"v4": (275e12, 1228e9), "v5e": (197e12, 819e9), "v5litepod": (197e12, 819e9),
             "v5p": (459e12, 2765e9), "v6e": (918e12, 1640e9)}
# Inter-chip interconnect bytes/s per chip (public Cloud TPU specs: v4 2,400 Gbps, v5e 1,600,
# v5p 4,800, v6e 3,584), for the time of context parallelism's K/V all-gathers.
CHIP_ICI = {"v4": 300e9, "v5e": 200e9, "v5litepod": 200e9, "v5p": 600e9, "v6e": 448e9}


@dataclass
class ContextSplit:
    """Context parallelism's traffic (`plan.context_split`): per chip and step, the bytes of
    keys and values it receives in the all-gathers (forward, remat's recomputed forward) and
    sends back as gradient reduce-scatters, and their time at the chip's ICI bandwidth."""

    shards: int  # mesh.context
    tokens_per_chip: int  # rows per chip × T / context, per step
    collective_bytes: float  # per chip and step
    collective_seconds: float | None  # at CHIP_ICI; None off TPU


@dataclass
class ArrayInfo:
    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: str
    global_bytes: int
    device_bytes: int


@dataclass
class PlanReport:
    config_name: str
    platform: str
    topology: str
    num_devices: int
    fallback_note: str | None
    mesh: dict[str, int]
    batch: dict[str, int]
    num_params: int
    compile_seconds: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    state_bytes_per_device: int
    flops_per_device: float
    model_flops_6nd: float
    chip_memory_bytes: int | None
    largest: list[ArrayInfo] = field(default_factory=list)
    # LoRA (model.lora): `num_params` counts the trainable adapters, these the frozen base.
    frozen_params: int = 0
    # a mixture of experts: the parameters one token's matmuls use (its k experts' of E);
    # `model_flops_6nd` counts these
    active_params: int | None = None
    lora: dict[str, Any] | None = None
    # Per-device bytes of each part of the state: params, opt_state, ref_params, model_state.
    section_bytes: dict[str, int] = field(default_factory=dict)
    attention: str = "jnp"  # the attention implementation compiled (models/attention.py)
    pallas_kernels: int = 0  # Mosaic (Pallas TPU) custom calls in the compiled step
    bytes_accessed_per_device: float = float("nan")
    attention_flops: float = 0.0  # causal attention matmuls, forward + backward, all devices
    hardware_flops: float = 0.0  # model + attention + remat's recomputed forward, all devices
    chip_peak: tuple[float, float] | None = None  # (FLOP/s, HBM bytes/s)
    context: ContextSplit | None = None  # mesh.context > 1
    sampler: Any = None  # plan/sampler.py's SamplerPlan, when the config samples
    # the sampler has devices of its own (online.sampler_devices): `num_devices` are the
    # trainer's, `sampler.devices` the sampler's
    sampler_split: bool = False

    @property
    def roofline_seconds(self) -> float | None:
        """Lower bound on the step time: max(FLOPs / peak, bytes / HBM bandwidth) per chip.

        FLOPs: the larger of the compiled count and the analytic `hardware_flops` (XLA counts a
        scanned layer once); bytes: the compiled `bytes accessed` (also counted once per loop).
        """
        if self.chip_peak is None:
            return None
        flops = max(self.flops_per_device, self.hardware_flops / self.num_devices)
        nbytes = 0.0 if math.isnan(self.bytes_accessed_per_device) else \
            self.bytes_accessed_per_device
        return max(flops / self.chip_peak[0], nbytes / self.chip_peak[1])

    @property
    def mfu_bound(self) -> float | None:
        """Model FLOPs utilisation at the roofline time: (6·N·tokens + attention) / (chips ·
        peak · bound); the most this step can reach on this topology."""
        bound = self.roofline_seconds
        if not bound or self.chip_peak is None:
            return None
        useful = self.model_flops_6nd + self.attention_flops
        return useful / (self.num_devices * self.chip_peak[0] * bound)

    @property
    def peak_bytes(self) -> int:
        """Live bytes at the peak: arguments + temporaries + outputs not aliased to a donated
        argument (the state is donated, so the new state reuses its buffers)."""
        return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes

    @property
    def fits(self) -> bool | None:
        return None if self.chip_memory_bytes is None else self.peak_bytes <= self.chip_memory_bytes


def _gib(n: float) -> str:
    if abs(n) >= GIB / 4:
        return f"{n / GIB:.2f} GiB"
    return f"{n / 2**20:.1f} MiB"


def format_report(r: PlanReport) -> str:
    """A markdown report (what `plan` prints and docs/plan.md holds)."""
    mesh = " ".join(f"{k}={v}" for k, v in r.mesh.items())
    devices = (f"{r.num_devices + r.sampler.devices} {r.platform} devices: {r.num_devices} "
               f"train, {r.sampler.devices} sample" if r.sampler_split else
               f"{r.num_devices} {r.platform} devices")
    lines = [f"### {r.config_name}: {r.topology} ({devices})", ""]
    if r.fallback_note:
        lines += [f"> NOTE: {r.fallback_note}", ""]
    params = f"{r.num_params / 1e6:,.1f} M parameters"
    if r.active_params is not None:
        params += f" ({r.active_params / 1e6:,.1f} M active per token: a mixture of experts)"
    if r.lora is not None:
        targets = ", ".join(r.lora["targets"])
        params = (f"{(r.num_params + r.frozen_params) / 1e6:,.1f} M parameters, of which "
                  f"{r.num_params / 1e6:,.2f} M trainable LoRA adapters (rank {r.lora['rank']}, "
                  f"alpha {r.lora['alpha']:g} on {targets}); the base is frozen")
    lines += [
        f"mesh {mesh}; batch {r.batch['batch_size']}×{r.batch['seq_len']} tokens "
        f"(micro-batch {r.batch['micro_batch_size']}); {params}; "
        f"compiled in {r.compile_seconds:.1f} s",
        "",
        "| per device | bytes |",
        "| --- | --- |",
        f"| state: trainable parameters + optimizer state | "
        f"{_gib(r.section_bytes.get('params', 0) + r.section_bytes.get('opt_state', 0))} |",
        f"| state: frozen weights (LoRA base) + reference policy | "
        f"{_gib(r.section_bytes.get('model_state', 0) + r.section_bytes.get('ref_params', 0))} |",
        f"| arguments (state + batch) | {_gib(r.argument_bytes)} |",
        f"| outputs | {_gib(r.output_bytes)} |",
        f"| aliased (donated state reused) | {_gib(r.alias_bytes)} |",
        f"| temporaries (activations, gradients, …) | {_gib(r.temp_bytes)} |",
        f"| **peak ≈ arguments + temporaries + outputs − aliased** | **{_gib(r.peak_bytes)}** |",
    ]
    if r.chip_memory_bytes is not None:
        verdict = "fits" if r.fits else "DOES NOT FIT"
        frac = r.peak_bytes / r.chip_memory_bytes
        lines.append(
            f"| chip memory | {_gib(r.chip_memory_bytes)} → {verdict} ({frac:.0%} used, "
            f"{_gib(r.chip_memory_bytes - r.peak_bytes)} headroom) |"
        )
    total = r.flops_per_device * r.num_devices
    lines += [
        f"| FLOPs per step (per device / all devices) | {r.flops_per_device:.3e} / "
        f"{total:.3e} |",
        f"| 6·N·tokens (model FLOPs, no attention{'; N active' if r.active_params else ''})"
        f" | {r.model_flops_6nd:.3e} |",
        f"| attention FLOPs (causal, fwd + bwd) | {r.attention_flops:.3e} |",
        f"| attention kernel | {r.attention} ({r.pallas_kernels} Pallas TPU kernels compiled) |",
    ]
    if r.context is not None:
        cx = r.context
        time = "" if cx.collective_seconds is None else f" ≈ {cx.collective_seconds:.2f} s at ICI"
        lines += [
            f"| context split: {cx.shards} shards, tokens per chip | {cx.tokens_per_chip:,} |",
            f"| context split: K/V all-gather + reduce-scatter bytes per chip | "
            f"{_gib(cx.collective_bytes)}{time} |",
        ]
    bound = r.roofline_seconds
    if bound is not None:
        lines += [
            f"| compiled bytes accessed per device | {r.bytes_accessed_per_device:.3e} |",
            f"| roofline bound on step time (peak {r.chip_peak[0] / 1e12:.0f} TFLOP/s, "
            f"{r.chip_peak[1] / 1e9:.0f} GB/s) | {bound:.2f} s → MFU ≤ {r.mfu_bound:.0%} |",
        ]
    lines += [
        "",
        "XLA's cost analysis counts a `while` loop body once, so with `scan_layers` (and the "
        "chunked log-prob scan) the compiled FLOPs and bytes undercount; 6·N·tokens is the "
        "model's. The roofline takes the larger of the compiled FLOPs and the analytic "
        "hardware FLOPs (model + attention, × 4/3 with remat=full).",
        "",
        "Largest arrays of the state:",
        "",
        "| array | shape | dtype | sharding | per device |",
        "| --- | --- | --- | --- | --- |",
    ]
    for a in r.largest:
        lines.append(
            f"| {a.path} | {'×'.join(map(str, a.shape))} | {a.dtype} | `{a.spec}` | "
            f"{_gib(a.device_bytes)} |"
        )
    text = "\n".join(lines) + "\n"
    if r.sampler is not None:
        from jaxrl_llm.plan.sampler import format_sampler_plan

        text += "\n" + format_sampler_plan(r.sampler)
    return text
