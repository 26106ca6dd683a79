"""A top-K layer's choice and gather as one captured CUDA graph (CUDA only).

An eager decode step of a large model is bound by the host: every dispatched operation costs
host time whatever its size. A top-K layer's page choice (the Quest bound, two rankings, the
top-``k`` key) and its one-gather fetch (kv/span.py) are ~30 such operations per layer and step,
always with the same shapes between two page boundaries. ``SelectGraph`` captures them once per
(layer, pages, k, view of the host chunks, summaries buffer) and replays them: a step then costs
one copy of the query and one replay per layer.

The gathered pages land in one buffer shared by all the layers of a cache (``SharedOut``): layer
``i + 1`` replays after layer ``i``'s attention has read it, in the order of the one compute
stream, so the device holds one layer's gathered pages at a time, as in the eager path. Capture
happens on a side stream, in thread-local mode (other threads' CUDA work is not disturbed), after
one eager run there; anything refused falls back to the eager path for good (logged once).
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("deepseek_flash.kv.cache")


def applies(device: torch.device) -> bool:
    """Whether top-K choices on ``device`` are captured (CUDA only)."""
    return device.type == "cuda"


def new_graph(owner: "SelectGraph"):
    """The graph object ``owner`` captures into (tests/kv/test_kv_graphs.py swaps in an
    emulation that reruns ``owner``'s steps on the CPU)."""
    return torch.cuda.CUDAGraph()


class SharedOut:
    """The gathered keys and values of the current top-K layer: one buffer per row shape (layers
    whose host chunks align differently gather in rows of another size), kept while ``k`` and
    the batch stay, so that the captured graphs keep their addresses."""

    def __init__(self):
        self.buffers: dict[tuple, torch.Tensor] = {}

    def get(self, span, b: int, k: int, device) -> torch.Tensor:
        key = (b, k, span.rows.shape[1], span.rows.dtype)
        rows = self.buffers.get(key)
        if rows is None:
            # another k or batch: the buffers of the old one are not replayed into again
            self.buffers = {kk: t for kk, t in self.buffers.items()
                            if kk[:2] == (b, k) or kk[0] == "attention"}
            n = 2 * b * span.kv_heads * k * span.units_per_head
            rows = torch.empty((n, span.rows.shape[1]), dtype=span.rows.dtype, device=device)
            self.buffers[key] = rows
        return rows

    def attention(self, like: torch.Tensor, tokens: int) -> torch.Tensor:
        """Keys and values ``[2, b, kv_heads, tokens, head_dim]`` of the current top-K layer's
        attention (``AttentionInput``), one buffer per shape, kept while ``k`` and the batch
        stay (the graphs write into it at fixed addresses)."""
        b, h, _, d = like.shape
        key = ("attention", b, h, tokens, d, like.dtype)
        kv = self.buffers.get(key)
        if kv is None:
            # another k or batch: the buffer of the old one is not replayed into again
            self.buffers = {kk: t for kk, t in self.buffers.items() if kk[0] != "attention"}
            kv = like.new_empty((2, b, h, tokens, d))
            self.buffers[key] = kv
        return kv


class AttentionInput:
    """What a top-K layer's graph also does (kv/window.py): writes the step's keys and values
    into the layer's recent window and assembles the keys and values its attention reads in one
    buffer pair -- sinks, the gathered pages, then the whole window -- so the attention reads a
    prefix of them and no step concatenates anything: the same columns in the same order as the
    concatenation they replace. The step's query, keys and values reach the graph through the
    window's fixed input buffers, all three in one ``_foreach_copy_``."""

    def __init__(self, kv, sinks_kv, window, query, k_new, v_new):
        self.kv = kv  # [2, b, h, tokens, d]
        self.keys, self.values = kv[0], kv[1]
        self.sinks_kv, self.window = sinks_kv, window  # sinks: [2, b, h, s, d]
        self.sinks = sinks_kv.shape[3]
        self.new = (query, k_new, v_new)
        self.q_in, self.k_in, self.v_in, self.steps, self.kv_in = window.inputs(query, k_new)

    def key(self) -> tuple:
        w = self.window
        return (self.kv.data_ptr(), self.sinks_kv.data_ptr(), self.sinks, w.kv.data_ptr(),
                w.pos.data_ptr(), self.q_in.data_ptr(), self.kv_in.data_ptr(),
                self.kv.shape[3], w.capacity)

    def load(self) -> None:
        """Eagerly, before the replay: the window's device position, the step's inputs."""
        self.window.sync_pos()
        torch._foreach_copy_([self.q_in, self.k_in, self.v_in], list(self.new))

    def replayed(self) -> None:
        w = self.window
        w.ahead = self.steps.shape[0]
        w.pos_value = w.length + w.ahead

    def fill(self, pages: torch.Tensor) -> None:
        """Sinks, the pages ``[2, b, h, k * page_tokens, d]`` and the recent window into the
        buffer (three device copies, keys and values together)."""
        w = self.window
        s, n, cap = self.sinks, pages.shape[3], w.capacity
        if s:
            _copy_words(self.kv[:, :, :, :s], self.sinks_kv)
        _copy_words(self.kv[:, :, :, s:s + n], pages)
        _copy_words(self.kv[:, :, :, s + n:s + n + cap], w.kv)


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``[..., tokens, d]`` (each head's tokens contiguous) as ``[..., words]`` of 8-byte
    elements where its bytes allow: a copy then moves 4 bf16 values per element instead of one,
    over fewer dimensions (the same bytes)."""
    flat = t.flatten(-2)
    if flat.shape[-1] * t.element_size() % 8 == 0 and t.element_size() < 8:
        try:
            return flat.view(torch.int64)
        except RuntimeError:  # an offset or stride not a whole word
            pass
    return flat


def _copy_words(dst: torch.Tensor, src: torch.Tensor) -> None:
    a, b = _words(dst), _words(src)
    if a.dtype != b.dtype:
        a, b = dst.flatten(-2), src.flatten(-2)
    a.copy_(b)


class SelectGraph:
    """The captured choice + gather of one layer for fixed shapes and buffers (``key``)."""

    def __init__(self, key, summaries, span, query, k, scale, window_pages, out_rows, pool,
                 page_cache=None, attention: AttentionInput | None = None):
        self.key = key
        self.attention = attention
        self.summaries, self.span = summaries, span
        self.page_cache = page_cache  # kv/pagecache.py: hits from the device slots
        self.k, self.scale, self.window_pages = k, scale, window_pages
        self.out_rows = out_rows
        if attention is not None:
            self.query = attention.q_in  # loaded already (AttentionInput.load)
            pos = attention.window.pos
        else:
            self.query = torch.empty_like(query)
            self.query.copy_(query)
        side = torch.cuda.Stream(query.device)
        side.wait_stream(torch.cuda.current_stream(query.device))
        with torch.cuda.stream(side):
            if attention is not None:
                # the window's write position as before the runs here: the replay that follows
                # writes this step's tokens (a capture runs nothing; an emulated one does)
                self.pos_before = pos.clone()
            self._run()  # once eagerly: lazy initialisations (cuBLAS handles, ...) happen here
            if attention is not None:
                pos.copy_(self.pos_before)
            # with a page cache that eager run was this step's (its counts stand; the replay that
            # follows finds every page in the slots: counted again, then put back; the snapshot
            # is kept with the graph, never freed while the compute stream may still read it)
            self.counted = page_cache.snapshot() if page_cache is not None else None
            self.restore_after_replay = page_cache is not None
            self.graph = new_graph(self)
            self.graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                self.chosen = self._run()
            finally:
                self.graph.capture_end()
            if attention is not None:
                pos.copy_(self.pos_before)
        torch.cuda.current_stream(query.device).wait_stream(side)

    def _run(self) -> torch.Tensor:
        a = self.attention
        if a is not None:
            a.window.write_at_pos(a.kv_in, a.steps)
        chosen = self.summaries._choose_hybrid(self.query, self.k, self.scale, self.window_pages)
        if self.page_cache is not None:
            self.page_cache.gather_into(self.span, chosen, self.out_rows)
        else:
            self.span.gather_into(chosen, self.out_rows)
        if self.attention is not None:
            self.attention.fill(self.span.unpack_kv(self.out_rows, chosen.shape[0], self.k))
        return chosen

    def replay(self, query):
        """-> chosen ``[b, k]``, keys, values ``[b, kv_heads, k * page_tokens, head_dim]`` (with
        an ``AttentionInput``: chosen, None, None -- the pages are in its buffers; the query was
        loaded with the step's keys and values)."""
        if self.attention is None:
            self.query.copy_(query)
        self.graph.replay()
        if self.restore_after_replay:
            self.page_cache.restore(self.counted)
            self.restore_after_replay = False
        if self.attention is not None:
            return self.chosen, None, None
        return (self.chosen, *self.span.unpack(self.out_rows, self.chosen.shape[0], self.k))


class LayerGraphs:
    """A top-K layer's captured graph, recaptured when its key changes; ``None`` for good once a
    capture failed."""

    def __init__(self):
        self.graph: SelectGraph | None = None
        self.failed = False
        self.captures = 0

    def select(self, cache, layer, span, query, k, page_cache=None, attention=None):
        """Chosen pages and their keys and values through the graph, or None (use the eager
        path). With ``page_cache`` (kv/pagecache.py) ``span`` is its view of host pages and
        slots, and the graph keeps the chosen pages in the slots. With ``attention``
        (``AttentionInput``) the graph also assembles the attention's keys and values there."""
        if self.failed:
            return None
        summaries = layer.summaries
        b = query.shape[0]
        out = cache._select_out.get(span, b, k, query.device)
        key = (summaries.n, k, id(span), summaries.minmax.data_ptr(), out.data_ptr(),
               tuple(query.shape), query.dtype, cache.scale, cache.window_pages,
               page_cache.key() if page_cache is not None else None,
               attention.key() if attention is not None else None)
        if attention is not None:
            attention.load()
        if self.graph is None or self.graph.key != key:
            self.graph = None
            self.captures += 1
            try:
                self.graph = SelectGraph(key, summaries, span, query, k, cache.scale,
                                         cache.window_pages, out, cache._graph_pool(), page_cache,
                                         attention)
            except Exception as exc:  # refused by torch or the driver: eager from now on
                self.failed = True
                if attention is not None:
                    attention.window.pos_value = None
                log.warning("layer %d: top-K choice and gather not captured as a CUDA graph "
                            "(%s); they run eagerly", layer.index, exc)
                return None
        try:
            got = self.graph.replay(query)
        except RuntimeError as exc:
            self.failed, self.graph = True, None
            if attention is not None:
                attention.window.pos_value = None
            log.warning("layer %d: the captured top-K graph failed to replay (%s); the choice "
                        "and gather run eagerly", layer.index, exc)
            return None
        if attention is not None:
            attention.replayed()
        return got
