"""crc32c: known vectors, hardware vs software on random data, chaining, buffer kinds."""
from __future__ import annotations

import random

import numpy as np
import pytest

from deepseek_flash import _core


def test_known_vectors():
    assert _core.crc32c(b"123456789") == 0xE3069283
    assert _core.crc32c_sw(b"123456789") == 0xE3069283
    assert _core.crc32c(b"") == 0
    # RFC 3720 (iSCSI) B.4 vectors.
    assert _core.crc32c(bytes(32)) == 0x8A9136AA
    assert _core.crc32c(b"\xff" * 32) == 0x62A8AB43
    assert _core.crc32c(bytes(range(32))) == 0x46DD794E
    assert _core.crc32c(bytes(range(31, -1, -1))) == 0x113FDB5C


def test_hw_available_on_x86():
    import platform

    if platform.machine() == "x86_64":
        with open("/proc/cpuinfo") as f:
            assert _core.hw_crc32c() == (" sse4_2" in f.read())


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 63, 4096, 4097, 1 << 20, (3 << 20) + 5])
def test_hw_equals_sw_random(size):
    rng = random.Random(size)
    data = rng.randbytes(size)
    for start in range(8):  # every misalignment of the start pointer
        view = memoryview(data)[start:]
        assert _core.crc32c(view) == _core.crc32c_sw(view)


def test_chaining_and_seed():
    rng = random.Random(1)
    a, b = rng.randbytes(1000), rng.randbytes(3333)
    assert _core.crc32c(b, _core.crc32c(a)) == _core.crc32c(a + b)
    assert _core.crc32c_sw(b, _core.crc32c_sw(a)) == _core.crc32c(a + b)


def test_buffer_kinds():
    data = bytes(range(256)) * 17
    expect = _core.crc32c(data)
    assert _core.crc32c(bytearray(data)) == expect
    assert _core.crc32c(np.frombuffer(data, np.uint8)) == expect
    assert _core.crc32c(memoryview(data)) == expect
    with pytest.raises(TypeError):
        _core.crc32c("not a buffer")
    with pytest.raises((BufferError, ValueError)):
        _core.crc32c(np.arange(100, dtype=np.uint8)[::2])  # not contiguous
