"""Where the host tier's chunks live: the process's own memory (page-locked when CUDA is present),
or, for a model from ``load_model``, the controller's host arena -- the memory the daemon (or the
embedded controller) shares with its clients and accounts for.

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

log = logging.getLogger("deepseek_flash.kv.cache")


class OwnMemory:
    """Chunks in this process's memory."""

    arena = False

    def __init__(self, pinned: bool):
        self.pinned = pinned

    def alloc(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=self.pinned)

    def device_readable(self) -> bool:
        """Whether kernels may read the chunks at their host addresses (kv/span.py): torch's
        page-locked memory is mapped for the device at its host address."""
        return self.pinned

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

    def device_readable(self) -> bool:
        """Whether kernels may read the chunks at their host addresses (kv/span.py): the arena
        is page-locked and mapped for the device at the same addresses, first to last byte
        (asked once; the arena's own chunks and the fallback chunks of torch's page-locked
        memory are both readable then)."""
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
