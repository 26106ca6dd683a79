"""Offset allocator for device arenas: first fit over a sorted, coalescing free list.

The host arena has its own allocator in C++ (it lives in shared memory next to the bytes); device
arenas hold a few hundred to a few thousand blocks whose placement is decided in Python, so a
sorted list with bisect is exact and fast enough, and easy to reason about under eviction.

The allocator owns its lock: an arena's ranges are taken and given back by the loader (model
placements) and by the attachments (slot rings) on different threads, so the books are kept
consistent here rather than by whichever lock each caller happens to hold.
"""
from __future__ import annotations

import bisect
import threading

from ..errors import ArenaFull
from ..fsutil import align_up


class RangeAllocator:
    """Hands out ``alignment``-aligned ranges of ``[0, size)``; ``free`` merges neighbours."""

    def __init__(self, size: int, alignment: int = 4096, name: str = "arena"):
        self.size = size - size % alignment
        self.alignment = alignment
        self.name = name
        self._starts: list[int] = [0] if self.size else []   # free ranges, sorted by start
        self._lengths: dict[int, int] = {0: self.size} if self.size else {}
        self._used: dict[int, int] = {}                      # allocated start -> length
        self.used = 0
        self._lock = threading.Lock()

    def _round(self, nbytes: int) -> int:
        return max(self.alignment, align_up(nbytes, self.alignment))

    def alloc(self, nbytes: int) -> int:
        with self._lock:
            return self._alloc_locked(nbytes)

    def _alloc_locked(self, nbytes: int) -> int:
        length = self._round(nbytes)
        for i, start in enumerate(self._starts):
            free_len = self._lengths[start]
            if free_len >= length:
                del self._lengths[start]
                if free_len == length:
                    del self._starts[i]
                else:
                    self._starts[i] = start + length
                    self._lengths[start + length] = free_len - length
                self._used[start] = length
                self.used += length
                return start
        raise ArenaFull(
            f"{self.name}: no free range of {length} bytes (size {self.size}, used {self.used}, "
            f"largest free {max(self._lengths.values(), default=0)})",
            requested=length, size=self.size, used=self.used)

    def alloc_many(self, sizes) -> list[int]:
        """One range per size, all or none (what was taken is given back on failure)."""
        offsets: list[int] = []
        with self._lock:
            try:
                for nbytes in sizes:
                    offsets.append(self._alloc_locked(nbytes))
            except ArenaFull:
                for off in offsets:
                    self._free_locked(off)
                raise
        return offsets

    def free(self, start: int) -> int:
        """Return a range; returns its length."""
        with self._lock:
            return self._free_locked(start)

    def _free_locked(self, start: int) -> int:
        length = self._used.pop(start)
        freed = length
        self.used -= length
        i = bisect.bisect_left(self._starts, start)
        # Merge with the following free range.
        if i < len(self._starts) and self._starts[i] == start + length:
            length += self._lengths.pop(self._starts[i])
            del self._starts[i]
        # Merge with the preceding free range.
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._lengths[prev] == start:
                self._lengths[prev] += length
                return freed
        self._starts.insert(i, start)
        self._lengths[start] = length
        return freed

    def largest_free(self) -> int:
        with self._lock:
            return max(self._lengths.values(), default=0)

    def free_bytes(self) -> int:
        return self.size - self.used
