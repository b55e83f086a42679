"""Atomic outputs: every result, manifest, report and export appears whole or not at all.

A local file is written to a hidden temporary sibling (`.NAME.<random>.tmp`, same directory, so
same file system), flushed and fsync'ed, then renamed onto its name with `os.replace`, which
POSIX makes atomic: a reader sees the old file or the new one, never half of either; a
process killed mid-write leaves the old file intact and at most a hidden `.tmp` sibling that
nothing reads. A directory (an HF export) is built under a temporary sibling and swapped in
by rename. On an object store (`gs://…`), whose objects become visible only once fully
uploaded, the object is written directly (there is no rename to make atomic).

Append-only logs (`metrics.jsonl`, TensorBoard events) are not rewritten whole; their readers
tolerate a torn last line (`train/metrics_log.py`).
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from etils import epath

from jaxrl_llm.core.paths import PathLike, as_path, is_remote

__all__ = ["atomic_directory", "atomic_file", "atomic_open", "atomic_write_bytes", "atomic_write_text"]

# mkstemp/mkdtemp create 0600/0700; the renamed output gets the usual umask-derived mode.
_UMASK = os.umask(0)
os.umask(_UMASK)


def _write(f: IO[bytes], data: bytes) -> None:
    """The one low-level write (a seam for the tests that kill a writer mid-write)."""
    f.write(data)


@contextlib.contextmanager
def _local_tmp(final: Path) -> Iterator[IO[bytes]]:
    """A binary file at a hidden temporary sibling of `final`, renamed onto it on success."""
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_file(path: PathLike) -> Iterator[Path]:
    """A temporary local file name for a writer that takes a path (the GGUF writer): once the
    block succeeds the file gets the usual mode, is fsync'ed and renamed onto `path` (a remote
    `path` is staged locally, then copied); on failure it is removed."""
    target = as_path(path)
    if is_remote(target):
        with tempfile.TemporaryDirectory(prefix="jaxrl-atomic-") as local:
            staged = Path(local) / target.name
            yield staged
            target.write_bytes(staged.read_bytes())
        return
    final = Path(os.fspath(target))
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: PathLike, data: bytes) -> epath.Path:
    """Write `data` to `path` atomically (see the module docstring); returns the path."""
    target = as_path(path)
    if is_remote(target):
        target.write_bytes(data)
        return target
    with _local_tmp(Path(os.fspath(target))) as f:
        _write(f, data)
    return target


def atomic_write_text(path: PathLike, text: str, encoding: str = "utf-8") -> epath.Path:
    """`atomic_write_bytes` of `text` encoded."""
    return atomic_write_bytes(path, text.encode(encoding))


@contextlib.contextmanager
def atomic_open(path: PathLike, mode: str = "w", encoding: str = "utf-8") -> Iterator[IO]:
    """`with atomic_open(p) as f: f.write(...)`: streamed to a temporary sibling (in memory for
    a remote path) and renamed onto `p` when the block ends without an error; if it raises,
    `p` is untouched."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open supports modes 'w' and 'wb', not {mode!r}")
    target = as_path(path)

    def text(raw: IO[bytes]) -> IO:
        return raw if mode == "wb" else io.TextIOWrapper(raw, encoding=encoding, newline="")

    if is_remote(target):
        buf = io.BytesIO()
        handle = text(buf)
        yield handle
        handle.flush()
        target.write_bytes(buf.getvalue())
        return
    with _local_tmp(Path(os.fspath(target))) as raw:
        handle = text(raw)
        yield handle
        handle.flush()
        if handle is not raw:
            handle.detach()  # leave `raw` open for the fsync and rename


@contextlib.contextmanager
def atomic_directory(path: PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling directory of local `path` to fill; on success it replaces
    `path` by rename (an existing `path` is kept whole until the new one is complete, then
    removed); on an error the temporary directory is removed and `path` is untouched."""
    out = Path(os.fspath(as_path(path)))
    if is_remote(os.fspath(path)):
        raise ValueError(f"atomic_directory needs a local path, got {path}")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists (pass overwrite to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tmp.chmod(0o777 & ~_UMASK)
        yield tmp
        if out.exists():
            # Two renames: the old directory stays whole until the new one is complete.
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
