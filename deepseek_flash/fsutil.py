"""Small file-system helpers every writer shares: alignment and the crash-safe replace of a file.

A file others read (status tree, store metadata, unit files, profiles) is never rewritten in
place: ``atomic_write`` puts the new bytes in a temp file in the same directory, fsyncs it,
renames it over the old name and fsyncs the directory, so the rename itself survives a power cut.
A reader sees the old file or the new one, never a half-written one, and a failure leaves the
old file and no temp file behind. Writers that build a whole directory first (pack, prune) write
its files with ``write_synced`` and publish the directory with one rename and ``fsync_dir``.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def align_up(n: int, alignment: int) -> int:
    """``n`` rounded up to a multiple of ``alignment``."""
    return (n + alignment - 1) // alignment * alignment


def fsync_path(path, directory: bool = False) -> None:
    """fsync a file, or a directory (its entries: creations, renames, deletions)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path) -> None:
    fsync_path(path, directory=True)


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_synced(path, data, mode: int = 0o644) -> None:
    """Create ``path`` (which must not exist) holding ``data``, fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path, data, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` (file mode ``mode``): temp file in the same directory,
    fsync, rename, directory fsync."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)              # mkstemp makes 0600
        _write_all(fd, data)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        os.unlink(tmp)
        raise
    fsync_dir(path.parent)
