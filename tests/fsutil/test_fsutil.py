"""fsutil: alignment, and a replace that leaves the old file or the new one, fsynced to the directory."""
from __future__ import annotations

import os
import stat

import pytest

from deepseek_flash import fsutil


@pytest.mark.parametrize("n, alignment, expected", [(0, 4096, 0), (1, 4096, 4096), (4096, 4096, 4096),
                                                     (4097, 4096, 8192), (12, 8, 16), (7, 1, 7)])
def test_align_up(n, alignment, expected):
    assert fsutil.align_up(n, alignment) == expected


@pytest.fixture
def fsyncs(monkeypatch):
    """(kind, st_ino) of every fsync: "dir" or "file"."""
    seen = []
    real = os.fsync

    def record(fd):
        st = os.fstat(fd)
        seen.append(("dir" if stat.S_ISDIR(st.st_mode) else "file", st.st_ino))
        real(fd)

    monkeypatch.setattr(os, "fsync", record)
    return seen


def test_atomic_write_replaces_syncs_file_then_directory(tmp_path, fsyncs):
    target = tmp_path / "status"
    target.write_bytes(b"old")
    fsutil.atomic_write(target, b"new bytes\n")
    assert target.read_bytes() == b"new bytes\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert fsyncs == [("file", target.stat().st_ino), ("dir", tmp_path.stat().st_ino)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["status"]      # no temp file left
    fsutil.atomic_write(target, b"x", mode=0o600)
    assert stat.S_IMODE(target.stat().st_mode) == 0o600


def test_atomic_write_failure_keeps_the_old_file_and_no_temp(tmp_path, monkeypatch):
    target = tmp_path / "flash_metadata.bin"
    target.write_bytes(b"old")

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as exc:
        fsutil.atomic_write(target, b"new")
    assert exc.value.errno == 28
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flash_metadata.bin"]


def test_write_synced_creates_once_and_syncs(tmp_path, fsyncs):
    path = tmp_path / "meta"
    fsutil.write_synced(path, b"abc")
    assert path.read_bytes() == b"abc" and fsyncs == [("file", path.stat().st_ino)]
    with pytest.raises(FileExistsError):
        fsutil.write_synced(path, b"again")
    fsutil.fsync_dir(tmp_path)
    fsutil.fsync_path(path)
    assert fsyncs[1:] == [("dir", tmp_path.stat().st_ino), ("file", path.stat().st_ino)]
