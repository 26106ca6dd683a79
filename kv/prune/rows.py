"""One level of one layer's demoted pages on the host, as the rows of one buffer, so that a step
recalls them in one operation (docs/kv.md, "Importance pruning: the cost of a recall").

``HostRows`` holds ``len(self)`` pages in slots ``0 .. len - 1`` (dense: a removed page's slot is
filled by the last page), each page ``batch`` rows of ``row_bytes`` bytes (one row per sequence:
``buf[slot * batch + b]``) in one uint8 buffer, page-locked when the cache's device is a GPU.

* every page, in slot order (lossless recall): ``all()`` -- one copy of the buffer's prefix;
* chosen rows ``[m]`` given on the device (top-K recall): ``gather(rows)`` -- one
  ``index_select`` that a GPU runs over the page-locked buffer itself (kv/span.py's
  ``raw_view``: page-locked memory is readable by kernels at its host address), no host sync;
  where no such view can be made, the indices come to the host and the rows go over in one copy;
* pages named on the host (an evaluation's moves): ``fetch(pages)`` (on the device, one gather)
  or ``rows(pages)`` (on the host: what a spill writes).

The buffer grows to twice its capacity when full. A pageable buffer (no CUDA) halves when three
quarters are free, so ``nbytes()`` (what it holds, counted in ``host_bytes``) stays within twice
what its pages need (none when empty). A page-locked one comes from a ``HostPool``
(deepseek_flash/hostpool.py: page-locking costs ~30 ms per 36 MB on an H200 host, so the pool
page-locks its slabs once per process and a buffer given up -- by a resize, or with its cache --
goes back to it for the next) and is never shrunk (a resize inside an evaluation is a copy of the
rows: it keeps what it once needed, and ``reserve`` sizes it ahead). A write on the host side
(a removal's row move, a resize) must not race a copy still reading the buffer: the caller synchronises the device first (``LayerPrune._apply``).
"""
from __future__ import annotations

import logging
import math

import torch

from deepseek_flash.hostpool import process_pool

log = logging.getLogger("deepseek_flash.kv.cache")

MAX_UNIT = 4096


class HostRows:
    MOVE_DEVICES = ("cuda",)
    """Devices whose kernels move pages within the buffer (``_move_on_device``); a test adds
    "cpu" to run the same index arithmetic on the CPU."""
    verified: set = set()
    """(check, device, pool) whose read-back check passed in this process: the device's view of
    the pool's memory (``"view"``) and its page moves in it (``"move"``). The check is one device
    wait and a copy to the host (~2.4 ms on an H200 host, 30 layers' buffers: ~70 ms inside one
    evaluation), so it runs once per device and pool, not once per buffer."""

    def __init__(self, row_bytes: int, batch: int, device: torch.device, pool=None):
        self.row_bytes = int(row_bytes)
        self.batch = int(batch)
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        # page-locked buffers come from a pool (deepseek_flash/hostpool.py): page-locking once
        # per process, not at each resize nor for each cache
        self.pool = pool if pool is not None or not self.pinned else process_pool()
        self.buf: torch.Tensor | None = None  # uint8 [capacity * batch, row_bytes]
        self.pages: list[int] = []            # slot -> page
        self.slot: dict[int, int] = {}        # page -> slot
        self.version = 0                      # bumped by every put and remove
        self._ids: tuple[int, torch.Tensor] | None = None
        self._view: torch.Tensor | None = None  # the buffer as the device reads it (gather)
        self._view_failed = False
        self._units = 1
        self._unit_ar: torch.Tensor | None = None
        self._pending = False         # page moves the GPU may still be writing into ``buf``
        self._moves_checked = False   # the GPU's first page move was read back and matched
        self._moves_failed = False    # ... or did not: page moves stay on the host

    # --- accounting ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.pages)

    def __contains__(self, page: int) -> bool:
        return page in self.slot

    @property
    def capacity(self) -> int:
        return 0 if self.buf is None else self.buf.shape[0] // self.batch

    def nbytes(self) -> int:
        return 0 if self.buf is None else self.buf.numel()

    def page_bytes(self) -> int:
        """Bytes of one page (every sequence)."""
        return self.batch * self.row_bytes

    # --- writes -------------------------------------------------------------------------------
    def _wait(self) -> None:
        """Before the host reads or rewrites ``buf``: the GPU's page moves into it are done."""
        if self._pending:
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            self._pending = False

    def _resize(self, capacity: int) -> None:
        self._wait()
        live = len(self.pages) * self.batch
        if capacity == 0:
            self.buf = None
        else:
            shape = (capacity * self.batch, self.row_bytes)
            new = (self.pool.tensor(shape, torch.uint8) if self.pool is not None
                   else torch.empty(shape, dtype=torch.uint8))
            if live:
                new[:live].copy_(self.buf[:live])
            self.buf = new
        self._view = None

    def put(self, pages: list[int], rows: torch.Tensor) -> None:
        """Pages ``pages`` join, their rows ``[len(pages) * batch, row_bytes]`` uint8 (any device;
        from a GPU the copy is asynchronous, ordered on the current stream)."""
        if not pages:
            return
        n, need = len(self.pages), len(self.pages) + len(pages)
        if need > self.capacity:
            self._resize(max(need, 2 * self.capacity))
        b = self.batch
        if rows.device.type == "cpu":
            self._wait()
        self.buf[n * b:need * b].copy_(rows.reshape(-1, self.row_bytes),
                                       non_blocking=self.pinned and rows.device.type == "cuda")
        for i, pg in enumerate(pages):
            self.slot[pg] = n + i
        self.pages.extend(pages)
        self.version += 1

    def remove(self, pages) -> None:
        """Pages ``pages`` leave; the last pages move into the freed slots (freed slots taken from
        the highest down, each filled by the page then last), in one indexed copy of the pages
        that move."""
        gone = sorted((self.slot.pop(pg) for pg in pages), reverse=True)
        if not gone:
            return
        src = list(range(len(self.pages)))  # slot -> the slot its page comes from
        for slot in gone:
            last = len(src) - 1
            if slot != last:
                src[slot] = src[last]
            src.pop()
        moves = [(dst, s) for dst, s in enumerate(src) if dst != s]
        if moves:
            dst_i = torch.tensor([d for d, _ in moves], dtype=torch.int64)
            src_i = torch.tensor([s for _, s in moves], dtype=torch.int64)
            if not self._move_on_device(dst_i, src_i):
                self._wait()
                per_page = self.buf.view(-1, self.batch * self.row_bytes)
                per_page.index_copy_(0, dst_i, per_page.index_select(0, src_i))
        self.pages = [self.pages[s] for s in src]
        for dst, _ in moves:
            self.slot[self.pages[dst]] = dst
        if not self.pinned and len(self.pages) * 4 <= self.capacity:
            self._resize(2 * len(self.pages))
        self.version += 1

    def reserve(self, pages: int) -> None:
        """Room for ``pages`` pages now (one allocation), so later puts up to that many do not
        resize the buffer."""
        if pages > self.capacity:
            self._resize(pages)

    def _move_on_device(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        """Copy pages ``src`` onto pages ``dst`` (slots, disjoint) of the page-locked buffer with
        the GPU, which reads and writes it at its host address (``_device_rows``' view): no host
        memcpy, ordered on the current stream (``_wait`` before the host touches the buffer).
        The buffer's first such move is read back and compared; where it differs, or no view can
        be made, -> False (the host moves them, now and from then on)."""
        if self.device.type not in self.MOVE_DEVICES or self._moves_failed:
            return False
        view = self._device_rows()
        if view is None:
            return False
        per_page = self.buf.view(-1, self.batch * self.row_bytes)
        check = None
        key = ("move", str(self.device), id(self.pool))
        if not self._moves_checked and key in HostRows.verified:
            self._moves_checked = True
        if not self._moves_checked:
            self._wait()
            check = per_page[int(src[0])].clone()
        n = self.batch * self._units  # the view's pieces per page
        ar = torch.arange(n, dtype=torch.int64)
        to = (dst[:, None] * n + ar).flatten().to(self.device, non_blocking=False)
        fro = (src[:, None] * n + ar).flatten().to(self.device, non_blocking=False)
        try:
            view.index_copy_(0, to, view.index_select(0, fro))
        except RuntimeError as exc:
            log.warning("demoted pages move on the host (%s)", exc)
            self._moves_failed = True
            return False
        self._pending = True
        if check is not None:
            self._wait()
            if not torch.equal(per_page[int(dst[0])], check):
                log.warning("the device's page moves in host memory did not land; demoted "
                            "pages move on the host")
                self._moves_failed = True
                return False
            self._moves_checked = True
            HostRows.verified.add(key)
        return True

    # --- reads --------------------------------------------------------------------------------
    def ids(self) -> torch.Tensor:
        """The pages in slot order, int64 on the device (cached until the next change)."""
        if self._ids is None or self._ids[0] != self.version:
            self._ids = (self.version, torch.tensor(self.pages, dtype=torch.int64,
                                                    device=self.device))
        return self._ids[1]

    def rows(self, pages: list[int]) -> torch.Tensor:
        """The rows of ``pages`` (host), ``[len(pages) * batch, row_bytes]`` in the order given
        (a copy)."""
        b = self.batch
        slots = torch.tensor([self.slot[pg] for pg in pages], dtype=torch.int64)
        self._wait()
        return self.buf.view(-1, b * self.row_bytes).index_select(0, slots).view(-1, self.row_bytes)

    def fetch(self, pages: list[int]) -> torch.Tensor:
        """The rows of ``pages`` (named on the host) on the device, in the order given: one
        gather (a GPU reads them from the buffer; the indices go over, not the rows twice)."""
        if self.device.type == "cpu":
            return self.rows(pages)
        b = self.batch
        slots = torch.tensor([self.slot[pg] for pg in pages], dtype=torch.int64)
        idx = (slots[:, None] * b + torch.arange(b)).flatten()
        return self.gather(idx.to(self.device, non_blocking=False))

    def all(self) -> torch.Tensor:
        """Every page's rows in slot order on the device, ``[len * batch, row_bytes]``: one copy
        (on the CPU: a view of the buffer, valid until the next change)."""
        live = self.buf[:len(self.pages) * self.batch]
        if self.device.type == "cpu":
            return live
        return live.to(self.device, non_blocking=self.pinned)

    def _device_rows(self) -> torch.Tensor | None:
        """The buffer as ``[capacity * batch * units, unit / w]`` of a ``w``-byte integer type
        (``unit``: the largest divisor of ``row_bytes`` up to 4 KiB), on the device (the CPU: the
        buffer itself); None where no view can be made. A row is gathered as its ``units``
        4 KiB-or-smaller pieces: many indices of small rows keep a GPU reading host memory busy
        on every lane (one index per 256 KiB page left most of them idle) -- kv/span.py's
        layout."""
        if self._view is not None:
            return self._view
        if self._view_failed:
            return None
        self._wait()
        unit = math.gcd(self.row_bytes, MAX_UNIT)
        self._units = self.row_bytes // unit
        wide = next(t for w, t in ((8, torch.int64), (4, torch.int32), (2, torch.int16),
                                   (1, torch.uint8)) if unit % w == 0)
        if self.device.type == "cpu":
            self._view = self.buf.view(-1, unit).view(wide)
            return self._view
        try:
            from ..span import raw_view

            view = raw_view(self.buf.data_ptr(), self.buf.numel(), self.device)
            view = view.view(-1, unit).view(wide)
            key = ("view", str(self.device), id(self.pool))
            if key not in HostRows.verified:
                if not torch.equal(view[:self._units].view(torch.uint8).reshape(1, -1).cpu(),
                                   self.buf[:1]):
                    raise RuntimeError("the device's view of the host rows differs from them")
                HostRows.verified.add(key)
        except (RuntimeError, TypeError, ValueError, AttributeError) as exc:
            log.warning("no device view of the demoted pages (%s); recalls copy through the "
                        "host", exc)
            self._view_failed = True
            return None
        self._view = view
        return view

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` ``[m]`` (int64 on the device: ``slot * batch + sequence``) -> their bytes
        ``[m, row_bytes]`` uint8 on the device, in that order: one ``index_select`` (of each
        row's ``units`` pieces)."""
        view = self._device_rows()
        if view is not None:
            units = self._units
            if self._unit_ar is None or self._unit_ar.device != rows.device:
                self._unit_ar = torch.arange(units, dtype=torch.int64, device=rows.device)
            idx = (rows[:, None] * units + self._unit_ar).flatten()
            return view.index_select(0, idx).view(torch.uint8).view(-1, self.row_bytes)
        self._wait()
        got = self.buf.index_select(0, rows.cpu())  # the fallback: one host sync, one copy
        return got.to(self.device)
