"""Atomic outputs: every export, manifest, results and report file is written under a temporary
name and renamed (`jaxrl_llm/core/atomic.py`). A writer that fails or is SIGKILLed mid-write leaves
the old file intact (or no file at all), and no writer in the package bypasses the helper."""

from __future__ import annotations

import ast
import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jaxrl_llm.core import atomic
from tests.reliability import record

pytestmark = pytest.mark.reliability
SECTION = "atomic outputs"
PACKAGE = Path(__file__).resolve().parents[1] / "jaxrl_llm"
OLD = '{"old": "complete contents"}\n'  # valid JSON: some writers read the old file first


class Killed(Exception):
    """What the patched low-level write raises after writing half its bytes."""


@pytest.fixture
def dies_mid_write(monkeypatch):
    """Every atomic file write writes half its bytes to disk, then fails."""
    def half_then_die(f, data):
        f.write(data[: len(data) // 2])
        f.flush()
        raise Killed("killed mid-write")

    monkeypatch.setattr(atomic, "_write", half_then_die)


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp" in p.name)


def _manifest(path: Path) -> None:
    from jaxrl_llm.data.shards import Manifest, write_manifest

    write_manifest(path.parent, Manifest(num_records=3))


def _eval(path: Path) -> None:
    from jaxrl_llm.eval.evaluate import write_eval

    write_eval(path.parent, {"pass@1": 0.5})


def _plot(path: Path) -> None:
    import matplotlib.pyplot as plt

    from jaxrl_llm.eval.plots import _save

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    _save(fig, path)


def _iterate_stages(path: Path) -> None:
    from jaxrl_llm.flows.iterate import StageLog

    StageLog(path.parent).mark("train", {"steps": 3})


# (writer, file name it writes): each goes through `atomic_write_*`.
WRITERS = {"record manifest (data/shards.py)": (_manifest, "manifest.json"),
           "eval.json (eval/evaluate.py)": (_eval, "eval.json"),
           "plot PNG (eval/plots.py)": (_plot, "plot.png"),
           "iterate stage log (iterate.py)": (_iterate_stages, "stages.json")}


@pytest.mark.parametrize("name", sorted(WRITERS))
@pytest.mark.parametrize("existing", [True, False], ids=["over-old-file", "new-file"])
def test_writer_killed_mid_write_leaves_old_file_or_none(tmp_path, dies_mid_write, name,
                                                         existing):
    writer, filename = WRITERS[name]
    path = tmp_path / filename
    if existing:
        path.write_text(OLD)
    with pytest.raises(Killed):
        writer(path)
    if existing:
        assert path.read_text() == OLD
    else:
        assert not path.exists()
    assert leftovers(tmp_path) == []  # the failed temporary file is removed
    record(SECTION, f"{name} killed mid-write " + ("over an old file" if existing else
                                                   "(new file)"), runs=1, failures=0,
           detail="old file intact" if existing else "no file at the final name")


def test_writers_write_the_file_when_not_killed(tmp_path):
    """The same writers without the failure write complete files (so the test above can fail)."""
    for name, (writer, filename) in WRITERS.items():
        directory = tmp_path / name.split()[0]
        directory.mkdir()
        writer(directory / filename)
        assert (directory / filename).stat().st_size > 0, name
        assert leftovers(directory) == [], name
    assert json.loads((tmp_path / "record" / "manifest.json").read_text())["num_records"] == 3


def test_atomic_open_failing_block_leaves_old_file(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text(OLD)
    with pytest.raises(Killed), atomic.atomic_open(path) as f:
        f.write('{"a": 1}\n')
        raise Killed
    assert path.read_text() == OLD and leftovers(tmp_path) == []
    with atomic.atomic_open(path) as f:
        f.write('{"a": 1}\n')
    assert path.read_text() == '{"a": 1}\n'
    record(SECTION, "streamed JSONL (data export-jsonl) fails mid-stream", runs=1, failures=0,
           detail="old file intact")


def test_export_directory_killed_mid_save_keeps_the_old_export(tmp_path, monkeypatch):
    from jaxrl_llm.policy.export import atomic_save
    from jaxrl_llm.weights import hf

    out = tmp_path / "export"
    out.mkdir()
    (out / "model.safetensors").write_text(OLD)

    def half_export(model, directory, **kwargs):
        (Path(directory) / "config.json").write_text("{}")
        raise Killed("killed mid-export")

    monkeypatch.setattr(hf, "save_pretrained", half_export)
    with pytest.raises(Killed):
        atomic_save(object(), out, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no temporary left
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert (out / "model.safetensors").read_text() == OLD

    def full_export(model, directory, **kwargs):
        (Path(directory) / "model.safetensors").write_text("new")
        (Path(directory) / "config.json").write_text("{}")

    monkeypatch.setattr(hf, "save_pretrained", full_export)
    atomic_save(object(), out, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    assert (out / "model.safetensors").read_text() == "new" and (out / "config.json").exists()
    assert oct(out.stat().st_mode & 0o777) == oct(0o777 & ~atomic._UMASK)  # not mkdtemp's 0700
    record(SECTION, "HF export killed mid-save", runs=1, failures=0,
           detail="old export directory intact, temporary directory removed; a complete save "
           "swaps in by rename")


SIGKILLED_WRITER = textwrap.dedent(
    """
    import os, signal, sys
    from jaxrl_llm.core import atomic

    def half_then_sigkill(f, data):
        f.write(data[: len(data) // 2])
        f.flush()
        os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    atomic._write = half_then_sigkill
    atomic.atomic_write_text(sys.argv[1], "new contents " * 100000)
    """
)


def test_sigkill_mid_write_leaves_the_old_file(tmp_path):
    """A real SIGKILL (no cleanup runs): the final name still holds the old file; the half
    written bytes sit in a hidden `.NAME.*.tmp` sibling that no reader opens."""
    runs = 3
    for i in range(runs):
        path = tmp_path / f"results-{i}.json"
        path.write_text(OLD)
        proc = subprocess.run([sys.executable, "-c", SIGKILLED_WRITER, str(path)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
        assert path.read_text() == OLD
        stray = [p for p in tmp_path.iterdir() if p.name.startswith(f".{path.name}.")]
        assert len(stray) == 1 and stray[0].name.endswith(".tmp")
        assert 0 < stray[0].stat().st_size < len("new contents " * 100000)
    record(SECTION, "SIGKILL mid-write (subprocess)", runs=runs, failures=0,
           detail="final name keeps the old file; half-written bytes only in a hidden .tmp "
           "sibling")


def test_sigkill_proof_reproduces_on_a_plain_write(tmp_path):
    """Control: the same kill during a plain `write_text` does leave a torn file, so the test
    above would catch a writer that bypassed the helper."""
    path = tmp_path / "results.json"
    path.write_text(OLD)
    script = textwrap.dedent("""
        import os, signal, sys
        with open(sys.argv[1], "w") as f:
            f.write("new contents " * 50000)
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(path)], timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert path.read_text() != OLD


# -- no writer bypasses the helper -----------------------------------------------------------

WRITE_CALLS = {"write_text", "write_bytes", "save_file", "savefig", "save_pretrained",
               "ArrayRecordWriter", "copyfile", "copy2"}
# Module-level writers that take a file: np.save(file, a), json.dump(obj, file), ...
FILE_WRITERS = {("np", "save"), ("np", "savez"), ("numpy", "save"), ("json", "dump"),
                ("yaml", "dump"), ("yaml", "safe_dump")}
# (file under jaxrl_llm/, call) -> why it is not an atomic-helper write (atomic.py is exempt).
ALLOWED = {
    ("policy/export.py", "save_pretrained"): "hf.save_pretrained into atomic_directory's temporary "
    "directory",
    ("policy/export.py", "write_bytes"): "a staged GGUF copied to a remote object (objects appear "
    "whole)",
    ("weights/lora_export.py", "save_file"): "into atomic_file's temporary file (safetensors "
    "takes a path)",
    ("weights/hf_export.py", "save_file"): "writes into the temporary directory of "
    "atomic_directory (export.atomic_save; models may not import the helper)",
    ("weights/hf_export.py", "write_text"): "as above",
    ("weights/hf_export.py", "copyfile"): "as above",
    ("weights/hf_export.py", "save_pretrained"): "as above (the tokenizer's files)",
    ("flows/quickstart.py", "save_pretrained"): "into atomic_directory's temporary directory",
    ("eval/plots.py", "savefig"): "into an in-memory buffer, then atomic_write_bytes",
    ("data/shards.py", "save"): "np.save into an in-memory buffer, then atomic_write_bytes",
    ("data/shards.py", "ArrayRecordWriter"): "shards are complete before the manifest, "
    "written last and atomically, names them (write_shard also renames a .tmp)",
    ("train/metrics_log.py", "open"): "append-only log; readers drop a torn last line",
    ("train/metrics_log.py", "write_text"): "remote object rewrite (objects appear whole)",
    ("core/paths.py", "open"): "append_text: append-only logs",
    ("generate/vllm_host.py", "open"): "the host's lock file (flock, holds a pid) and its "
    "append-only log",
    ("core/paths.py", "write_text"): "append_text on a remote object (objects appear whole)",
    ("envs/sandbox.py", "write_text"): "the Python tool's code, into the run's own temporary "
    "directory (removed after the run)",
    ("envs/sandbox.py", "open"): "the Python tool's captured stdout/stderr, in the run's own "
    "temporary directory (removed after the run)",
    ("train/checkpoint.py", "write_bytes"): "an item's file (the online queue) inside the "
    "Orbax step's temporary directory, committed with the step or not at all",
}


def _mode(call: ast.Call, position: int) -> str | None:
    mode = next((k.value for k in call.keywords if k.arg == "mode"), None)
    if mode is None and len(call.args) > position:
        mode = call.args[position]
    return mode.value if isinstance(mode, ast.Constant) and isinstance(mode.value, str) else None


def direct_writes(source: str) -> list[tuple[int, str]]:
    """(line, call) of every file write in `source` that is not through the atomic helper."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name == "open":
            mode = _mode(node, 0 if isinstance(func, ast.Attribute) else 1)
            if mode and set(mode) & set("wax+"):
                out.append((node.lineno, "open"))
        elif name in WRITE_CALLS:
            out.append((node.lineno, name))
        elif (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
              and (func.value.id, name) in FILE_WRITERS and len(node.args) >= 2):
            out.append((node.lineno, name))
    return out


def test_no_writer_bypasses_the_atomic_helper():
    bypass = []
    for f in sorted(PACKAGE.rglob("*.py")):
        rel = f.relative_to(PACKAGE).as_posix()
        if rel == "core/atomic.py":  # the helper itself
            continue
        for line, call in direct_writes(f.read_text(encoding="utf-8")):
            if (rel, call) not in ALLOWED:
                bypass.append(f"jaxrl_llm/{rel}:{line}: {call}()")
    assert len(direct_writes("p.write_text(s)\nopen(p, 'w')\nq.open('a')\nfig.savefig(p)\n"
                             "json.dump(d, f)\nnp.save(f, a)")) == 6
    assert not direct_writes("open(p)\np.open('rb')\natomic_write_text(p, s)\n"
                             "yaml.safe_dump(d)\nmanager.save(step)")
    record(SECTION, "AST audit of writers in jaxrl_llm/", runs=1, failures=int(bool(bypass)),
           detail="write_text/write_bytes/open(w)/json.dump/np.save/save_file/savefig/"
           "save_pretrained outside jaxrl_llm/core/atomic.py only where allowed with a reason "
           "(into a temporary directory or buffer, append-only logs, remote objects)")
    assert not bypass, "write through jaxrl_llm/core/atomic.py:\n" + "\n".join(bypass)


def test_hf_exporter_is_called_only_through_the_atomic_directory():
    callers = []
    for f in sorted(PACKAGE.rglob("*.py")):
        if "save_pretrained(" in f.read_text(encoding="utf-8") and f.parent.name not in ("models", "weights"):  # the exporters themselves
            callers.append(f.relative_to(PACKAGE).as_posix())
    assert callers == ["flows/quickstart.py", "policy/export.py"], callers  # both inside atomic_directory
