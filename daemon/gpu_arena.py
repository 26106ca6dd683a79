"""A device arena that grows and shrinks with what is loaded: segments mapped on demand.

``unified_memory_ratio`` x the device's memory is a *ceiling*, not an allocation. The arena is an
offset space in which *segments* (one device allocation each) are placed at increasing bases that
are never reused; a range handed out never crosses a segment, so ``arena[a:b]`` is one slice of
one segment. A request that fits no segment maps one new segment for all of it (a model's
placement, a client's slot ring: normally one segment each), at least ``min_segment`` bytes; a
segment whose last range is freed is released to the driver at once. Clients open each segment
once over CUDA IPC (``deepseek_flash.cuda.DeviceMemory``) and keep using offsets.

Why segments and not CUDA virtual memory (reserve one address range, map physical chunks into
it, export them as file descriptors): the segments use nothing but torch's allocator and its CUDA
IPC, the path that was measured on the H200 (an IPC open of an 8 GiB allocation: 26 ms), and they
run on the CPU with an injected allocator, so CI tests the accounting. A client pays one IPC open
per segment it has not seen yet -- one per model load or slot ring, not per block.

When the ceiling or the device is truly full, ``BudgetTooSmall`` names the request, the device's
free memory, what the arena holds and the key to change (the loader first evicts idle models).
"""
from __future__ import annotations

import bisect
import logging
import threading
from dataclasses import dataclass, field

from ..cuda import DeviceMemory
from ..errors import ArenaFull, BudgetTooSmall
from ..fsutil import align_up
from .ranges import RangeAllocator

log = logging.getLogger("deepseek_flash.fabric")

# Segments are 2 MiB multiples: CUDA's allocation granularity.
SEGMENT_ALIGNMENT = 2 << 20
# A request smaller than this maps a segment this large (capped by the ceiling), so small
# allocations (control rings, tiny models) share segments instead of mapping one each.
MIN_SEGMENT = 64 << 20
BLOCK_ALIGNMENT = 4096


@dataclass
class Segment:
    base: int
    size: int
    tensor: object = field(repr=False)          # uint8 tensor of ``size`` bytes on the device
    allocator: RangeAllocator = field(repr=False)
    ipc: dict | None = field(default=None, repr=False)   # the IPC descriptor, made once


def _torch_alloc(device: int):
    def alloc(size: int):
        import torch

        return torch.empty(size, dtype=torch.uint8, device=f"cuda:{device}")
    return alloc


def _torch_release():
    import torch

    torch.cuda.ipc_collect()     # segments clients have closed meanwhile
    torch.cuda.empty_cache()     # the freed segment back to the driver, not torch's cache


def _torch_mem_info(device: int):
    def info():
        import torch

        return torch.cuda.mem_get_info(device)
    return info


class GpuArena:
    """One device's arena (see the module docstring). Thread-safe: the loader's walk, attaches
    on their own threads and evictions all allocate and free."""

    def __init__(self, device: int, ceiling: int, copy_stream=None, *, ratio: float | None = None,
                 alloc=None, release=None, mem_info=None, min_segment: int = MIN_SEGMENT):
        self.device = device
        self.ceiling = ceiling - ceiling % SEGMENT_ALIGNMENT
        self.ratio = ratio
        self.copy_stream = copy_stream
        self.min_segment = min_segment
        self._alloc = alloc or _torch_alloc(device)
        self._release = release or _torch_release
        self._mem_info = mem_info or _torch_mem_info(device)
        self._segments: dict[int, Segment] = {}
        self._bases: list[int] = []
        self._next_base = 0
        self._lock = threading.RLock()
        self.memory = DeviceMemory()           # offset space -> segment tensors (slicing)
        self.used = 0
        self.segments_mapped = 0               # over the arena's life (stats)
        self.segments_released = 0

    @classmethod
    def create(cls, device: int, ceiling: int, ratio: float | None = None) -> GpuArena:
        import torch

        return cls(device, ceiling, torch.cuda.Stream(device=device), ratio=ratio)

    # --- sizes -----------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Bytes mapped now (the sum of the segments)."""
        with self._lock:
            return sum(s.size for s in self._segments.values())

    def available(self) -> int:
        """Bytes that could still be handed out under the ceiling (fragmentation aside)."""
        return self.ceiling - self.used

    def __getitem__(self, key: slice):
        return self.memory[key]

    # --- allocation ------------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> int:
        return self.alloc_many([nbytes])[0]

    def alloc_many(self, sizes, what: str = "allocation") -> list[int]:
        """One range per size, all or none; what fits no segment goes into one new segment."""
        sizes = list(sizes)
        with self._lock:
            offsets: list[int | None] = [None] * len(sizes)
            taken: list[int] = []
            rest: list[int] = []
            for i, n in enumerate(sizes):
                off = self._fit(n)
                if off is None:
                    rest.append(i)
                else:
                    offsets[i] = off
                    taken.append(off)
            if rest:
                need = sum(align_up(max(sizes[i], 1), BLOCK_ALIGNMENT) for i in rest)
                try:
                    seg = self._map(need, what)
                except BaseException:
                    for off in taken:
                        self.free(off)
                    raise
                for i in rest:
                    offsets[i] = seg.base + seg.allocator.alloc(sizes[i])
                self.used += seg.allocator.used
            return offsets

    def _fit(self, nbytes: int) -> int | None:
        for base in self._bases:
            seg = self._segments[base]
            before = seg.allocator.used
            try:
                off = seg.allocator.alloc(nbytes)
            except ArenaFull:
                continue
            self.used += seg.allocator.used - before
            return base + off
        return None

    def _map(self, need: int, what: str) -> Segment:
        mapped = self.size
        room = self.ceiling - mapped
        size = align_up(need, SEGMENT_ALIGNMENT)
        if size > room:
            free, total = self._mem_info()
            ratio = f"unified_memory_ratio {self.ratio} of {total}" if self.ratio else "its ceiling"
            raise BudgetTooSmall(
                f"cuda:{self.device}: {what} needs {need} more bytes; the arena holds {mapped} "
                f"bytes ({self.used} in use) of its ceiling of {self.ceiling} bytes ({ratio}); "
                f"{free} bytes are free on the device. Raise unified_memory_ratio in flash.json, "
                f"give a smaller weight_budget, or unload models",
                device=self.device, requested=need, free=free, ceiling=self.ceiling,
                mapped=mapped, key="unified_memory_ratio")
        size = max(size, min(align_up(self.min_segment, SEGMENT_ALIGNMENT), room))
        try:
            tensor = self._alloc(size)
        except Exception as exc:   # noqa: BLE001 -- torch.OutOfMemoryError (or a fake's MemoryError)
            if not _is_oom(exc):
                raise
            if size > need:    # the rounding up for small requests is a wish, not a need
                size = align_up(need, SEGMENT_ALIGNMENT)
                try:
                    tensor = self._alloc(size)
                except Exception as exc2:   # noqa: BLE001
                    if not _is_oom(exc2):
                        raise
                    raise self._oom(need, what) from exc2
            else:
                raise self._oom(need, what) from exc
        base = self._next_base
        self._next_base = base + size
        seg = Segment(base, size, tensor, RangeAllocator(size, BLOCK_ALIGNMENT,
                                                         name=f"GPU arena cuda:{self.device} segment"))
        self._segments[base] = seg
        bisect.insort(self._bases, base)
        self.memory.add(base, tensor)
        self.segments_mapped += 1
        log.info("GPU arena cuda:%d: segment of %d bytes mapped for %s (%d bytes mapped, ceiling %d)",
                 self.device, size, what, mapped + size, self.ceiling)
        return seg

    def _oom(self, need: int, what: str) -> BudgetTooSmall:
        free, total = self._mem_info()
        return BudgetTooSmall(
            f"cuda:{self.device}: {what} needs {need} more bytes but only {free} of {total} bytes "
            f"are free on the device (other processes hold the rest; the arena holds "
            f"{self.size} bytes of its ceiling of {self.ceiling}); free GPU memory, give a smaller "
            f"weight_budget, or lower unified_memory_ratio to keep the arena below what others leave",
            device=self.device, requested=need, free=free, ceiling=self.ceiling,
            key="unified_memory_ratio")

    def free(self, offset: int) -> int:
        """Return a range; a segment left empty is released to the driver. Returns its length."""
        with self._lock:
            i = bisect.bisect_right(self._bases, offset) - 1
            if i < 0:
                raise KeyError(offset)
            seg = self._segments[self._bases[i]]
            length = seg.allocator.free(offset - seg.base)
            self.used -= length
            if seg.allocator.used == 0:
                self._drop(seg)
            return length

    def _drop(self, seg: Segment) -> None:
        del self._segments[seg.base]
        self._bases.remove(seg.base)
        self.memory.remove(seg.base)
        seg.tensor = None
        seg.ipc = None
        self.segments_released += 1
        self._release()
        log.info("GPU arena cuda:%d: segment of %d bytes released (%d bytes mapped)", self.device,
                 seg.size, self.size)

    # --- clients ---------------------------------------------------------------------------------
    def ipc_descriptor(self) -> dict:
        """What a client needs to open every segment once (``cuda.DeviceMemory.update``)."""
        with self._lock:
            segments = []
            for base in self._bases:
                seg = self._segments[base]
                if seg.ipc is None:
                    seg.ipc = _share(seg.tensor)
                segments.append({"base": base, "size": seg.size, **seg.ipc})
            return {"device": self.device, "segments": segments}

    def close(self) -> None:
        with self._lock:
            for seg in list(self._segments.values()):
                self._segments.pop(seg.base)
                self.memory.remove(seg.base)
                seg.tensor = None
            self._bases.clear()
            self.used = 0


def _share(tensor) -> dict:
    storage = tensor.untyped_storage()
    (dev, handle, size_bytes, offset_bytes, ref_handle, ref_offset,
     event_handle, event_sync) = storage._share_cuda_()
    return {"handle": bytes(handle), "storage_size": int(size_bytes),
            "offset": int(offset_bytes), "ref_handle": bytes(ref_handle),
            "ref_offset": int(ref_offset), "event_handle": bytes(event_handle or b""),
            "event_sync": bool(event_sync)}


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    try:
        import torch
    except ImportError:
        return False
    return isinstance(exc, torch.OutOfMemoryError)
