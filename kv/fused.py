"""A top-K layer's decode step in five Triton kernels (kv/layer.py ``_attend_fused``).

The captured graph of kv/graphs.py runs a top-K layer's choice, page-cache bookkeeping, gather
and the assembly of the attention's keys and values as ~90 small torch operations, then torch's
attention over the assembled buffer: at 32K on an 8B shape ~4,300 kernels a step, most of them a
few us of launch and tail (docs/benchmarks.md, kv). Here the same step is five kernels
(kv/fused_kernels.py): score the pages, choose them and keep the page cache's tables, fetch the
misses from the host into their slots (the only bytes that cross PCIe), flash decoding over the
sinks, the chosen pages in their slots and the recent window, and the splits combined.
``FusedStep`` holds their buffers for fixed shapes, launches them and captures them as CUDA
graphs (over its buffers, and over the step's own tensors where they come at fixed addresses).

Nothing is assembled: the attention reads the pages where the page cache keeps them. The chosen
pages and the tables are the same as the torch path's (the same ranks, ties broken the same way);
the scores and the attention are the same arithmetic in another order (ulp-level, checked by
tests/kv/test_kv_fused.py through ``TRITON_INTERPRET=1`` on the CPU and on CUDA by
tests/kv/test_kv_gpu.py). On by default (``TieredCache.fused``; ``DEEPSEEK_FLASH_KV_FUSED=0`` turns
it off): measured faster than the torch path on an H200 (docs/benchmarks.md, kv). The torch path
stays the fallback (no Triton, the CPU, a spilled chunk, no page cache, another score). With
``SPLIT`` (``DEEPSEEK_FLASH_KV_FUSED_SPLIT=1``) the choice runs as three kernels instead of one
program -- the same values.
"""
from __future__ import annotations

import logging
import os

import torch

from .fused_kernels import triton
from .fused_kernels import NEVER as _NEVER

if triton is not None:
    from .fused_kernels import _attend, _book, _choose, _combine, _fetch, _rank, _score, _select

log = logging.getLogger("deepseek_flash.kv.cache")

SPLIT = [os.environ.get("DEEPSEEK_FLASH_KV_FUSED_SPLIT", "0") == "1"]
"""Whether the choice runs as three kernels (``_rank`` over many programs, ``_select``,
``_book``) instead of one program (``_choose``): the same values; a list, so the bench flips it."""


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def available(device: torch.device) -> bool:
    """Whether the fused step can run on ``device``: Triton present, and CUDA (or the Triton
    interpreter on the CPU, as the tests run it)."""
    if triton is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpreted())


def default_on() -> bool:
    """``TieredCache.fused``'s default: on (measured faster on an H200: docs/benchmarks.md, kv)
    unless ``DEEPSEEK_FLASH_KV_FUSED=0``."""
    return os.environ.get("DEEPSEEK_FLASH_KV_FUSED", "1") != "0"


def _p2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def pages_room(n: int) -> int:
    """The pages a fused step's buffers and grids are sized for, given ``n`` pages now."""
    return max(16, _p2(n))


def _addresses(q, k_new, v_new) -> tuple:
    return q.data_ptr(), k_new.data_ptr(), v_new.data_ptr()


def reads_in_place(q, k_new, v_new) -> bool:
    """Whether the kernels can read the step's query ``[b, hq, 1, d]``, keys and values
    ``[b, h, 1, d]`` where they lie: each dense in (b, head, channel) order, as a decode step's
    projections leave them."""
    return q.is_contiguous() and k_new.is_contiguous() and v_new.is_contiguous()


class _Direct:
    """What an emulated graph over the step's own tensors reruns (tests/kv): the step with the
    tensors of the step replaying it."""

    def __init__(self, step):
        self.step = step

    def _run(self):
        return self.step.run(*self.step.live)


def applies(layer, cache, k: int) -> str | None:
    """Why the fused step cannot serve this layer's decode step (None: it can)."""
    layout = cache.layout
    p, d = layout.page_tokens, layout.head_dim
    w = cache.window_pages
    if cache.score != "hybrid":
        return "score"
    if w < 16 or w > 256 or w & (w - 1):
        return "window_pages"
    if d < 16 or d & (d - 1) or p < 16:
        return "head_dim"
    if layer.sinks > p or layer.sinks < 1:
        return "sinks"
    if (layout.page_bytes % 8) or layout.elem_bytes < 2:
        return "layout"
    return None


class FusedStep:
    """The buffers and kernels of one top-K layer's fused decode step for fixed shapes and
    buffers (``key``), captured as a CUDA graph where it runs on CUDA."""

    def __init__(self, key, layer, span, page_cache, window, sinks_kv, query, k: int,
                 scaling: float):
        cache = layer._cache
        self.key = key
        self.settings = cache._fused_settings()
        self.shape, self.dtype = query.shape, query.dtype
        self.layer_index = layer.index
        self.summaries = layer.summaries
        self.span, self.pc, self.window, self.sinks_kv = span, page_cache, window, sinks_kv
        b, hq, _, d = query.shape
        h = cache.kv_heads
        self.b, self.h, self.g, self.d = b, h, hq // h, d
        self.n, self.k = layer.summaries.n, k
        self.scale, self.scaling = float(cache.scale), float(scaling)
        self.w = cache.window_pages
        self.p = cache.page_tokens
        dev = query.device
        self.np_ = pages_room(self.n)
        # the page count the kernels read (``set_pages``): one graph serves while pages are
        # added up to ``np_`` (the buffers' room), the same ``k`` and the same host view
        self.n_dev = torch.full((1,), self.n, dtype=torch.int64, device=dev)
        self.nb = self.np_
        self.cp = max(16, _p2(page_cache.capacity))
        self.gp = max(16, _p2(self.g))
        f32 = torch.float32
        self.q_in = torch.empty((b, hq, 1, d), dtype=query.dtype, device=dev)
        self.kv_in = torch.empty((2, b, h, 1, d), dtype=query.dtype, device=dev)
        self.k_in, self.v_in = self.kv_in[0], self.kv_in[1]
        self.bound = torch.empty((b * h * self.g, self.nb), dtype=f32, device=dev)
        self.wpart = torch.empty((b * h, self.nb), dtype=f32, device=dev)
        self.iscratch = torch.empty(3 * self.np_ + 2 * self.cp, dtype=torch.int64, device=dev)
        self.chosen = torch.zeros((b, k), dtype=torch.int64, device=dev)
        self.slot_out = torch.zeros((b, k), dtype=torch.int64, device=dev)
        self.src_out = torch.zeros((b, k), dtype=torch.int64, device=dev)
        cap = window.capacity
        self.nblk = 1 + k + -(-cap // self.p)
        sms = (torch.cuda.get_device_properties(dev).multi_processor_count
               if dev.type == "cuda" else 4)
        nsplit = max(1, min(self.nblk, (2 * sms) // (b * h)))
        self.bps = -(-self.nblk // nsplit)
        self.nsplit = -(-self.nblk // self.bps)
        self.acc = torch.empty((b * h * self.nsplit * self.gp, d), dtype=f32, device=dev)
        self.ml = torch.empty((b * h * self.nsplit * self.gp, 2), dtype=f32, device=dev)
        self.out = torch.empty((b, 1, hq, d), dtype=query.dtype, device=dev)
        page_words = cache.layout.page_bytes // 8
        unit = span.rows.shape[1] * span.rows.element_size()
        if unit % 8:
            raise RuntimeError("host rows not 8-byte units")
        self.host_words = span.rows.view(torch.int64) if span.rows.dtype != torch.int64 else span.rows
        self.slots_words = page_cache.slots.view(torch.int64)
        self.unit_w, self.page_w = unit // 8, page_words
        self.cw = min(1024, _p2(page_words))
        self.rb = min(_p2(h * self.g), max(1, 8192 // self.np_))
        self.split = SPLIT[0]
        self.bi_split = max(1, min(self.np_, 16))
        self.keys = torch.empty((b, self.np_), dtype=torch.int64, device=dev)
        self.sel = torch.empty((b, self.np_), dtype=torch.int64, device=dev)
        self.graph = None
        # the graph over the step's own tensors (``go``): where it reads them, the addresses the
        # last step's came at, the running step's tensors while it replays (what an emulated
        # graph reruns), whether its capture failed
        self.direct = self.direct_at = self.seen_at = self.live = None
        self.direct_failed = False

    def set_pages(self, n: int) -> None:
        """The layer's page count now (``n <= np_``): one device fill where it changed."""
        if n != self.n:
            self.n_dev.fill_(n)
            self.n = n

    def load(self, query, k_new, v_new) -> None:
        torch._foreach_copy_([self.q_in, self.k_in, self.v_in], [query, k_new, v_new])

    def run(self, q=None, k_new=None, v_new=None) -> torch.Tensor:
        """The kernels, in order, on the current stream (five; seven with ``SPLIT``), reading the
        step's query, keys and values from ``q``, ``k_new``, ``v_new`` (contiguous; see
        ``reads_in_place``) or, None, from the fixed buffers ``load`` fills; -> the chosen pages
        ``[b, k]`` (the output ``[b, 1, hq, d]`` is in ``out``)."""
        if q is None:
            q, k_new, v_new = self.q_in, self.k_in, self.v_in
        b, h, g, d = self.b, self.h, self.g, self.d
        pc, win = self.pc, self.window
        mm = self.summaries.minmax
        _score[(b * h, -(-self.np_ // self.w))](
            q, mm, self.bound, self.wpart, self.n_dev, self.scale, mm.stride(0),
            mm.stride(1), self.nb, H=h, G=g, GP=self.gp, D=d, W=self.w)
        if self.split:
            bi = self.bi_split
            _rank[(b, self.np_ // bi)](
                self.bound, self.wpart, self.keys, self.n_dev, self.nb, H=h, HG=h * g, RB=self.rb,
                NP=self.np_, BI=bi, NEVER=_NEVER)
            _select[(b, self.np_ // bi)](self.keys, self.sel, self.n_dev, self.k, NP=self.np_,
                                         BI=bi)
            _book[(1,)](
                self.sel, self.iscratch, self.chosen, self.slot_out, self.src_out,
                pc.slot_of_page, pc.slot_of_page.shape[1], pc.page_of_slot, pc.last_used,
                pc.step, self.span.table, self.span.table.shape[1], pc.hits, pc.misses,
                pc.last_misses, win.kv, win.pos, k_new, v_new, self.k, b, pc.capacity,
                win.capacity, H=h, NP=self.np_, CP=self.cp, D=d, num_warps=8)
        else:
            self._choose_one(b, h, g, d, pc, win, k_new, v_new)
        _fetch[(b * self.k, -(-self.page_w // self.cw))](
            self.host_words, self.slots_words, self.src_out, self.slot_out, self.k, pc.capacity,
            self.unit_w, self.page_w, CW=self.cw)
        _attend[(b * h, self.nsplit)](
            q, self.sinks_kv, pc.slots, win.kv, win.pos, self.slot_out, self.acc,
            self.ml, self.scaling, self.sinks_kv.shape[3], self.k, pc.capacity, b,
            win.capacity, self.nblk, self.bps, H=h, G=g, GP=self.gp, D=d, P=self.p,
            NSPLIT=self.nsplit)
        _combine[(b * h,)](self.acc, self.ml, self.out, G=g, GP=self.gp, D=d,
                           NSPLIT=self.nsplit)
        return self.chosen

    def _choose_one(self, b, h, g, d, pc, win, k_new, v_new) -> None:
        _choose[(1,)](
            self.bound, self.wpart, self.iscratch, self.chosen, self.slot_out,
            self.src_out, pc.slot_of_page, pc.slot_of_page.shape[1], pc.page_of_slot,
            pc.last_used, pc.step, self.span.table, self.span.table.shape[1], pc.hits, pc.misses,
            pc.last_misses,
            win.kv, win.pos, k_new, v_new, self.n_dev, self.k, b, pc.capacity, self.nb,
            win.capacity,
            H=h, HG=h * g, RB=self.rb, NP=self.np_, CP=self.cp, D=d, num_warps=8)

    _run = run  # the name kv/graphs.py's test emulation replays

    def capture(self, pool) -> None:
        """This step eagerly (the kernels compiled, the step's work done), then the same kernels
        captured as a CUDA graph and replayed once (its page-cache counts put back: the eager run
        counted the step), as kv/graphs.py's ``SelectGraph``."""
        from . import graphs

        dev = self.q_in.device
        win, pc = self.window, self.pc
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            pos_before = win.pos.clone()
            self.run()
            win.pos.copy_(pos_before)
            counted = pc.snapshot()
            graph = graphs.new_graph(self)
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                self.run()
            finally:
                graph.capture_end()
            win.pos.copy_(pos_before)
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = graph
        graph.replay()
        pc.restore(counted)

    def _capture_direct(self, pool, q, k_new, v_new) -> None:
        """After a step done: the same kernels captured reading ``q``, ``k_new``, ``v_new`` where
        they lie (``direct``), for the next steps whose tensors come at those addresses. Nothing
        runs (the kernels were compiled for such pointers by the buffers' step: 16-byte aligned
        both); an emulated capture that runs them has its effects on the window's position, the
        counts and the output undone (the pages it chose again were the step's: no page moves)."""
        from . import graphs

        dev = q.device
        win, pc = self.window, self.pc
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            pos_before, counted, out = win.pos.clone(), pc.snapshot(), self.out.clone()
            graph = graphs.new_graph(_Direct(self))
            self.live = (q, k_new, v_new)
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                self.run(q, k_new, v_new)
            finally:
                graph.capture_end()
                self.live = None
            win.pos.copy_(pos_before)
            pc.restore(counted)
            self.out.copy_(out)
        torch.cuda.current_stream(dev).wait_stream(side)
        self.direct, self.direct_at = graph, _addresses(q, k_new, v_new)

    def go(self, query, k_new, v_new, pool) -> None:
        """One decode step through this step's kernels, ``out`` its output. Captured: the
        graph reading the step's tensors where they lie when they are where it was captured for
        (``direct``: no copy), else their copy into the buffers and the buffers' graph; the
        direct graph is captured after a step whose tensors came at the same addresses as the
        step's before (the caching allocator hands a steady decode step the same blocks every
        step). Not captured (the CPU's interpreter): the kernels read the tensors in place.
        ``pool``: a function giving the graphs' memory pool."""
        live = (query, k_new, v_new)
        if self.graph is None:
            if reads_in_place(*live):
                self.run(*live)
            else:
                self.load(*live)
                self.run()
            return
        at = _addresses(*live)
        if at == self.direct_at and reads_in_place(*live):
            self.live = live
            try:
                self.direct.replay()
            finally:
                self.live = None
            return
        self.load(*live)
        self.graph.replay()
        if (self.direct is None and at == self.seen_at and not self.direct_failed
                and all(a % 16 == 0 for a in at) and reads_in_place(*live)):
            try:
                self._capture_direct(pool(), *live)
            except Exception as exc:  # the buffers' graph serves on
                self.direct_failed = True
                self.direct = self.direct_at = None
                log.warning("layer %d: the fused step's graph over the step's own tensors was "
                            "not captured (%s); its buffers' graph serves", self.layer_index, exc)
        self.seen_at = at
