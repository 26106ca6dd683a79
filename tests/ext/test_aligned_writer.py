"""AlignedWriter: exact bytes and length on O_DIRECT and buffered files, offsets, padding, errors."""
from __future__ import annotations

import errno
import os
import random

import pytest

from deepseek_flash import _core
from deepseek_flash.errors import ClosedError, FlashIOError, InvalidArgument


def _write_pattern(path, chunks, direct=True, buffer_size=1 << 20):
    expect = bytearray()
    with _core.AlignedWriter(str(path), direct=direct, buffer_size=buffer_size) as w:
        for chunk in chunks:
            if isinstance(chunk, int):
                assert w.pad_to(chunk) == len(expect) + (-len(expect)) % chunk
                expect += bytes((-len(expect)) % chunk)
            else:
                assert w.write(chunk) == len(expect)
                expect += chunk
            assert w.tell() == len(expect)
        direct_used = w.direct
    return bytes(expect), direct_used


def test_direct_on_disk_buffered_where_refused(disk_dir, nodirect_dir):
    with _core.AlignedWriter(str(disk_dir / "a")) as w:
        assert w.direct
    with _core.AlignedWriter(str(nodirect_dir / "a")) as w:
        assert not w.direct
    with _core.AlignedWriter(str(disk_dir / "b"), direct=False) as w:
        assert not w.direct


@pytest.mark.parametrize("seed", range(4))
def test_random_writes_exact_bytes(any_dir, seed):
    rng = random.Random(seed)
    chunks = []
    for _ in range(60):
        r = rng.random()
        if r < 0.15:
            chunks.append(rng.choice([4096, 512, 8]))
        else:
            chunks.append(rng.randbytes(rng.choice([1, 100, 4095, 4096, 70000, 1 << 20, (1 << 20) + 3])))
    path = any_dir / f"f{seed}"
    expect, _ = _write_pattern(path, chunks)
    assert os.path.getsize(path) == len(expect)
    assert path.read_bytes() == expect


@pytest.mark.parametrize("total", [0, 1, 4095, 4096, 4097, (1 << 20) - 1, 1 << 20, 3 * (1 << 20) + 17])
def test_exact_length_at_buffer_edges(disk_dir, total):
    data = random.Random(total).randbytes(total)
    path = disk_dir / "edge"
    expect, direct = _write_pattern(path, [data])
    assert direct
    assert path.read_bytes() == expect == data


def test_large_single_write(disk_dir):
    data = os.urandom(20 << 20)
    path = disk_dir / "big"
    with _core.AlignedWriter(str(path), buffer_size=8 << 20) as w:
        assert w.write(memoryview(data)[:5]) == 0
        assert w.write(memoryview(data)[5:]) == 5
    assert path.read_bytes() == data


def test_close_is_idempotent_and_write_after_close_fails(disk_dir):
    w = _core.AlignedWriter(str(disk_dir / "c"))
    w.write(b"abc")
    w.close()
    w.close()
    assert w.closed
    with pytest.raises(ClosedError) as exc:
        w.write(b"x")
    assert exc.value.code == 201 and exc.value.errno == errno.EBADF
    assert exc.value.path == str(disk_dir / "c") and str(disk_dir / "c") in str(exc.value)
    with pytest.raises(ClosedError):
        w.pad_to(4096)
    assert (disk_dir / "c").read_bytes() == b"abc"


def test_bad_alignment_is_an_invalid_argument_naming_the_file(disk_dir):
    with _core.AlignedWriter(str(disk_dir / "p")) as w:
        with pytest.raises(InvalidArgument) as exc:
            w.pad_to(0)
    assert exc.value.code == 202 and exc.value.errno == errno.EINVAL
    assert exc.value.path == str(disk_dir / "p") and isinstance(exc.value, ValueError)


def test_create_failure_is_typed(disk_dir):
    with pytest.raises(FlashIOError) as ei:
        _core.AlignedWriter(str(disk_dir / "missing" / "f"))
    assert ei.value.errno == 2
    assert ei.value.path == str(disk_dir / "missing" / "f")
    assert ei.value.code == 200


def test_write_error_surfaces_as_flash_io_error(disk_dir):
    # /dev/full fails every write with ENOSPC; the writer thread's error reaches the caller.
    w = _core.AlignedWriter("/dev/full", direct=False)
    w.write(bytes(3 << 20))
    with pytest.raises(FlashIOError) as ei:
        w.close()
    assert ei.value.errno == 28
    assert ei.value.path == "/dev/full"
