"""The page store of one layer: the tokens that left the device, as BICL pages in host chunks
(page-locked when CUDA is present) and, past ``host_bytes``, in spill files (kv/spill.py).

Pages are written once, in order, and never change (``append``); they are read back whole
(``fetch_all``: one copy per chunk) or by index (``fetch_selected``: one ``index_select`` over a
view of all the layer's host chunks, kv/span.py; one copy per run of consecutive pages when a
chunk is spilled or no such view can be made). A spilled chunk's pages are read back page by page, crc-checked; a corrupt
page fails the step (strict) or is marked lost and left out of attention from then on (graceful).
"""
from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

import torch

from deepseek_flash.errors import KVPageCorrupt

from .layout import unpack_pages
from .span import HostSpan
from .spill import SpilledChunk

log = logging.getLogger("deepseek_flash.kv.cache")

CHUNK_BYTES = 16 << 20
"""Host pages are allocated (and spilled) in chunks of up to this many bytes per layer; a layer's
first chunk holds 4 pages and each next one twice as many, so a short context allocates little."""
FIRST_CHUNK_PAGES = 4


@dataclass
class Chunk:
    """``capacity`` pages of one layer for every sequence: ``tensor[i * batch + b]`` is page
    ``first + i`` of sequence ``b``. On the host (``tensor``) or on disk (``spilled``)."""

    first: int
    capacity: int
    tensor: torch.Tensor | None
    spilled: SpilledChunk | None = None
    filled: int = 0

    @property
    def full(self) -> bool:
        return self.filled == self.capacity

    @property
    def on_host(self) -> bool:
        return self.tensor is not None


_FOREACH = [True]  # False once torch refused a host->device _foreach_copy_ (logged once)


def _copy_all(dsts, srcs, non_blocking: bool) -> None:
    """``dsts[i].copy_(srcs[i])`` for every i, in one ``_foreach_copy_`` where torch takes it."""
    if _FOREACH[0]:
        try:
            torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)
            return
        except (RuntimeError, TypeError, AttributeError) as exc:  # nothing was copied then
            _FOREACH[0] = False
            log.warning("host chunks are copied one call each: _foreach_copy_ refused (%s)", exc)
    for dst, src in zip(dsts, srcs):
        dst.copy_(src, non_blocking=non_blocking)


class LayerPages:
    """Pages ``0 .. n_pages - 1`` of one layer, every sequence of the batch. ``cache`` gives the
    layout, the counters, the spill store and the recovery mode (a weak proxy: the layer owns
    this store and the cache owns the layer)."""

    def __init__(self, cache, index: int):
        self._cache = cache
        self.index = index
        self.batch = 0
        self.dtype: torch.dtype | None = None
        self.device: torch.device | None = None
        self.n_pages = 0
        self.chunks: list[Chunk] = []
        self._firsts: list[int] = []
        self.lost_pages: set[int] = set()
        self._span: HostSpan | None = None  # the one-gather view of the host chunks (kv/span.py)
        self._span_failed = False
        self._unmapped_logged = False
        self.written = None  # CUDA event after the last page write (what a prefetch waits for)
        self._unread_writes = False  # the compute stream has not waited for ``written`` yet

    def bind(self, batch: int, dtype: torch.dtype, device: torch.device) -> None:
        self.batch, self.dtype, self.device = batch, dtype, device

    # --- accounting --------------------------------------------------------------------------
    def host_bytes(self) -> int:
        return sum(c.tensor.numel() * c.tensor.element_size() for c in self.chunks
                   if c.tensor is not None)

    def spilled_bytes(self) -> int:
        return sum(c.spilled.file_bytes for c in self.chunks if c.spilled is not None)

    def all_on_host(self) -> bool:
        return all(c.tensor is not None for c in self.chunks)

    def spillable(self) -> list[Chunk]:
        """Full chunks still on the host, oldest first."""
        return [c for c in self.chunks if c.tensor is not None and c.filled == c.capacity]

    def invalidate_span(self) -> None:
        """A chunk was added or left the host: the gather view is rebuilt at the next fetch."""
        self._span = None

    def clear(self) -> None:
        self._span = None
        for chunk in self.chunks:
            if chunk.tensor is not None:
                self._cache.host_memory.free(chunk.tensor)
                chunk.tensor = None
        self.chunks.clear()
        self._firsts.clear()

    # --- write -------------------------------------------------------------------------------
    def append(self, pages: torch.Tensor) -> None:
        """Append packed pages ``[n, batch, 2, heads, page_tokens, head_dim]`` (kv/layout.py's
        ``pack_pages``) after the last one. From a GPU the copies to the host run on the cache's
        write stream, off the compute stream (a long prefill's later layers do not wait for
        them); ``written`` marks their end and the first read of this layer's host pages on the
        compute stream waits for it (``before_read``)."""
        cache = self._cache
        n, b = pages.shape[0], self.batch
        if not cache.pinned:
            self._copy_in(pages, n, b, False)
            return
        stream = cache.write_stream()
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the pages are packed
        with torch.cuda.stream(stream):
            self._copy_in(pages, n, b, True)
            self.written = torch.cuda.Event()
            self.written.record(stream)
        pages.record_stream(stream)  # not reused before the copies have read it
        self._unread_writes = True

    def _copy_in(self, pages, n: int, b: int, non_blocking: bool) -> None:
        done = 0
        while done < n:
            chunk = self._open_chunk()
            room = chunk.capacity - chunk.filled
            m = min(room, n - done)
            dst = chunk.tensor[chunk.filled * b:(chunk.filled + m) * b]
            dst.copy_(pages[done:done + m].reshape(m * b, *pages.shape[2:]),
                      non_blocking=non_blocking)
            chunk.filled += m
            done += m
        self.n_pages += n

    def before_read(self) -> None:
        """CUDA: the current stream waits for this layer's page writes still in flight (once
        per write); every read of the host pages on the device comes after it."""
        if self._unread_writes:
            torch.cuda.current_stream(self.device).wait_event(self.written)
            self._unread_writes = False

    def _open_chunk(self) -> Chunk:
        cache = self._cache
        if self.chunks and self.chunks[-1].filled < self.chunks[-1].capacity:
            return self.chunks[-1]
        last = self.chunks[-1] if self.chunks else None
        first = last.first + last.capacity if last else 0
        capacity = cache.next_chunk_pages(last.capacity if last else 0)
        shape = (capacity * self.batch, *cache.layout.shape)
        tensor = cache.host_memory.alloc(shape, self.dtype)
        chunk = Chunk(first, capacity, tensor)
        self._span = None
        self.chunks.append(chunk)
        self._firsts.append(first)
        return chunk

    def chunk_of(self, page: int) -> Chunk:
        return self.chunks[bisect.bisect_right(self._firsts, page) - 1]

    # --- read --------------------------------------------------------------------------------
    def chunk_pages(self, chunk: Chunk) -> torch.Tensor:
        """The host tensor of a chunk's filled pages; a spilled chunk is read back into a
        staging buffer (every page crc-checked)."""
        b = self.batch
        if chunk.tensor is not None:
            return chunk.tensor[:chunk.filled * b]
        staging = self._cache._staging(chunk.filled * b)
        for j in range(chunk.filled * b):
            if chunk.first + j // b in self.lost_pages:
                staging[j].zero_()  # left out of attention; not read again
            else:
                self.read_spilled(chunk, j, staging[j])
        return staging

    def read_spilled(self, chunk: Chunk, j: int, dest: torch.Tensor) -> bool:
        """Read row ``j`` of a spilled chunk into ``dest``; False when the page is corrupt and
        the cache is graceful (the page is then lost: zeroed and left out of attention)."""
        cache = self._cache
        b = self.batch
        page, row = chunk.first + j // b, j % b
        try:
            cache.spill.read_page(chunk.spilled, j, dest, layer=self.index, page=page, row=row)
        except KVPageCorrupt as exc:
            cache.page_lost(exc, self.lost_pages, page)
            dest.zero_()
            return False
        cache.counters["pages_read_spilled"] += 1
        return True

    def fetch_all(self):
        """Every page onto the device -> keys, values ``[b, h, n_pages * page_tokens, d]``: one
        copy per chunk, straight into one buffer."""
        cache = self._cache
        b, shape = self.batch, cache.layout.shape
        if len(self.chunks) == 1 and self.device.type == "cpu":
            pages = self.chunk_pages(self.chunks[0])
        else:
            pages = torch.empty((self.n_pages * b, *shape), dtype=self.dtype, device=self.device)
            # every chunk's copy in one call (an eager step is bound by the host: one dispatch,
            # not a slice and a copy_ per chunk; at 32K on an 8B shape a layer has ~12 chunks)
            srcs = [c.tensor if c.full and c.tensor is not None else self.chunk_pages(c)
                    for c in self.chunks]
            dsts = pages.split([src.shape[0] for src in srcs])
            _copy_all(dsts, srcs, cache.pinned)
        pages = pages.view(self.n_pages, b, *shape)
        cache.counters["pages_fetched"] += self.n_pages * self.batch
        return unpack_pages(pages)

    def span(self) -> HostSpan | None:
        """The one-gather view of this layer's host chunks, or None where it cannot be used: a
        chunk spilled, or (on a GPU) chunks that kernels cannot read where they lie (not
        page-locked, or an arena not mapped for the device), or the view failed."""
        if self._span is not None:
            return self._span
        cache = self._cache
        if self._span_failed or not self.chunks or not self.all_on_host():
            return None
        if self.device.type == "cuda" and not all(cache.host_memory.device_readable(c.tensor)
                                                  for c in self.chunks):
            if not self._unmapped_logged:
                self._unmapped_logged = True
                log.info("layer %d: host pages not mapped for the device at their addresses; "
                         "top-K pages are copied run by run", self.index)
            return None
        try:
            self._span = HostSpan(self.chunks, self.batch, cache.layout, self.device)
        except (RuntimeError, TypeError, ValueError, AttributeError) as exc:
            log.warning("layer %d: no single-gather view of the host pages (%s); top-K pages are "
                        "copied run by run", self.index, exc)
            self._span_failed = True
            return None
        return self._span

    def fetch_selected(self, chosen: torch.Tensor):
        """Pages ``chosen`` ``[b, k]`` -> keys, values ``[b, h, k * page_tokens, d]``.

        With every chunk on the host: one ``index_select`` over the view of the chunks, indices
        computed on the device (kv/span.py) -- no host sync. Otherwise, on a GPU each run of consecutive host pages is one host->device copy straight into the
        step's buffer (a page is contiguous: BICL); on the CPU one gather per chunk. Spilled
        pages are read into a host buffer first."""
        cache = self._cache
        b, k = chosen.shape
        span = self.span()
        if span is not None:
            try:
                out = span.gather(chosen)
            except RuntimeError as exc:  # refused by a check of torch's: copy runs from now on
                log.warning("layer %d: the one-gather fetch failed (%s); top-K pages are copied "
                            "run by run", self.index, exc)
                self._span, self._span_failed = None, True
            else:
                cache.counters["pages_fetched"] += b * k
                return out
        idx = chosen.cpu().tolist()  # the only host sync of this path
        shape = cache.layout.shape
        if self.device.type == "cpu":
            out = torch.empty((k * b, *shape), dtype=self.dtype)
        else:
            out = torch.empty((k * b, *shape), dtype=self.dtype, device=self.device)
        for row in range(b):
            j = 0
            while j < k:
                page = idx[row][j]
                chunk = self.chunk_of(page)
                # the run of selected pages that are consecutive and in the same chunk
                e = j + 1
                limit = chunk.first + chunk.filled
                while e < k and idx[row][e] == idx[row][e - 1] + 1 and idx[row][e] < limit:
                    e += 1
                local = page - chunk.first
                if chunk.tensor is None:
                    src = cache._staging(e - j)
                    for n in range(e - j):
                        self.read_spilled(chunk, (local + n) * b + row, src[n])
                elif b == 1:
                    src = chunk.tensor[local:local + e - j]
                else:
                    src = chunk.tensor[local * b + row:(local + e - j) * b:b]
                dst = out[j * b + row:e * b:b] if b > 1 else out[j:e]
                dst.copy_(src, non_blocking=cache.pinned)
                j = e
        cache.counters["pages_fetched"] += b * k
        return unpack_pages(out.view(k, b, *shape))
