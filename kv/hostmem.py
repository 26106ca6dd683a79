"""Where the host tier's chunks live: the process's own memory (page-locked when CUDA is present:
ranges of this process's ``HostPool``, deepseek_flash/hostpool.py, page-locked once and reused
by every later cache), or, for a model from ``load_model``, the controller's host arena -- the
memory the daemon (or the embedded controller) shares with its clients and accounts for.

``ArenaMemory`` asks the controller for a region per chunk (``kv_alloc``: the daemon makes room
as for a demand load, and counts it in ``host_bytes_used`` and ``kv_arena_bytes``), views it
through the client's mapping of the arena, and gives it back when the chunk is spilled or the
cache closes (``kv_free``); the controller frees whatever a departed client still held. When the
arena has no room (``OutOfMemory``) a chunk falls back to the process's own memory
(``arena_fallbacks`` counts them): nothing fails and nothing is lost. After a daemon restart the
old regions stay readable (this process keeps the old mapping) but are no longer the new
daemon's: they are never freed there.
"""
from __future__ import annotations

import logging
import math

import torch

from deepseek_flash.errors import FlashError, OutOfMemory
from deepseek_flash.hostpool import HostPool, process_pool

log = logging.getLogger("deepseek_flash.kv.cache")

POOL_REGION_BYTES = 64 << 20


def _mapped(tensor) -> bool:
    """``tensor``'s first and last byte are mapped for the device at their host addresses."""
    from deepseek_flash.cuda import device_address

    first = tensor.data_ptr()
    last = first + tensor.numel() * tensor.element_size() - 1
    return device_address(first) == first and device_address(last) == last


class OwnMemory:
    """Chunks in this process's memory: page-locked ones from a ``HostPool``
    (deepseek_flash/hostpool.py; this process's unless one is given), so that a cache reuses what
    an earlier one page-locked -- the tiered cache's chunks and pruning's row buffers alike."""

    arena = False

    def __init__(self, pinned: bool, pool: HostPool | None = None):
        self.pinned = pinned
        self._pool = pool

    def pool(self) -> HostPool | None:
        """Where page-locked buffers of this cache come from (None: pageable memory)."""
        if not self.pinned:
            return None
        if self._pool is None:
            self._pool = process_pool()
        return self._pool

    def alloc(self, shape, dtype) -> torch.Tensor:
        if not self.pinned:
            return torch.empty(shape, dtype=dtype)
        return self.pool().tensor(shape, dtype)

    def device_readable(self, tensor) -> bool:
        """Whether kernels may read ``tensor`` (a chunk of this memory) at its host address
        (kv/span.py): page-locked and mapped for the device there (a pool slab that stayed
        pageable is not), as the driver says."""
        return self.pinned and _mapped(tensor)

    def free(self, tensor) -> None:
        pass

    def close(self) -> None:
        pass


class ArenaMemory:
    """Chunks in the controller's host arena, through ``client`` for open model ``model``."""

    arena = True

    def __init__(self, client, model: str, pinned: bool, counters: dict):
        self.client, self.model, self.pinned = client, model, pinned
        self.counters = counters
        self.own = OwnMemory(pinned)
        self.regions: dict[int, tuple[int, int]] = {}  # data_ptr -> (offset, client generation)
        self._readable: bool | None = None
        self._pool: HostPool | None = None

    def pool(self) -> HostPool | None:
        """Page-locked buffers of this cache other than its chunks (pruning's rows) as ranges of
        arena regions taken ``POOL_REGION_BYTES`` at a time, given back with the cache
        (``close``); None without CUDA (pageable buffers of this process)."""
        if not self.pinned:
            return None
        if self._pool is None:
            self._pool = HostPool(POOL_REGION_BYTES,
                                  lambda n: (self.alloc((n,), torch.uint8), None))
        return self._pool

    def alloc(self, shape, dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        try:
            offset = self.client.call("kv_alloc", {"model": self.model, "bytes": nbytes})["offset"]
        except OutOfMemory as exc:
            if not self.counters["arena_fallbacks"]:
                log.warning("%s; KV chunks of this cache go to this process's memory", exc)
            self.counters["arena_fallbacks"] += 1
            return self.own.alloc(shape, dtype)
        base = self.client.host_tensor(pinned=self.pinned)
        tensor = base[offset:offset + nbytes].view(dtype).view(shape)
        self.regions[tensor.data_ptr()] = (offset, self.client.generation)
        return tensor

    def device_readable(self, tensor) -> bool:
        """Whether kernels may read ``tensor`` (a chunk of this cache) at its host address
        (kv/span.py): an arena region when the arena is page-locked and mapped for the device at
        the same addresses, first to last byte (asked once); a chunk that fell back to this
        process's memory as ``OwnMemory`` answers."""
        if tensor.data_ptr() not in self.regions:
            return self.own.device_readable(tensor)
        if self._readable is None:
            from deepseek_flash.cuda import device_address

            self._readable = False
            if self.pinned:
                base = self.client.host_tensor(pinned=True)
                first, last = base.data_ptr(), base.data_ptr() + base.numel() - 1
                self._readable = (device_address(first) == first
                                  and device_address(last) == last)
        return self._readable

    def free(self, tensor) -> None:
        region = self.regions.pop(tensor.data_ptr(), None)
        if region is None:
            return
        offset, generation = region
        if generation != self.client.generation:
            return  # a region of a daemon that has since restarted: not the new one's to free
        try:
            self.client.call("kv_free", {"offset": offset})
        except (FlashError, OSError) as exc:
            log.debug("KV region at %d not freed: %s", offset, exc)

    def close(self) -> None:
        for ptr in list(self.regions):
            offset, generation = self.regions.pop(ptr)
            if generation == self.client.generation:
                try:
                    self.client.call("kv_free", {"offset": offset})
                except (FlashError, OSError) as exc:
                    log.debug("KV region at %d not freed: %s", offset, exc)
