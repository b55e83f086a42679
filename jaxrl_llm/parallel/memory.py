"""Never OOM-killed by surprise: before a compiled program first runs (the train step before
step 1, the score pass before its first batch), compare what it will allocate with the memory
this process can still get, and refuse with the figure and the fix when it does not fit.

What the program needs comes from the compiler itself (`compiled.memory_analysis()`, what
`jaxrl-llm plan` prints): the peak is arguments + outputs − donated (aliased) + temporaries.
The arguments (parameters, optimizer state, the batch) are already resident when the check
runs, so the program adds `peak − arguments`. What is available:

- CPU: the host's available memory (psutil: Linux `MemAvailable`, macOS the same notion),
  capped by a cgroup memory limit when the process runs under one (containers, SLURM);
- GPU/TPU: `device.memory_stats()` `bytes_limit − bytes_in_use` of the fullest device.

`JAXRL_MEMORY_LIMIT_GIB` caps it: this process may use at most that much in all (on a shared
machine, or to rehearse a smaller one); the room is then the cap minus what it holds now.
Multi-process jobs take the smallest figure over processes, so every host decides the same.
On CPU the compiler's figure misses the runtime around it (the XLA runtime, Python, the data
loader's buffers); `HOST_OVERHEAD` covers that, and an async checkpoint copies the state to
the host while the next steps run, which `extra_bytes` adds where it applies.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
import psutil
from jax.experimental import multihost_utils

from jaxrl_llm.core.errors import ConfigError

GIB = 1024**3
LIMIT_ENV = "JAXRL_MEMORY_LIMIT_GIB"
# Beyond the compiler's figure, what a CPU process adds while the program runs (data loader,
# allocator slack). benchmarks/train_memory.py, SmolLM2-135M at 8×1024: the process held
# 2.18 GiB at the check, the step added 2.95 GiB by the compiler and the peak RSS was 5.57 GiB,
# 0.44 GiB above their sum (results/train_memory.json).
HOST_OVERHEAD = 0.5 * GIB
# Relative safety margin on the compiler's own figure (fragmentation, allocator slack).
MARGIN = 0.10


class InsufficientMemory(ConfigError):
    """The compiled program does not fit in the memory left; the message has the figures and
    the settings that would make it fit (the CLI exits 2, like any configuration error)."""


@dataclass(frozen=True)
class ProgramMemory:
    """Per-device bytes of one compiled program (`compiled.memory_analysis()`)."""

    argument: int
    output: int
    alias: int
    temp: int

    @property
    def peak(self) -> int:
        return self.argument + self.output - self.alias + self.temp

    @property
    def added(self) -> int:
        """What running it adds to the already resident arguments."""
        return self.peak - self.argument

    def times(self, k: int) -> ProgramMemory:
        """`k` devices' worth (fake CPU devices share one host's memory)."""
        return ProgramMemory(self.argument * k, self.output * k, self.alias * k, self.temp * k)


def program_memory(compiled: Any, mesh: Any = None) -> ProgramMemory:
    """Per device; on CPU, with a `mesh`, per host: the sum over this process's devices of
    the mesh (fake host devices all live in the host's memory)."""
    mem = compiled.memory_analysis()
    one = ProgramMemory(argument=int(mem.argument_size_in_bytes),
                        output=int(mem.output_size_in_bytes),
                        alias=int(mem.alias_size_in_bytes), temp=int(mem.temp_size_in_bytes))
    if mesh is None or mesh.devices.flat[0].platform != "cpu":
        return one

    return one.times(sum(d.process_index == jax.process_index() for d in mesh.devices.flat))


@dataclass(frozen=True)
class Available:
    bytes: int
    where: str  # what the figure is, for the message
    host: bool  # CPU: the figure is host memory (HOST_OVERHEAD applies)


def _cgroup_room() -> int | None:
    """Bytes left under this process's cgroup memory limit (v2 or v1), or None if unlimited."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit = Path("/sys/fs/cgroup", limit_file).read_text().strip()
            usage = int(Path("/sys/fs/cgroup", usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:  # "max" / a huge number: no limit
            return int(limit) - usage
    return None


def available_memory(device: Any) -> Available:
    """The memory `device` can still allocate (module docstring); all processes agree."""
    stats = None if device.platform == "cpu" else device.memory_stats()
    if stats and "bytes_limit" in stats:
        room = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        found = Available(room, f"free memory of {device.platform} device {device.id}", False)
    else:
        room, where = int(psutil.virtual_memory().available), "available host memory"
        cgroup = _cgroup_room()
        if cgroup is not None and cgroup < room:
            room, where = cgroup, "room under this process's cgroup memory limit"
        found = Available(room, where, True)
    cap = os.environ.get(LIMIT_ENV)
    if cap:
        try:
            limit = float(cap) * GIB
        except ValueError:
            raise ConfigError(f"{LIMIT_ENV}={cap!r} is not a number of GiB") from None
        held = held_bytes(device, stats)
        if limit - held < found.bytes:
            found = Available(int(limit - held), f"left of {LIMIT_ENV}={cap} ({gib(held)} "
                              "held now)", found.host)

    if jax.process_count() > 1:
        # In MiB as float32: without jax_enable_x64 an int64 byte count is gathered as int32
        # and wraps (22 GiB read as -1.8 GiB refused a resume in the two-process test).
        rooms = multihost_utils.process_allgather(np.asarray([found.bytes / 2**20], np.float32))
        found = Available(int(float(np.min(rooms)) * 2**20),
                          found.where + " (smallest over processes)", found.host)
    return found


def held_bytes(device: Any, stats: dict | None = None) -> int:
    """What this process holds now: its resident memory (host) or the device's bytes in use."""
    stats = stats if stats is not None or device.platform == "cpu" else device.memory_stats()
    if stats and "bytes_in_use" in stats:
        return int(stats["bytes_in_use"])

    return int(psutil.Process().memory_info().rss)


def needed_bytes(memory: ProgramMemory, available: Available, extra_bytes: int = 0) -> int:
    """What to require free: the program's addition with a margin, plus `extra_bytes` (an
    async checkpoint's host copy) and, on a host, the runtime around the program."""
    overhead = HOST_OVERHEAD if available.host else 0
    return int(memory.added * (1 + MARGIN)) + extra_bytes + overhead


def fits(memory: ProgramMemory, available: Available, extra_bytes: int = 0) -> bool:
    return needed_bytes(memory, available, extra_bytes) <= available.bytes


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def describe(what: str, memory: ProgramMemory, available: Available,
             extra_bytes: int = 0) -> str:
    """One sentence: what the program needs against what is available."""
    extra = f" + {gib(extra_bytes)} for the async checkpoint's copy" if extra_bytes else ""
    overhead = f" + {gib(HOST_OVERHEAD)} runtime" if available.host else ""
    return (f"{what} needs {gib(memory.peak)} at its peak ({gib(memory.argument)} already "
            f"resident: parameters, optimizer state, batch; {gib(memory.temp)} temporaries), "
            f"i.e. {gib(needed_bytes(memory, available, extra_bytes))} more with "
            f"{MARGIN:.0%} margin{extra}{overhead}; {gib(available.bytes)} is {available.where}")
