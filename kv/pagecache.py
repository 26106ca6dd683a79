"""``PageCache``: a top-K layer's chosen pages kept on the device between steps.

The pages a top-K layer chooses change little from one decode step to the next (88-93 % of a
step's choice was also the previous step's, docs/kv.md), yet without this cache every chosen page
crosses PCIe every step. Here each top-K layer keeps ``capacity`` page slots on the device (the
pages' BICL form, kv/layout.py, one slot per page and sequence) and three small device tables:
which slot holds a page (``slot_of_page``), which page a slot holds (``page_of_slot``) and the
step a slot's page was last chosen (``last_used``). A step:

1. the chosen pages ``[b, k]`` (ascending) are looked up: a *hit* is a page in a slot;
2. each *miss* gets a victim slot: the least recently chosen slots that hold no page chosen now
   (empty slots first), in the order of the misses (``capacity >= k`` always, so there are
   enough);
3. one ``index_select`` over a single view of the layer's host chunks **and** the slots
   (kv/span.py, ``HostSpan(..., extra=slots)``) reads each chosen page from its slot (a hit: device
   memory) or from its host chunk (a miss: the only bytes that cross PCIe), in the order the
   uncached gather produces -- the same bytes, so attention is bit-for-bit the same;
4. the gathered pages are written to their slots (one ``index_copy_`` into the slots; a hit's to
   its own slot: the same bytes), the tables updated.

All of it is fixed-shape tensor work on the device, no host sync: on CUDA it is part of the
layer's captured choice-and-gather graph (kv/graphs.py). Hits and misses are counted on the
device and read by ``cache.stats()``.

Capacity: ``page_cache``. A number (the default 1.5): that multiple of the layer's top-K page
count, rounded up to ``GROW_SLOTS``, within the layer's share of the device budget
(``device_budget``). ``"auto"`` (an option, for a GPU with room): every page of the layer -- a
chosen page crosses PCIe once, when it is first chosen, and stays -- with an eighth more as room to
grow (``capacity_for``), within the same budget; where the budget holds fewer than every page, as
many slots as the share holds (the least recently chosen pages give way). It holds more of the GPU
than a ``DynamicCache`` would (every page, on top of the tiered cache's own ~10 %), so it is not
the default: the tiered cache's point is that only the pages a query needs are on the GPU. Either
grows (slots kept) as the layer's pages or its top-K outgrow it (a fractional ``top_k_pages`` grows
with the context).
"""
from __future__ import annotations

import logging
import math

import torch

log = logging.getLogger("deepseek_flash.kv.cache")

AUTO = "auto"
"""``page_cache="auto"``: slots for every page of the layer, within the device budget (an option:
top-K's speed with no page crossing twice, at more GPU memory than a full ``DynamicCache``)."""

PAGE_CACHE_DEFAULT = 1.5
"""Default capacity of a top-K layer's page cache, as a multiple of its top-K page count: the GPU
holds the chosen pages and half as many again (at top-K 25 % on an 8B shape ~35 % of the full KV,
~45 % with the tiered cache's own), so the GPU KV stays bounded by the choice, not the context."""

GROW_SLOTS = 16
"""Capacities are multiples of this many page slots."""

ALIGN = 4096
"""The slots' base address alignment (the gather's rows are up to 4 KiB: kv/span.py)."""

DEVICE_SHARE = 0.25
"""The page caches of one ``TieredCache`` together take at most this share of the device memory
torch could still allocate when its first slots are made (``device_budget``): ``"auto"`` or the
multiple sizes a layer's slots, the device bounds them all (at 128K on an 8B shape every page is
~16 GB and even 1.5 x k ~6 GB, more than a 16 GiB GPU has to spare). Why a quarter: the slots are
a cache, fixed once made; three quarters of what was free stay for activations, the next cache of
a serving process and other processes. A layer whose top-K does not fit its share runs without
slots (logged once per cache)."""

_NEVER = 1 << 62  # a stamp larger than any step: slots holding a page chosen now are not victims


def wanted(k: int, multiple, n: int) -> int:
    """The slots a layer of ``n`` pages and a top-K of ``k`` wants now: every page (``AUTO``)
    or ``multiple * k``; at least ``k``."""
    return max(k, n if multiple == AUTO else math.ceil(multiple * k))


def capacity_for(k: int, multiple, n: int = 0) -> int:
    """Slots to make for a top-K of ``k`` pages out of ``n``: ``wanted``, with an eighth of the
    pages more for ``AUTO`` (at least ``GROW_SLOTS``: the layer grows page by page while decoding
    and a growth moves the slots), rounded up to ``GROW_SLOTS``."""
    want = wanted(k, multiple, n)
    if multiple == AUTO:
        want = max(k, n + max(GROW_SLOTS, n // 8))
    return -(-want // GROW_SLOTS) * GROW_SLOTS


def device_budget(device: torch.device) -> int | None:
    """Bytes the page caches of one cache may hold on ``device``: ``DEVICE_SHARE`` of what torch
    could still allocate there -- the device's free memory plus torch's cached free blocks,
    within the per-process fraction when one is set -- or None off CUDA (no budget: the
    multiple alone)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    room = free + max(0, torch.cuda.memory_reserved(device) - allocated)
    fraction = torch.cuda.get_per_process_memory_fraction(device)
    if fraction < 1.0:
        room = min(room, int(fraction * total) - allocated)
    return max(0, int(DEVICE_SHARE * room))


def slot_bytes(layer) -> int:
    """Device bytes one slot costs a layer: a page of every sequence and its table entries."""
    return layer.batch * (layer._cache.layout.page_bytes + 2 * 8)


def _aligned(shape, dtype, device) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` whose first byte is ``ALIGN``-aligned."""
    elem = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * elem
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, device=device)
    off = (-raw.data_ptr()) % ALIGN
    return raw[off:off + nbytes].view(dtype).view(shape)


class PageCache:
    """One top-K layer's page slots on the device and their tables."""

    def __init__(self, multiple):
        self.multiple = multiple
        self.capacity = 0
        self.slots: torch.Tensor | None = None  # [b * capacity, *page shape], row b * C + slot
        self.slot_of_page: torch.Tensor | None = None  # [b, pages + 1]; last column: scratch
        self.page_of_slot: torch.Tensor | None = None  # [b, capacity]
        self.last_used: torch.Tensor | None = None  # [b, capacity + 1]; last column: scratch
        self.seq_base: torch.Tensor | None = None  # [b, 1]: b * capacity
        self.step = None  # [1] int64, the layer's step count (the stamps of last_used)
        self.hits = self.misses = self.last_misses = None  # [1] int64 device counters
        self._span = None
        self._span_key = None
        self.refused = False  # a view was refused, or no room (logged once)
        self.limit: int | None = None  # most slots the device budget allows (None: no limit)
        self._seq_rows_key = self._seq_rows_t = None

    # --- memory ----------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Device bytes held: the slots (all of the capacity) and the tables."""
        if self.slots is None:
            return 0
        tensors = (self.slots, self.slot_of_page, self.page_of_slot, self.last_used)
        return sum(t.numel() * t.element_size() for t in tensors)

    def ensure(self, layer, k: int) -> None:
        """Room for a top-K of ``k`` pages out of the layer's pages; grown (contents kept) when
        short. Any growth moves buffers: the graph key (``key``) changes with it."""
        b, n = layer.batch, layer.n_pages
        dev = layer.device
        if self.refused:
            return
        if self.slots is None:
            self.limit = layer._cache._page_cache_slot_limit(layer)
            self.step = torch.zeros(1, dtype=torch.int64, device=dev)
            self.hits = torch.zeros(1, dtype=torch.int64, device=dev)
            self.misses = torch.zeros(1, dtype=torch.int64, device=dev)
            self.last_misses = torch.zeros(1, dtype=torch.int64, device=dev)  # the last step's
        if self.capacity < wanted(k, self.multiple, n):
            cap = capacity_for(k, self.multiple, n)
            if self.limit is not None and cap > self.limit:
                if self.limit < k:
                    layer._cache._page_cache_refused(layer, k, self.limit)
                    self.refuse()
                    return
                cap = max(k, self.limit // GROW_SLOTS * GROW_SLOTS)
        else:
            cap = self.capacity
        if cap > self.capacity:
            shape = layer._cache.layout.shape
            slots = _aligned((b * cap, *shape), layer.dtype, dev)
            page_of_slot = torch.full((b, cap), -1, dtype=torch.int64, device=dev)
            last_used = torch.full((b, cap + 1), -1, dtype=torch.int64, device=dev)
            if self.slots is not None:
                old = self.capacity
                slots.view(b, cap, *shape)[:, :old] = self.slots.view(b, old, *shape)
                page_of_slot[:, :old] = self.page_of_slot
                last_used[:, :old] = self.last_used[:, :old]
            self.slots, self.page_of_slot, self.last_used = slots, page_of_slot, last_used
            self.capacity = cap
            self.seq_base = (torch.arange(b, device=dev) * cap).view(b, 1)
        if self.slot_of_page is None or self.slot_of_page.shape[1] < n + 1:
            grown = torch.full((b, max(2 * n, 64) + 1), -1, dtype=torch.int64, device=dev)
            if self.slot_of_page is not None:
                held = self.slot_of_page.shape[1] - 1
                grown[:, :held] = self.slot_of_page[:, :held]
            self.slot_of_page = grown

    def key(self) -> tuple:
        """What a captured graph over this cache depends on (addresses of every buffer)."""
        return (self.capacity, self.slots.data_ptr(), self.slot_of_page.data_ptr(),
                self.page_of_slot.data_ptr(), self.last_used.data_ptr())

    def span(self, layer):
        """The one view of the layer's host chunks and these slots (kv/span.py), or None where
        the host pages have no single view (a spilled chunk, the controller's arena on a GPU)."""
        from .span import HostSpan

        host = layer.pages.span()
        if host is None:
            return None
        # the host view itself (held, compared by identity: a new view built after the old one
        # was freed may come at the old one's id) and where the slots lie
        key = (host, self.slots.data_ptr())
        if self._span_key is None or self._span_key[0] is not host or self._span_key[1] != key[1]:
            self._span = None
            try:
                self._span = HostSpan(layer.chunks, layer.batch, layer._cache.layout,
                                      layer.device, extra=self.slots)
            except (RuntimeError, TypeError, ValueError, AttributeError) as exc:
                log.warning("layer %d: no view of the host pages and the page cache's slots "
                            "(%s); its chosen pages are fetched every step", layer.index, exc)
                self.refuse()
                return None
            self._span_key = key
        return self._span

    def refuse(self) -> None:
        """No page cache for this layer from now on: the slots and tables are freed (the counts
        so far stay)."""
        self.refused = True
        self.slots = self.slot_of_page = self.page_of_slot = self.last_used = None
        self._span = self._span_key = None

    # --- a step ------------------------------------------------------------------------------
    def gather_into(self, span, chosen: torch.Tensor, out_rows: torch.Tensor) -> None:
        """Pages ``chosen`` ``[b, k]`` into the rows ``out_rows`` (the order of
        ``HostSpan.gather``), hits from the slots, misses from the host; then the slots and the
        tables updated. Fixed shapes, no host sync (capturable)."""
        b, k = chosen.shape
        cap = self.capacity
        # (each operation here is a node of the layer's captured graph, and a node costs the
        # device a few us whatever its size: the fewest that compute the same tables)
        slot = self.slot_of_page.gather(1, chosen)
        miss = slot < 0
        held = torch.where(miss, cap, slot)  # the scratch column for misses
        stamp = self.last_used.scatter(1, held, _NEVER)[:, :cap]
        order = stamp.argsort(dim=1, stable=True)  # empty, then least recently chosen, slots first
        # the i-th miss takes order[i - 1]: misses so far (itself included) index the order with
        # one column in front (a hit's pick is not used)
        picked = torch.nn.functional.pad(order, (1, 0)).gather(1, miss.cumsum(1))
        new_slot = torch.where(miss, picked, slot)
        # the page each slot held leaves the table (scratch column for an empty slot, -1 % width;
        # a hit's own entry is cleared and written again just below)
        evicted = self.page_of_slot.gather(1, new_slot)
        self.slot_of_page.scatter_(1, evicted.remainder(self.slot_of_page.shape[1]), -1)
        self.slot_of_page.scatter_(1, chosen, new_slot)
        self.page_of_slot.scatter_(1, new_slot, chosen)
        self.last_used.scatter_(1, new_slot, self.step.expand(b, k))
        self.step.add_(1)
        self.last_misses.copy_(miss.sum())
        self.misses.add_(self.last_misses)
        self.hits.sub_(self.last_misses).add_(b * k)
        # in the slots' rows: b * capacity * units + slot * units, one operation
        slot_start = torch.add(self._seq_rows(span.units_per_page), new_slot,
                               alpha=span.units_per_page)
        start = torch.where(miss, span.table.gather(1, chosen), slot_start + span.extra_row)
        torch.index_select(span.rows, 0, span.rows_at(start), out=out_rows)
        span.extra_rows.index_copy_(0, span.rows_at(slot_start), out_rows)

    def _seq_rows(self, units: int) -> torch.Tensor:
        """``seq_base * units``: the slots' first row of each sequence (made once per shape)."""
        key = (units, self.seq_base.data_ptr())
        if self._seq_rows_key != key:
            self._seq_rows_key, self._seq_rows_t = key, self.seq_base * units
        return self._seq_rows_t

    def gather(self, span, chosen: torch.Tensor):
        """``gather_into`` a new buffer -> keys, values ``[b, kv_heads, k * page_tokens, d]``."""
        b, k = chosen.shape
        out = span.rows.new_empty((2 * b * span.kv_heads * k * span.units_per_head,
                                   span.rows.shape[1]))
        self.gather_into(span, chosen, out)
        return span.unpack(out, b, k)

    def snapshot(self):
        """The device counters now (a graph's capture step runs the step twice: kv/graphs.py
        puts them back after the second run)."""
        return self.hits.clone(), self.misses.clone(), self.last_misses.clone()

    def restore(self, snap) -> None:
        self.hits.copy_(snap[0])
        self.misses.copy_(snap[1])
        self.last_misses.copy_(snap[2])

    def counts(self) -> tuple[int, int, int]:
        """(hits, misses) so far and the misses of the last step (a host sync)."""
        if self.hits is None:
            return 0, 0, 0
        both = torch.cat((self.hits, self.misses, self.last_misses)).tolist()
        return both[0], both[1], both[2]
