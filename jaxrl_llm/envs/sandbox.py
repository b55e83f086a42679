"""Run model-written Python in a separate, limited process (the `python` tool; off by
default, `env.python_tool: true` turns it on).

Model text never runs in the trainer's process. Each run gets a fresh temporary directory
(its working directory, the only place it may write), an empty environment, no stdin, and
a child interpreter (`python -I -S -B envs/sandbox_child.py`) that limits itself before the
code starts (CPU seconds, address space, file size, open files, processes; a network
namespace where the kernel allows it; an audit hook refusing sockets, subprocesses, fork,
ctypes and writes outside its directory). The whole process group is killed when the run
ends or its wall-clock limit passes, and the directory is removed. Output (stdout and stderr
go to files capped by the file-size limit) is cut to `max_output_chars`, saying so.
docs/environments.md § The Python tool has the security model and its limits.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = Path(__file__).with_name("sandbox_child.py")
_SIGNALS = {signal.SIGXCPU: "CPU time limit", signal.SIGKILL: "killed",
            signal.SIGXFSZ: "output/file size limit", signal.SIGSEGV: "crashed (SIGSEGV)"}


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """What one run of model code may use (env.options of the `python` environment)."""

    timeout_s: float = 10.0  # wall clock; the process group is killed after it
    cpu_s: int = 5  # RLIMIT_CPU
    memory_mb: int = 512  # RLIMIT_AS (address space)
    file_mb: float = 1.0  # RLIMIT_FSIZE: any file it writes, its stdout and stderr included
    open_files: int = 64  # RLIMIT_NOFILE
    # RLIMIT_NPROC: processes and threads above the user's current count (non-root users only;
    # the kernel exempts root)
    processes: int = 4
    max_code_chars: int = 20_000  # longer code is refused before a process starts
    max_output_chars: int = 2_000  # stdout and stderr each cut to this, saying so

    def __post_init__(self) -> None:
        for name in ("timeout_s", "cpu_s", "memory_mb", "file_mb", "open_files",
                     "max_code_chars", "max_output_chars"):
            if not getattr(self, name) > 0:
                raise ValueError(f"python tool limit {name}={getattr(self, name)!r} must be > 0")
        if self.processes < 0:
            raise ValueError(f"python tool limit processes={self.processes} must be >= 0")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """One run: its (cut) output, exit status and what stopped it, if anything."""

    stdout: str
    stderr: str
    returncode: int | None
    status: str  # "ok", "error" (non-zero exit), "timeout", or a limit: "CPU time limit", …
    seconds: float

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def observation(self) -> str:
        """What the model reads: stdout, then stderr and the status when it did not succeed."""
        parts = [self.stdout] if self.stdout else []
        if self.stderr:
            parts.append(self.stderr)
        if not self.ok:
            parts.append(f"[{self.status}]")
        return "\n".join(parts) if parts else "(no output)"


def _process_limit(extra: int) -> int:
    """RLIMIT_NPROC counts every task (process or thread) of the user: the current count,
    one for the child, and `extra`."""
    uid = os.getuid()
    count = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    count += len(os.listdir(entry / "task"))
            except OSError:  # gone meanwhile
                continue
    return count + 1 + extra


def _wait_unreaped(pid: int, timeout_s: float) -> bool:
    """Wait until `pid` exits, leaving it unreaped (WNOWAIT); False on timeout."""
    deadline, pause = time.monotonic() + timeout_s, 0.001
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(2 * pause, 0.02)
    return True


def _cut(text: str, limit: int, *, keep_end: bool) -> str:
    if len(text) <= limit:
        return text
    cut = len(text) - limit
    if keep_end:  # a traceback's last lines say what went wrong
        return f"[... {cut} characters cut]\n" + text[-limit:]
    return text[:limit] + f"\n[... {cut} characters cut]"


def _read(path: Path, limit: int, *, keep_end: bool) -> str:
    with open(path, "rb") as f:
        data = f.read()
    return _cut(data.decode("utf-8", errors="replace"), limit, keep_end=keep_end)


def _status(returncode: int, timed_out: bool) -> str:
    if timed_out:
        return "timeout"
    if returncode == 0:
        return "ok"
    if returncode < 0:
        return _SIGNALS.get(-returncode, f"killed by signal {-returncode}")
    return "error"


class PythonSandbox:
    """Runs code strings in a limited child process (`run(code)` → `SandboxResult`)."""

    def __init__(self, limits: SandboxLimits | None = None) -> None:
        self.limits = limits or SandboxLimits()

    def _child_limits(self) -> dict[str, int]:
        lim = self.limits
        return {"cpu_s": lim.cpu_s, "memory_bytes": int(lim.memory_mb * 2**20),
                "file_bytes": int(lim.file_mb * 2**20), "open_files": lim.open_files,
                "processes": _process_limit(lim.processes)}

    def run(self, code: str) -> SandboxResult:
        if not isinstance(code, str):
            raise TypeError(f"python tool: code must be a string, got {type(code).__name__}")
        if len(code) > self.limits.max_code_chars:
            return SandboxResult("", f"code of {len(code)} characters is longer than the "
                                 f"limit of {self.limits.max_code_chars}", None,
                                 "refused", 0.0)
        base = Path(tempfile.mkdtemp(prefix="jaxrl-python-tool-"))
        try:
            return self._run_in(base, code)
        finally:
            shutil.rmtree(base, ignore_errors=True)

    def _run_in(self, base: Path, code: str) -> SandboxResult:
        work = base / "work"
        work.mkdir()
        (work / "main.py").write_text(code, encoding="utf-8")  # in its own temporary dir
        out_path, err_path = base / "stdout", base / "stderr"
        command = [sys.executable, "-I", "-S", "-B", str(CHILD), str(work),
                   json.dumps(self._child_limits())]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "TMPDIR": str(work),
               "HOME": str(work), "PYTHONIOENCODING": "utf-8"}
        start = time.monotonic()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    cwd=work, env=env, close_fds=True, start_new_session=True)
            try:
                timed_out = not _wait_unreaped(proc.pid, self.limits.timeout_s)
            finally:
                # The whole group: whatever the code started dies with it. The leader is not
                # reaped yet, so its pid (the group's id) cannot have been reused.
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
        seconds = time.monotonic() - start
        limit = self.limits.max_output_chars
        return SandboxResult(_read(out_path, limit, keep_end=False),
                             _read(err_path, limit, keep_end=True), proc.returncode,
                             _status(proc.returncode, timed_out), seconds)
