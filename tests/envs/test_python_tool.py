"""The Python tool under attack: hostile programs end as error observations within their
limits, and the host is unharmed (no file written outside, no process left, no connection)."""

from __future__ import annotations

import json
import re
import socket
import tempfile
from pathlib import Path

import psutil
import pytest

from jaxrl_llm.envs.python_tool import PythonEnv
from jaxrl_llm.envs.registry import get_environment
from jaxrl_llm.envs.sandbox import PythonSandbox, SandboxLimits
from jaxrl_llm.tasks.arithmetic import ArithmeticTask
from tests.reliability import record

SECTION = "python tool under attack"
LIMITS = dict(timeout_s=3.0, cpu_s=1, memory_mb=256, file_mb=0.25, max_output_chars=400)

# name -> (program, what must stop it: a pattern of the observation, said in the row).
# {out} is a path outside the run's directory, {outdir} its folder, {port} a listening port.
HOOK = "refused by the audit hook"
HOSTILE = {
    "fork bomb (os.fork loop)": ("import os\nwhile True:\n    os.fork()",
                                 "os.fork is not allowed", HOOK),
    "fork bomb (multiprocessing)": ("import multiprocessing as m\nwhile True:\n"
                                    "    m.Process(target=print).start()",
                                    "import multiprocessing is not allowed", HOOK),
    "subprocess writing a file": ("import subprocess\nsubprocess.run(['touch', '{out}'])",
                                  "import subprocess is not allowed", HOOK),
    "os.system": ("import os\nos.system('touch {out}')", "os.system is not allowed", HOOK),
    "os.execv a shell": ("import os\nos.execv('/bin/sh', ['sh', '-c', 'touch {out}'])",
                         "os.exec is not allowed", HOOK),
    "os.posix_spawn": ("import os\nos.posix_spawn('/bin/touch', ['touch', '{out}'], {{}})",
                       "os.posix_spawn is not allowed", HOOK),
    "ctypes call into libc": ("import ctypes\nctypes.CDLL(None).system(b'touch {out}')",
                              "import ctypes is not allowed", HOOK),
    "_posixsubprocess by hand": ("import _posixsubprocess",
                                 "import _posixsubprocess is not allowed", HOOK),
    "infinite loop": ("while True:\n    pass", r"\[(CPU time limit|timeout)\]",
                      "CPU time limit (or the wall-clock timeout on a loaded machine)"),
    "sleeps forever": ("import time\ntime.sleep(10**6)", r"\[timeout\]",
                       "wall-clock timeout, process group killed"),
    "huge output": ("print('x' * 10**8)", "File too large|output/file size limit",
                    "file-size limit on its stdout; the observation cut, saying so"),
    "endless output": ("while True:\n    print('y' * 1000)", "File too large|output/file size limit",
                       "file-size limit on its stdout; the observation cut, saying so"),
    "memory hog": ("blob = bytearray(8 * 2**30)", "MemoryError", "address-space limit"),
    "memory hog (growing list)": ("a = []\nwhile True:\n    a.append(' ' * 10**6)",
                                  "MemoryError", "address-space limit"),
    "file write outside its directory": ("open('{out}', 'w').write('pwned')",
                                         "writing .* is not allowed", HOOK),
    "file write via os.open": ("import os\nos.open('{out}', os.O_WRONLY | os.O_CREAT)",
                               "writing .* is not allowed", HOOK),
    "file write via pathlib": ("import pathlib\npathlib.Path('{out}').write_text('pwned')",
                               "writing .* is not allowed", HOOK),
    "rename a file out of its directory": ("open('a', 'w').write('x')\nimport os\n"
                                           "os.rename('a', '{out}')",
                                           "os.rename on .* is not allowed", HOOK),
    "symlink out of its directory": ("import os\nos.symlink('{out}', 'link')\n"
                                     "open('link', 'w').write('x')",
                                     "os.symlink is not allowed", HOOK),
    "read a host file": ("print(open('/etc/passwd').read())",
                         "reading '/etc/passwd' is not allowed", HOOK),
    "network: socket to a local port": ("import socket\nsocket.create_connection(("
                                        "'127.0.0.1', {port}))",
                                        "import socket is not allowed",
                                        HOOK + " (and a network namespace where the kernel "
                                        "allows one)"),
    "network: urllib to a local port": ("import urllib.request\n"
                                        "urllib.request.urlopen('http://127.0.0.1:{port}/')",
                                        "import socket is not allowed",
                                        HOOK + " (and a network namespace where the kernel "
                                        "allows one)"),
    "kill the parent": ("import os\nos.kill(os.getppid(), 9)", "os.kill is not allowed", HOOK),
    "kill its process group": ("import os\nos.killpg(0, 9)", "os.killpg is not allowed", HOOK),
    "raise its own limits": ("import resource\n"
                             "resource.setrlimit(resource.RLIMIT_CPU, (10**6, 10**6))",
                             "resource.setrlimit is not allowed", HOOK),
    "compile bomb": ("eval('1+' * 10**6 + '1')", "MemoryError|RecursionError",
                     "the parser's limits under the address-space limit"),
    "delete the host's files": ("import shutil\nshutil.rmtree('{outdir}')",
                                "shutil.rmtree on .* is not allowed", HOOK),
}


def _sandbox_processes(under: Path) -> list[psutil.Process]:
    """Sandbox children (and their forks, which keep the cmdline) whose work directory is under
    `under`: only this test's, not those of a test running beside it (pytest-xdist, CI)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmdline = p.info["cmdline"] or []
        if any("sandbox_child.py" in part for part in cmdline) and \
                any(part.startswith(str(under)) for part in cmdline):
            found.append(p)
    return found


@pytest.fixture(scope="module")
def env() -> PythonEnv:
    return get_environment("python", task=ArithmeticTask(), python_tool=True, **LIMITS)


def _call(env: PythonEnv, code: str):
    call = json.dumps({"name": "python", "arguments": {"code": code}})
    return env.respond(env.start(None), f"<tool_call>\n{call}\n</tool_call>")


@pytest.mark.reliability
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_program(env: PythonEnv, name: str, tmp_path: Path, monkeypatch):
    sandboxes = tmp_path / "sandboxes"
    sandboxes.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(sandboxes))  # the sandbox's mkdtemp base
    outdir = tmp_path / "host"
    outdir.mkdir()
    keep = outdir / "keep.txt"
    keep.write_text("host file")
    out = outdir / "pwned"
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0)
    program, stopped_by, how = HOSTILE[name]
    code = program.format(out=out, outdir=outdir, port=server.getsockname()[1])
    before = psutil.Process().children(recursive=True)
    try:
        response = _call(env, code)
        content = response.messages[0]["content"]
        failures = []
        if not content.startswith("Error: ") or not re.search(stopped_by, content):
            failures.append(f"not the error observation expected: {content[-200:]!r}")
        if response.info["tool_errors"] != 1:
            failures.append("not counted as a tool error")
        if out.exists() or not keep.exists():
            failures.append("a host file was written or removed")
        if _sandbox_processes(sandboxes) or psutil.Process().children(recursive=True) != before:
            failures.append("a process outlived the run")
        try:
            server.accept()
            failures.append("the program reached a local port")
        except BlockingIOError:
            pass
        if "root:" in content:
            failures.append("a host file was read")
    finally:
        server.close()
    record(SECTION, f"python tool: {name}", runs=1, failures=len(failures),
           detail=f"{how}: an error observation; no file written or removed outside its "
           "directory, no process left, no connection made")
    assert not failures, (failures, content)


def test_ordinary_programs_work():
    sandbox = PythonSandbox(SandboxLimits(**LIMITS))
    result = sandbox.run("import math, json, fractions, itertools, statistics, decimal, re\n"
                         "open('notes.txt', 'w').write('kept in its directory')\n"
                         "print(math.comb(10, 3), open('notes.txt').read())")
    assert result.ok and result.observation() == "120 kept in its directory\n"
    long = sandbox.run("print('z' * 1000)")
    assert long.ok and long.stdout.startswith("z" * 400) and "[... 601 characters cut]" in long.stdout
    error = sandbox.run("def f():\n    return 1 / 0\nf()")
    assert error.status == "error" and error.returncode == 1
    assert 'File "main.py", line 2, in f' in error.stderr and "ZeroDivisionError" in error.stderr
    assert "sandbox_child" not in error.stderr  # only the model's own frames
    refused = sandbox.run("x = 1\n" * 10_000)
    assert refused.status == "refused" and "longer than the limit" in refused.stderr


def test_the_tool_is_off_unless_asked_for():
    with pytest.raises(PermissionError, match="env.python_tool=true"):
        get_environment("python", task=ArithmeticTask())
    with pytest.raises(TypeError, match="SandboxLimits"):
        get_environment("python", task=ArithmeticTask(), python_tool=True, cpu=3)
