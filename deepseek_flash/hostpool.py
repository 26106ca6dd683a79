"""Page-locked host memory allocated once and reused: ``HostPool`` hands out byte ranges of large
slabs and takes a range back when the last tensor viewing it is gone.

Why: page-locking is slow (~30 ms per 36 MB on an H200 host), so a buffer page-locked inside a
prefill or a decode step costs that step its time. A pool page-locks its slabs once
(``chunk_bytes`` at a time, more for a larger request) and recycles their ranges between buffers, caches and requests: a cache built after another reuses
its memory without page-locking anything.

* ``take(nbytes)`` / ``tensor(shape, dtype)``: a CPU tensor over a range no live tensor of the
  pool covers (4 KiB-aligned, first fit over the slabs). Nothing to free by hand: the range comes
  back when every tensor that views it has been dropped (the tensor's storage holds a numpy view
  whose finalizer returns it), so no range is handed out twice while something can still read it.
* A returned range may still be read by a copy the device has not finished (an asynchronous copy,
  a gather over the page-locked memory): returned ranges wait, and are reused only after
  ``sync`` (by default every CUDA device this process started is synchronised), which the pool
  calls at most once per request that the free ranges cannot serve -- before growing.
* ``trim()`` gives wholly free slabs back (to torch's page-locked cache, or unmapped); nothing
  else shrinks the pool.

Slabs come from ``slab_source(nbytes) -> (uint8 tensor, release or None)``: by default
page-locked memory from torch (pageable where CUDA is absent; the ranges work either way). A
cache whose host chunks live in the controller's host arena (kv/hostmem.py) gives a source
that takes its slabs from the arena (already page-locked). ``process_pool()`` is the one pool of
this process (created at first use, as torch keeps one caching host allocator per process),
which kv/ uses unless a caller passes its own.
"""
from __future__ import annotations

import bisect
import collections
import math
import mmap
import threading
import weakref

import numpy as np
import torch

ALIGN = 4096
CHUNK_BYTES = 256 << 20


def _round(n: int) -> int:
    return max(ALIGN, -(-n // ALIGN) * ALIGN)


def pageable_slab(nbytes: int):
    """An anonymous mapping of ``nbytes`` (page-aligned): (uint8 tensor over it, None)."""
    return torch.from_numpy(np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)), None


def pinned_slab(nbytes: int):
    """``nbytes`` of page-locked memory (torch's cudaHostAlloc, as every page-locked buffer of
    kv/ was before the pool: kernels read it at its host address, kv/span.py) where CUDA is
    present, else ``pageable_slab``: (uint8 tensor, None -- torch keeps the memory it page-locked
    for its own later use once the pool drops it)."""
    if not torch.cuda.is_available():
        return pageable_slab(nbytes)
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), None


def sync_devices() -> None:
    """Every copy this process queued on a CUDA device is done."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)


class _Slab:
    __slots__ = ("tensor", "array", "size", "free", "release")

    def __init__(self, tensor: torch.Tensor, release):
        self.tensor = tensor
        self.array = tensor.numpy()
        self.size = tensor.numel()
        self.free: list[list[int]] = [[0, self.size]]  # sorted [offset, size], coalesced
        self.release = release

    def take(self, size: int) -> int | None:
        for i, (off, n) in enumerate(self.free):
            if n >= size:
                if n == size:
                    del self.free[i]
                else:
                    self.free[i] = [off + size, n - size]
                return off
        return None

    def give(self, off: int, size: int) -> None:
        i = bisect.bisect_left(self.free, [off, 0])
        self.free.insert(i, [off, size])
        if i + 1 < len(self.free) and off + size == self.free[i + 1][0]:
            self.free[i][1] += self.free.pop(i + 1)[1]
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == off:
            self.free[i - 1][1] += self.free.pop(i)[1]

    def idle(self) -> bool:
        return self.free == [[0, self.size]]


class HostPool:
    def __init__(self, chunk_bytes: int = CHUNK_BYTES, slab_source=None, sync=sync_devices):
        self.chunk_bytes = _round(chunk_bytes)
        self.slab_source = slab_source or pinned_slab
        self.sync = sync
        self.slabs: list[_Slab] = []
        self._returned = collections.deque()  # (slab, offset, size): appended by finalizers
        self._lock = threading.Lock()
        self.counters = {"slab_allocs": 0, "takes": 0, "syncs": 0, "trimmed_bytes": 0}

    # --- accounting ---------------------------------------------------------------------------
    def reserved_bytes(self) -> int:
        return sum(s.size for s in self.slabs)

    def used_bytes(self) -> int:
        """Bytes of ranges held by live tensors (returned ranges not yet reused excluded)."""
        waiting = sum(n for _, _, n in self._returned)
        return sum(s.size - sum(n for _, n in s.free) for s in self.slabs) - waiting

    def stats(self) -> dict:
        with self._lock:
            return {"slabs": len(self.slabs), "reserved_bytes": self.reserved_bytes(),
                    **self.counters}

    # --- ranges -------------------------------------------------------------------------------
    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` bytes (contents undefined) over a range of a slab."""
        size = _round(int(nbytes))
        with self._lock:
            self.counters["takes"] += 1
            got = self._first_fit(size)
            if got is None and self._returned:
                # returned ranges are reused once the device has finished reading them
                self.sync()
                self.counters["syncs"] += 1
                self._recycle()
                got = self._first_fit(size)
            if got is None:
                got = self._grow(size)
            slab, off = got
        view = slab.array[off:off + size]
        weakref.finalize(view, self._returned.append, (slab, off, size)).atexit = False
        return torch.from_numpy(view)[:nbytes]

    def tensor(self, shape, dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return self.take(nbytes).view(dtype).view(shape)

    def trim(self) -> int:
        """Give back every slab with no live range (after the device is done); bytes released."""
        with self._lock:
            if self._returned:
                self.sync()
                self.counters["syncs"] += 1
                self._recycle()
            keep, released = [], 0
            for slab in self.slabs:
                if slab.idle():
                    released += slab.size
                    if slab.release is not None:
                        slab.release()
                else:
                    keep.append(slab)
            self.slabs = keep
            self.counters["trimmed_bytes"] += released
            return released

    def _first_fit(self, size: int):
        for slab in self.slabs:
            off = slab.take(size)
            if off is not None:
                return slab, off
        return None

    def _grow(self, size: int):
        tensor, release = self.slab_source(max(self.chunk_bytes, size))
        slab = _Slab(tensor, release)
        self.slabs.append(slab)
        self.counters["slab_allocs"] += 1
        return slab, slab.take(size)

    def _recycle(self) -> None:
        while self._returned:
            slab, off, size = self._returned.popleft()
            if slab in self.slabs:
                slab.give(off, size)


_process_pool: HostPool | None = None
_process_lock = threading.Lock()


def process_pool() -> HostPool:
    """This process's page-locked pool (created at first use)."""
    global _process_pool
    with _process_lock:
        if _process_pool is None:
            _process_pool = HostPool()
        return _process_pool
