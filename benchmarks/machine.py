"""The host a benchmark ran on, for its results file: CPU figures depend on the CPU model
(e.g. decode ratios against PyTorch differ between AMD EPYC and Intel Xeon hosts of the same
core count), so every results file names it."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_name() -> str:
    """The first CPU's model name with its family and model numbers, from /proc/cpuinfo
    (virtual machines often report only "Intel(R) Xeon(R) Processor"), else
    `platform.processor()`."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break  # the end of the first CPU's block
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or "unknown CPU"
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name
