"""Shared fixtures for the native core tests: a directory on a real disk (O_DIRECT works) and one where
O_DIRECT is refused (tmpfs on older kernels, ramfs), so both paths of every reader and writer run."""
from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest


def _direct_ok(directory: str) -> bool:
    probe = os.path.join(directory, ".odirect-probe")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


@pytest.fixture
def disk_dir():
    """A directory where O_DIRECT works (tests fail, not skip, when the machine has none)."""
    for base in (os.environ.get("DEEPSEEK_FLASH_TEST_DISK"), "/var/tmp", tempfile.gettempdir(), os.getcwd()):
        if base and os.path.isdir(base) and _direct_ok(base):
            with tempfile.TemporaryDirectory(dir=base, prefix="flash-ext-") as d:
                yield Path(d)
            return
    pytest.fail("no directory accepting O_DIRECT; set DEEPSEEK_FLASH_TEST_DISK")


@pytest.fixture(scope="session")
def _nodirect_root():
    """A directory where open(O_DIRECT) fails with EINVAL: /dev/shm on kernels whose tmpfs refuses it,
    else a ramfs mounted for the session (needs root; skipped with the reason otherwise)."""
    base = "/dev/shm"
    if os.path.isdir(base) and not _direct_ok(base):
        with tempfile.TemporaryDirectory(dir=base, prefix="flash-ext-") as d:
            yield Path(d)
        return
    mnt = tempfile.mkdtemp(prefix="flash-ramfs-")
    if subprocess.run(["mount", "-t", "ramfs", "ramfs", mnt], capture_output=True).returncode != 0:
        os.rmdir(mnt)
        pytest.skip("no file system refusing O_DIRECT: /dev/shm accepts it and mounting ramfs needs root")
    try:
        assert not _direct_ok(mnt)
        yield Path(mnt)
    finally:
        # Lazy: an engine the garbage collector has not closed yet may still hold a file here.
        subprocess.run(["umount", "-l", mnt], check=True)
        os.rmdir(mnt)


@pytest.fixture
def nodirect_dir(_nodirect_root):
    """A fresh directory where open(O_DIRECT) fails with EINVAL."""
    with tempfile.TemporaryDirectory(dir=_nodirect_root, prefix="t-") as d:
        yield Path(d)


@pytest.fixture(params=["disk", "nodirect"])
def any_dir(request):
    """Each test using this runs once with O_DIRECT available and once where it is refused."""
    yield request.getfixturevalue(f"{request.param}_dir")


@pytest.fixture
def faults():
    """For tests that inject read faults: they need a test build of the native core."""
    from deepseek_flash import _core

    if not _core.fault_injection:
        pytest.fail("IOEngine.inject_fault is compiled only into test builds: rebuild with "
                    "DEEPSEEK_FLASH_FAULT_INJECTION=1 pip install --no-build-isolation -e .")
