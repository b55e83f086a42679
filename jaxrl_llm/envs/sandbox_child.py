"""The Python tool's child process (started by `envs/sandbox.py`, never imported): it limits
itself, then runs the model's code, `main.py` in its working directory.

`python -I -S -B sandbox_child.py WORKDIR LIMITS_JSON`. In order, before any model code runs:
a network namespace of its own when the kernel allows one (only a down loopback inside);
resource limits (CPU seconds, address space, file size, open files, processes, no core
file), each with a hard limit the code cannot raise (its soft one; CPU: one second more); then an
audit hook (PEP 578) that refuses sockets, subprocesses, fork/exec/spawn, signals to other
processes, ctypes, changing the limits, writes outside WORKDIR and reads outside WORKDIR and
the standard library. docs/environments.md § The Python tool says what each layer does and
does not stop. Standard library only: `-I -S` gives no site-packages and no user paths.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import resource
import sys
import threading
import traceback

# Audit events refused outright (exact names, or a prefix ending in ".").
_BLOCKED_EVENTS = ("socket.", "subprocess.", "ctypes.", "os.exec", "os.fork", "os.forkpty",
                   "os.posix_spawn", "os.spawn", "os.system", "os.kill", "os.killpg",
                   "os.link", "os.symlink", "os.startfile", "pty.", "resource.setrlimit",
                   "resource.prlimit", "signal.pthread_kill", "webbrowser.", "urllib.",
                   "http.", "ftplib.", "smtplib.", "poplib.", "imaplib.", "nntplib.",
                   "telnetlib.", "_winapi.", "winreg.", "sys.remote_exec")
# Modules whose import is refused (a package and everything under it).
_BLOCKED_MODULES = frozenset({
    "ctypes", "_ctypes", "cffi", "socket", "_socket", "ssl", "_ssl", "select", "selectors",
    "subprocess", "_posixsubprocess", "multiprocessing", "_multiprocessing", "pty", "resource",
    "_testcapi", "_testinternalcapi", "_xxsubinterpreters", "_xxinterpchannels", "asyncio",
    "concurrent", "mmap"})
# Events whose first argument is a path that must lie inside WORKDIR (they change files).
_WRITE_PATH_EVENTS = frozenset({"os.chmod", "os.chown", "os.chflags", "os.lchflags", "os.mkdir",
                                "os.remove", "os.rmdir", "os.truncate", "os.utime",
                                "os.setxattr", "os.removexattr", "shutil.rmtree",
                                "shutil.copyfile", "shutil.copymode", "shutil.copystat",
                                "shutil.move", "shutil.chown"})
_READ_PATH_EVENTS = frozenset({"os.listdir", "os.scandir"})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_READ_FILES = frozenset({"/dev/null", "/dev/urandom", "/dev/zero"})
_CLONE_NEWNET, _CLONE_NEWUSER = 0x40000000, 0x10000000


def _new_network_namespace() -> bool:
    """Leave the host's network: unshare(CLONE_NEWNET) (root), else with a user namespace
    (an unprivileged user, where the kernel allows it). False when neither is allowed."""
    try:
        import ctypes  # trusted set-up code: gone from sys.modules before the model's code

        libc = ctypes.CDLL(None, use_errno=True)
        ok = any(libc.unshare(flags) == 0
                 for flags in (_CLONE_NEWNET, _CLONE_NEWNET | _CLONE_NEWUSER))
    except (OSError, AttributeError):
        ok = False
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]
    return ok


def _set_limits(limits: dict[str, int]) -> None:
    for key, name in (("cpu_s", "RLIMIT_CPU"), ("memory_bytes", "RLIMIT_AS"),
                      ("file_bytes", "RLIMIT_FSIZE"), ("open_files", "RLIMIT_NOFILE"),
                      ("processes", "RLIMIT_NPROC")):
        value = int(limits[key])
        # CPU: SIGXCPU at the soft limit names the cause; SIGKILL a second later if caught.
        hard = value + 1 if name == "RLIMIT_CPU" else value
        resource.setrlimit(getattr(resource, name), (value, hard))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _inside(path: object, roots: tuple[str, ...]) -> bool:
    if isinstance(path, int):  # an already open descriptor
        return True
    try:
        real = os.path.realpath(os.fsdecode(path))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return any(real == root or real.startswith(root.rstrip("/") + "/") for root in roots)


def make_hook(workdir: str, read_roots: tuple[str, ...]):
    """The audit hook: raises PermissionError for what the sandbox refuses."""
    writable = (workdir,)
    readable = (workdir, *read_roots)
    busy = threading.local()  # realpath's own calls must not re-enter the checks

    def refuse(what: str) -> None:
        raise PermissionError(f"sandbox: {what} is not allowed")

    def hook(event: str, args: tuple) -> None:
        if getattr(busy, "on", False):
            return
        busy.on = True
        try:
            if event.startswith(_BLOCKED_EVENTS):
                refuse(event)
            elif event == "import":
                if str(args[0]).split(".")[0] in _BLOCKED_MODULES:
                    refuse(f"import {args[0]}")
            elif event == "open":
                path, mode, flags = (list(args) + [None, None])[:3]
                writes = bool(isinstance(mode, str) and set(mode) & set("wax+")) or bool(
                    isinstance(flags, int) and flags & _WRITE_FLAGS)
                if writes and not _inside(path, writable):
                    refuse(f"writing {path!r} (outside the working directory)")
                if not writes and not (path in _READ_FILES or _inside(path, readable)):
                    refuse(f"reading {path!r}")
            elif event in _WRITE_PATH_EVENTS or event == "os.rename":
                paths = args[:2] if event in ("os.rename", "shutil.copyfile", "shutil.move") \
                    else args[:1]
                for path in paths:
                    if not _inside(path, writable):
                        refuse(f"{event} on {path!r} (outside the working directory)")
            elif event in _READ_PATH_EVENTS and args and args[0] is not None:
                if not _inside(args[0], readable):
                    refuse(f"{event} of {args[0]!r}")
        finally:
            busy.on = False

    return hook


def _print_user_traceback(err: BaseException) -> None:
    """The traceback of the model's own frames (not this launcher's, nor the importer's)."""
    summary = traceback.TracebackException(type(err), err, err.__traceback__)
    summary.stack = traceback.StackSummary.from_list(
        [f for f in summary.stack if f.filename != __file__ and not f.filename.startswith("<frozen")])
    print("".join(summary.format()), end="", file=sys.stderr)


def main() -> int:
    workdir, limits = os.path.realpath(sys.argv[1]), json.loads(sys.argv[2])
    _new_network_namespace()
    _set_limits(limits)
    os.chdir(workdir)
    main_path = "main.py"  # relative: tracebacks read `File "main.py"`
    read_roots = tuple(os.path.realpath(p) for p in sys.path if p and os.path.isdir(p))
    sys.argv = [main_path]
    sys.path[:0] = [workdir]
    sys.addaudithook(make_hook(workdir, read_roots))  # from here on nothing can remove it
    # main.py runs as this process's __main__ module, as `python main.py` would run it.
    loader = importlib.machinery.SourceFileLoader("__main__", main_path)  # relative path kept
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("__main__", loader))
    sys.modules["__main__"] = module
    try:
        loader.exec_module(module)
    except SystemExit as err:
        code = err.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except BaseException as err:  # the model's error, shown to the model as a traceback
        _print_user_traceback(err)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
