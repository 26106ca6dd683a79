"""The host side of a streaming client in daemon mode: the leases of its streamed blocks and the
page-locking of just their host ranges in this process, in the background (``StreamedHost``), so
that ``load_model`` never page-locks the daemon's whole host arena on the attach path. Used by
``client.stream.start_streaming``.
"""
from __future__ import annotations

import logging
import threading
import time

from ..errors import FlashError
from ..fsutil import align_up
from ..wire import Plan

log = logging.getLogger("deepseek_flash.stream")


class StreamedHost:
    """The host side of one streaming client in daemon mode: leases of the streamed blocks and
    the page-locking of *their* ranges in this process, both off the attach path.

    ``load_model`` must not page-lock the daemon's whole host arena (seconds, growing with the
    host cache). Instead a background thread takes each streamed layer's lease in forward order
    and page-locks just those blocks' ranges (merged where adjacent); until a range is pinned
    its copies run from pageable memory (correct, slower), after that at link speed. The
    runtime's first pass asks for a layer through ``fetch`` too; each layer is leased once.
    ``close`` stops the thread, unpins what it pinned, and releases the leases.
    """

    def __init__(self, client, model: str, plan: Plan, blocks: dict, host_address: int,
                 register=None, unregister=None, priority: int = 0):
        from ..cuda import register_host_range, unregister_host_memory

        self.client, self.model, self.plan, self.blocks = client, model, plan, blocks
        self.address = host_address
        self.priority = priority
        self._register = register or register_host_range
        self._unregister = unregister or unregister_host_memory
        self._leases: dict[int, object] = {}         # layer -> lease
        self._layer_locks = {layer: threading.Lock() for layer in plan.streamed_layers}
        self._pinned: list[int] = []                  # addresses this object registered
        self._stop = threading.Event()
        self.pinned_bytes = 0
        self.pin_seconds: float | None = None         # time to pin every streamed range
        self._thread = threading.Thread(target=self._run, daemon=True, name="flash-stream-pin")

    def start(self) -> StreamedHost:
        self._thread.start()
        return self

    def fetch(self, layer: int) -> dict:
        """The layer's ``{block id: host offset}`` under a lease (taken once)."""
        with self._layer_locks[layer]:
            lease = self._leases.get(layer)
            if lease is None:
                lease = self._leases[layer] = self.client.acquire(
                    self.model, blocks=self.plan.stream_blocks[layer], priority=self.priority)
            return lease.blocks

    def _run(self) -> None:
        start = time.monotonic()
        try:
            for layer in self.plan.streamed_layers:
                if self._stop.is_set():
                    return
                for begin, end in _merged_ranges(self.fetch(layer), self.blocks):
                    if self._stop.is_set():
                        return
                    if self._register(self.address + begin, end - begin):
                        self._pinned.append(self.address + begin)
                        self.pinned_bytes += end - begin
            self.pin_seconds = time.monotonic() - start
            log.debug("streamed host ranges page-locked: %d bytes in %.2f s", self.pinned_bytes,
                      self.pin_seconds)
        except Exception as exc:   # noqa: BLE001 -- copies stay pageable (slower), never wrong
            log.warning("page-locking the streamed host ranges stopped: %s", exc)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for address in self._pinned:
            self._unregister(address)
        self._pinned = []
        for lease in self._leases.values():
            try:
                self.client.release(lease)
            except FlashError as exc:   # the daemon went away: its leases went with it
                log.debug("releasing a streamed lease: %s", exc)
        self._leases = {}


def _merged_ranges(offsets: dict, blocks: dict) -> list[tuple[int, int]]:
    """Page-aligned ``[begin, end)`` host ranges covering the blocks, adjacent ones merged (each
    block starts 4 KiB-aligned in the arena and owns the pages up to the next 4 KiB)."""
    ranges: list[list[int]] = []
    for bid, off in sorted(offsets.items(), key=lambda kv: kv[1]):
        end = off + align_up(blocks[bid].length, 4096)
        if ranges and ranges[-1][1] == off:
            ranges[-1][1] = end
        else:
            ranges.append([off, end])
    return [(a, b) for a, b in ranges]
