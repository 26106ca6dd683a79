"""The device arena's offset allocator: alignment, exhaustion, coalescing."""
from __future__ import annotations

import random

import pytest
from deepseek_flash.daemon.ranges import RangeAllocator

from deepseek_flash.errors import ArenaFull


def test_aligned_first_fit_and_full():
    a = RangeAllocator(10 * 4096, 4096, name="test arena")
    offs = [a.alloc(1) for _ in range(10)]
    assert offs == [i * 4096 for i in range(10)]
    with pytest.raises(ArenaFull) as exc:
        a.alloc(1)
    assert exc.value.code == 211 and "test arena" in str(exc.value)


def test_free_coalesces_back_to_one_range():
    rng = random.Random(7)
    a = RangeAllocator(1 << 24, 4096)
    live = {}
    for _ in range(2000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            assert a.free(off) == live.pop(off)
        else:
            n = rng.randrange(1, 200_000)
            try:
                off = a.alloc(n)
            except ArenaFull:
                continue
            assert off % 4096 == 0
            for o, length in live.items():
                assert off + n <= o or o + length <= off, "overlap"
            live[off] = -(-n // 4096) * 4096
    for off in list(live):
        a.free(off)
    assert a.used == 0 and a.largest_free() == a.size


def test_alloc_many_is_all_or_nothing():
    a = RangeAllocator(4 * 4096, 4096)
    assert a.alloc_many([1, 4096]) == [0, 4096]
    with pytest.raises(ArenaFull):
        a.alloc_many([4096, 4096, 1])          # three pages wanted, two free
    assert a.used == 2 * 4096 and a.largest_free() == 2 * 4096
