"""``TieredCache``: a transformers ``Cache`` whose layers (kv/layer.py) keep sink tokens and the
most recent tokens on the model's device, older tokens in BICL pages on the host (page-locked when
CUDA is present) and, past ``host_bytes``, in spill files (kv/pages.py, kv/spill.py); with
per-page key summaries on the device for query-aware top-K selection (kv/summaries.py).

This module holds what spans the layers: construction (``for_model``), the guard around every
step, the host tier's budget and spill policy, the copy-stream prefetch, and the stats.
"""
from __future__ import annotations

import logging
import weakref

import torch
from transformers.cache_utils import Cache

from deepseek_flash.errors import KVCacheMismatch, KVError, KVPageCorrupt, KVSpillFailed

from . import stats as _stats
from . import compat
from .compat import cache_keyword
from .compute import sdpa as _sdpa  # noqa: F401  (kept importable from here)
from .config import CONFIG_KEYS, DEFAULTS, explicit_args, flash_kv_settings, validate
from .fused import default_on as _fused_default
from .graphs import LayerGraphs, SharedOut
from .layer import TieredLayer
from .layout import PageLayout, auto_page_tokens
from .hostmem import ArenaMemory, OwnMemory
from .report import Reporter, client_of
from .pages import CHUNK_BYTES, FIRST_CHUNK_PAGES, Chunk
from .pagecache import AUTO, DEVICE_SHARE, PAGE_CACHE_DEFAULT, device_budget, slot_bytes
from .prune.state import PRUNE_GPU_TOKENS, offset_values, prune_settings
from .spill import SpillStore

log = logging.getLogger(__name__)

__all__ = ["TieredCache", "TieredLayer", "CONFIG_KEYS", "flash_kv_settings", "CHUNK_BYTES",
           "FIRST_CHUNK_PAGES", "Chunk"]


COPIES_AHEAD = 2
"""Layers whose every page is copied ahead on the copy stream, at most, at a time."""


class TieredCache(Cache):
    """The tiered KV cache of one generation. Build it with ``TieredCache.for_model``."""

    def __init__(self, num_layers: int, *, kv_heads: int, head_dim: int, gpu_tokens: int = 512,
                 sink_tokens: int = 4, page_tokens: int | str = "auto",
                 top_k_pages: int | float | None = None, host_bytes: int | None = None,
                 spill_dir=None, dense_layers: int = 2, score: str = "hybrid",
                 window_pages: int = 64, select_max_queries: int = 16,
                 prefill_chunk: int = 4096, error_recovery_mode: str = "strict",
                 chunk_pages: int | None = None, report_interval: float | None = 1.0,
                 host_arena: bool = True, prune_threshold: float | None = None,
                 prune_scorer="attention", prune_offsets=None, prune_tokenizer=None,
                 prune_compensation: bool = True, prune_every: int = 8, prune_window: int = 32,
                 prune_device_tokens: int | None = 512, dense_on_device: bool | None = None,
                 page_cache: float | str | None = PAGE_CACHE_DEFAULT):
        if report_interval is not None and (isinstance(report_interval, bool) or not isinstance(
                report_interval, (int, float)) or report_interval < 0):
            from deepseek_flash.errors import ConfigError
            raise ConfigError(f"report_interval: {report_interval!r} is not allowed; use null (no "
                              f"reports) or seconds >= 0", key="report_interval",
                              value=report_interval, allowed="null or seconds >= 0")
        validate(gpu_tokens=gpu_tokens, sink_tokens=sink_tokens, page_tokens=page_tokens,
                  top_k_pages=top_k_pages, host_bytes=host_bytes, spill_dir=spill_dir,
                  dense_layers=dense_layers, score=score, window_pages=window_pages,
                  error_recovery_mode=error_recovery_mode, prefill_chunk=prefill_chunk,
                  page_cache=page_cache)
        self.prune = prune_settings(prune_threshold, prune_scorer, prune_offsets, prune_tokenizer,
                                    prune_compensation, prune_every, prune_window,
                                    prune_device_tokens)
        self._matchers: list = []
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.gpu_tokens = gpu_tokens
        self.sink_tokens = sink_tokens
        self.page_tokens_setting = page_tokens
        self.page_tokens = page_tokens if isinstance(page_tokens, int) else None
        self.top_k_pages = top_k_pages
        self.host_bytes_limit = host_bytes
        self.dense_layers = dense_layers
        # the dense layers' pages on the device as well (kv/mirror.py): None = on a CUDA device
        self.dense_on_device = dense_on_device
        # top-K: each top-K layer keeps its chosen pages on the device (kv/pagecache.py): slots
        # for every page ("auto") or this multiple of its k; 0 / None: off. Pruning's recall has
        # its own levels.
        self.page_cache = (0.0 if prune_threshold is not None else
                           AUTO if page_cache == AUTO else float(page_cache or 0))
        self.score = score
        self.window_pages = window_pages
        self.select_max_queries = select_max_queries
        self.prefill_chunk = prefill_chunk
        self.error_recovery_mode = error_recovery_mode
        self.chunk_pages_setting = chunk_pages
        self.max_chunk_pages = None
        self.scale = head_dim ** -0.5
        self.layout: PageLayout | None = None
        self.pinned = False
        self.spill = SpillStore(spill_dir) if spill_dir is not None else None
        self.counters = _stats.new_counters()
        self._modules = weakref.WeakSet()
        self._model_name = ""
        self.cache_keyword: str | None = None  # the model's keyword for a cache (kv/compat.py)
        self.report_interval = report_interval
        self.host_arena = host_arena
        self._controller = None  # (client, model name) of a load_model model
        self.host_memory = None  # OwnMemory or ArenaMemory (kv/hostmem.py), once the layout is known
        self._reporter: Reporter | None = None  # stats to a load_model model's controller
        self._poisoned: str | None = None
        self._spill_error: KVSpillFailed | None = None
        self._copy_stream = None
        self._write_stream = None  # CUDA: device->host page writes (kv/pages.py, append)
        self._prefetched: dict[int, tuple] = {}
        self._every_page: list[bool] = []  # per layer, as of the step's start: reads every page
        self._copies_any = True  # True in _every_page (layer.py's _before_step skips the call)
        # CUDA: each top-K layer's choice and gather replayed as a captured graph (kv/graphs.py);
        # False: eager, as on the CPU
        self.select_graphs = True
        # a top-K decode step as kv/fused.py's five Triton kernels (CUDA; DEEPSEEK_FLASH_KV_FUSED)
        self.fused = _fused_default()
        self._select_out = SharedOut()
        self._graph_pool_handle = None
        self._page_cache_budget = False  # device bytes for page caches, once known (None: none)
        self._page_cache_refusal_logged = False
        super().__init__(layers=[TieredLayer(self, i) for i in range(num_layers)])

    # --- construction ------------------------------------------------------------------------
    @classmethod
    def for_model(cls, model, gpu_tokens: int = 512, sink_tokens: int = 4,
                  page_tokens: int | str = "auto", top_k_pages: int | float | None = None,
                  host_bytes: int | None = None, spill_dir=None,
                  prune_threshold: float | None = None, prune_scorer="attention",
                  prune_offsets=None, page_cache: float | str | None = PAGE_CACHE_DEFAULT,
                  **options) -> "TieredCache":
        """Install the tiered attention function on ``model`` and return a new cache for one
        generation: ``model.generate(ids, cache=cache)``. Options: ``dense_layers``
        (2), ``score`` ("hybrid" | "quest" | "windowed" | "mass" | "mass_max"), ``window_pages`` (64), ``error_recovery_mode``
        ("strict" | "graceful"), ``prefill_chunk`` (4096 queries), ``dense_on_device`` (None: on
        a CUDA device the dense layers keep their pages on the device as well, kv/mirror.py).
        ``page_cache`` (1.5): with ``top_k_pages``, each top-K layer keeps the pages it chose in
        the last steps on the device, in slots for this multiple (>= 1.0) of its top-K page count,
        or for every page of the layer ("auto": more GPU memory than a DynamicCache, where the
        GPU has room), within 25 % of the device memory free when the first slots are made (only
        the newly chosen pages are fetched; the least recently chosen leave first;
        kv/pagecache.py); 0 or None: off (every chosen page fetched every step).

        Importance pruning (off by default; docs/kv.md): ``prune_threshold`` (the seed's 0.15),
        ``prune_scorer`` ("attention" | "mlp" | a scorer file | a callable), ``prune_offsets``
        ([(pattern, offset), ...]); options ``prune_tokenizer`` (for text patterns),
        ``prune_compensation`` (True), ``prune_every`` (8 steps), ``prune_window`` (32 steps),
        ``prune_device_tokens`` (512: sinks + recent window + level-1 pages held on the device at
        most; the best-scored pages stay, the rest wait at level 2; None: unbounded).
        With pruning on and ``gpu_tokens`` at its default (512), the recent window is 64 tokens.

        A model from ``load_model`` brings its ``kv_*`` keys (``flash.json``, the model's
        ``flash_config``, the open's ``flash_context``): they replace the defaults of the
        arguments left at their default values; an argument given another value wins."""
        from .attention import install

        from .prune.scorers import resolve_scorer

        compat.require_transformers()
        given = dict(gpu_tokens=gpu_tokens, sink_tokens=sink_tokens, page_tokens=page_tokens,
                     top_k_pages=top_k_pages, host_bytes=host_bytes, spill_dir=spill_dir,
                     prune_threshold=prune_threshold, page_cache=page_cache)
        args = {**flash_kv_settings(model), **explicit_args(given)}
        for key, value in given.items():
            args.setdefault(key, value)
        if args["prune_threshold"] is not None and args["gpu_tokens"] == DEFAULTS["gpu_tokens"]:
            # pruning on: scores, not age, decide what stays on the device beyond a short window
            # (a load_model model's flash_config always carries kv_gpu_tokens, so the default
            # value is what is replaced, wherever it came from)
            args["gpu_tokens"] = PRUNE_GPU_TOKENS
        if args["prune_threshold"] is not None:
            try:
                prune_scorer = resolve_scorer(prune_scorer, model)
            except ValueError as exc:
                from deepseek_flash.errors import ConfigError
                raise ConfigError(str(exc), key="prune_scorer", value=str(prune_scorer),
                                  allowed="'attention', 'mlp', a scorer file or a callable") from None
        cfg = install(model)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        cache = cls(cfg.num_hidden_layers, kv_heads=kv_heads, head_dim=head_dim, **args,
                    prune_scorer=prune_scorer, prune_offsets=prune_offsets, **options)
        cache.bind(model)
        if cache.prune is not None and cache.prune.offsets:
            _watch_tokens(model, cache)
        return cache

    def bind(self, model) -> None:
        """Accept attention calls from ``model``'s attention layers only."""
        for module in model.modules():
            if hasattr(module, "layer_idx") and hasattr(module, "num_key_value_groups"):
                self._modules.add(module)
        self._model_name = type(model).__name__
        self.cache_keyword = cache_keyword(model)
        target = client_of(model)
        if self.layout is None:
            self._controller = target  # host chunks from its arena (set up with the layout)
        if target is not None and self.report_interval is not None and self._reporter is None:
            self._reporter = Reporter(self, *target, interval=self.report_interval)

    def _check_geometry(self, layer: int, kv_heads: int, head_dim: int, v_dim: int) -> None:
        if kv_heads != self.kv_heads or head_dim != self.head_dim or v_dim != self.head_dim:
            raise KVCacheMismatch(
                f"layer {layer}: keys of {kv_heads} heads x {head_dim} (values {v_dim}) given to a "
                f"TieredCache built for {self._model_name or 'a model'} with {self.kv_heads} heads "
                f"x {self.head_dim}")

    def _fix_layout(self, batch, kv_heads, head_dim, dtype, device, first_len) -> None:
        if self.layout is not None:
            if self.layout.dtype != dtype:
                raise KVCacheMismatch(f"keys of {dtype} given to a TieredCache holding "
                                      f"{self.layout.dtype}")
            return
        if self.page_tokens is None:
            self.page_tokens = auto_page_tokens(first_len)
        self.layout = PageLayout(kv_heads, head_dim, self.page_tokens, dtype)
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        if self._controller is not None and self.host_arena:
            self.host_memory = ArenaMemory(*self._controller, self.pinned, self.counters)
            weakref.finalize(self, self.host_memory.close).atexit = False
        else:
            self.host_memory = OwnMemory(self.pinned)
        if self.chunk_pages_setting is not None:
            self.max_chunk_pages = self.chunk_pages_setting
        else:
            per_chunk = CHUNK_BYTES
            if self.host_bytes_limit is not None:
                # spill granularity: at most an eighth of one layer's share of the host budget
                per_chunk = min(per_chunk, self.host_bytes_limit // (8 * self.num_layers))
            self.max_chunk_pages = max(1, per_chunk // (self.layout.page_bytes * batch))

    # --- the guard around every step ----------------------------------------------------------
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self._poisoned:
            raise KVError(f"this TieredCache is unusable: {self._poisoned}; make a new one")
        if layer_idx >= len(self.layers):
            raise KVCacheMismatch(f"layer {layer_idx} given to a TieredCache of "
                                  f"{len(self.layers)} layers ({self._model_name})")
        if layer_idx > 0 and self.layers[layer_idx - 1].pending is not None:
            self._poison("attention did not go through the tiered attention function")
            raise KVCacheMismatch(
                f"layer {layer_idx - 1}'s keys were not consumed by the tiered attention: this "
                f"TieredCache was given to a model that TieredCache.for_model did not set up "
                f"(it was built for {self._model_name})")
        if layer_idx == 0:
            self._start_step()
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def _start_step(self) -> None:
        """Before a step mutates anything: report a spill failure of the last step (strict), and
        make sure every layer holds the same tokens."""
        lengths = {layer.length for layer in self.layers}
        if len(lengths) > 1:
            self._poison(f"layers hold different lengths {sorted(lengths)}")
            raise KVError(f"this TieredCache holds a partial step (layer lengths "
                          f"{sorted(lengths)}): a forward pass was interrupted")
        if self._spill_error is not None:
            err, self._spill_error = self._spill_error, None
            if self.error_recovery_mode == "strict":
                raise err
        if self.host_bytes_limit is not None and self.host_bytes() > self.host_bytes_limit:
            self._spill_oldest()  # retry what an earlier failure left on the host
        if self._reporter is not None:
            self._reporter.tick(self)
        if self.pinned:
            self._every_page = [layer.copies_every_page() for layer in self.layers]
            self._copies_any = True in self._every_page

    def _poison(self, why: str) -> None:
        self._poisoned = why

    def check_module(self, module) -> None:
        if module not in self._modules:
            raise KVCacheMismatch(
                f"a TieredCache built for {self._model_name} was given to "
                f"{type(module).__name__} of another model; build one per model with "
                f"TieredCache.for_model")

    # --- host tier accounting and spill -----------------------------------------------------
    def next_chunk_pages(self, previous: int) -> int:
        """Capacity of a layer's next host chunk: fixed when ``chunk_pages`` was given, else
        4 pages, then doubling up to ``CHUNK_BYTES``."""
        if self.chunk_pages_setting is not None:
            return self.chunk_pages_setting
        return min(self.max_chunk_pages, max(FIRST_CHUNK_PAGES, 2 * previous))

    def next_to_prefetch(self, layer: TieredLayer, every_page: list[bool]):
        """The layer whose pages a decode step's ``layer`` starts copying ahead, or None: the
        first layer after it, cyclically (past the last layer: the next step's, whose pages are
        final once it has committed this step), that reads every page (``every_page``) and is
        not copied ahead yet. A lossless step copies one layer ahead; a top-K step copies its
        dense layers for the next step while its top-K layers compute, not when they are due.
        At most ``COPIES_AHEAD`` layers' copies are held at a time (layers that copy nothing of
        their own, mirrored dense layers, would otherwise run the copies further and further
        ahead)."""
        if len(self._prefetched) >= COPIES_AHEAD or True not in every_page:
            return None  # (a top-K step with its dense layers mirrored copies nothing ahead)
        n = len(self.layers)
        for ahead in range(1, n):
            i = (layer.index + ahead) % n
            if every_page[i] and i not in self._prefetched:
                nxt = self.layers[i]
                if nxt.n_pages == 0 or not nxt.pages.all_on_host():
                    return None
                return nxt
        return None

    def mirrors_dense(self) -> bool:
        """Whether the dense layers keep their pages on the device as well (kv/mirror.py)."""
        if self.dense_on_device is None:
            return self.pinned
        return bool(self.dense_on_device)

    def write_stream(self):
        """CUDA: the stream the device->host page writes run on (host->device copies ahead run
        on ``_copy_stream``: the two directions overlap)."""
        if self._write_stream is None:
            self._write_stream = torch.cuda.Stream(self.device)
        return self._write_stream

    def _drop_prefetched(self, layer: TieredLayer) -> None:
        """A layer copied ahead that attends top-K after all (its page count grew past ``k``)."""
        entry = self._prefetched.pop(layer.index, None)
        if entry is not None:
            self.counters["pages_fetched"] -= entry[0] * layer.batch

    def _prefetch_next(self, layer: TieredLayer) -> None:
        """CUDA: start copying every page of ``next_to_prefetch``'s layer on a copy stream, so
        the copies overlap the compute of the layers before it."""
        if not self.pinned:
            return
        if len(self._every_page) != len(self.layers):
            self._every_page = [lyr.copies_every_page() for lyr in self.layers]
            self._copies_any = True in self._every_page
        nxt = self.next_to_prefetch(layer, self._every_page)
        if nxt is None:
            return
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        if nxt.pages.written is not None:
            # the pages' device->host copies came first; nothing else orders the copy stream
            # after the compute stream, so the copies of successive layers queue back to back
            self._copy_stream.wait_event(nxt.pages.written)
        with torch.cuda.stream(self._copy_stream):
            k, v = nxt.pages.fetch_all()
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        self._prefetched[nxt.index] = (nxt.n_pages, done, k, v)

    def _take_prefetched(self, layer: TieredLayer):
        entry = self._prefetched.pop(layer.index, None)
        if entry is None:
            return None
        n_pages, done, k, v = entry
        if n_pages != layer.n_pages or layer.lost_pages:
            self.counters["pages_fetched"] -= n_pages * layer.batch  # not used after all
            return None
        current = torch.cuda.current_stream(self.device)
        current.wait_event(done)
        k.record_stream(current)
        v.record_stream(current)
        return k, v

    def _page_cache_slot_limit(self, layer: TieredLayer) -> int | None:
        """The most page-cache slots one top-K layer may hold: its share of the cache's device
        budget (kv/pagecache.py, ``device_budget``, taken when the first slots are made), or
        None (no budget: off CUDA)."""
        if self._page_cache_budget is False:
            self._page_cache_budget = device_budget(layer.device)
        if self._page_cache_budget is None:
            return None
        layers = max(1, self.num_layers - self.dense_layers)
        return self._page_cache_budget // layers // slot_bytes(layer)

    def _page_cache_refused(self, layer: TieredLayer, k: int, limit: int) -> None:
        if not self._page_cache_refusal_logged:
            self._page_cache_refusal_logged = True
            log.info("layer %d: a page cache for a top-K of %d pages does not fit the device "
                     "budget (%d slots per layer: %.0f %% of the device memory free when the "
                     "first slots were made); the chosen pages are fetched every step",
                     layer.index, k, limit, 100 * DEVICE_SHARE)

    def _release_page_cache(self, layer: TieredLayer) -> None:
        """Free ``layer``'s page cache (top-K turned off); its counts join the cache's."""
        hits, misses, _ = layer.page_cache.counts()
        self.counters["page_cache_hits"] += hits
        self.counters["page_cache_misses"] += misses
        self.counters["pages_fetched"] += misses
        layer.page_cache = None
        layer.graphs = LayerGraphs()  # its graphs wrote into the slots
        layer._fused, layer._fused_holds = None, False  # and so did its fused step

    def _staging(self, n_pages: int) -> torch.Tensor:
        """A new host buffer of ``n_pages`` pages. Fresh every time: torch's pinned-memory cache
        reuses a block only after the copies that read it have completed."""
        return torch.empty((n_pages, *self.layout.shape), dtype=self.layout.dtype,
                           pin_memory=self.pinned)

    def host_bytes(self) -> int:
        return sum(layer.host_bytes() for layer in self.layers)

    def _pages_written(self, layer: TieredLayer) -> None:
        if self.host_bytes_limit is None or self.host_bytes() <= self.host_bytes_limit:
            return
        self._spill_oldest()

    def _prune_spill(self) -> None:
        """Pruning: past ``host_bytes``, write level-3 pages to disk, oldest first (lowest page,
        then layer), one file per layer and call, until the host levels fit. Level 2 stays on the
        host (it is what a score may bring back soon). A failure keeps the pages on the host and
        is reported at the start of the next step, as a chunk's would be."""
        if self.spill is None or self.host_bytes_limit is None:
            return
        excess = self.host_bytes() - self.host_bytes_limit
        if excess <= 0:
            return
        candidates = sorted((pg, layer.index) for layer in self.layers
                            if layer.prune.l3 is not None for pg in layer.prune.l3.pages)
        chosen: dict[int, list[int]] = {}
        for pg, index in candidates:
            if excess <= 0:
                break
            chosen.setdefault(index, []).append(pg)
            excess -= self.layers[index].prune.l3.page_bytes()
        for index, pages in sorted(chosen.items()):
            try:
                self.layers[index].prune.spill(pages)
            except KVSpillFailed as exc:
                self._spill_failed(exc)
                return

    def _spill_failed(self, exc: KVSpillFailed) -> None:
        """A spill write failed: count it, keep the pages on the host, and report the first such
        error at the start of the next step."""
        self.counters["spill_errors"] += 1
        log.warning("%s; the pages stay on the host tier", exc)
        if self._spill_error is None:
            self._spill_error = exc

    def page_lost(self, exc: KVPageCorrupt, lost: set, page: int) -> None:
        """A spilled page failed its check: raise in strict mode; in graceful mode count it and
        add it to ``lost`` (the caller's set of pages left out of attention from now on)."""
        if self.error_recovery_mode == "strict":
            raise exc
        log.warning("%s; graceful mode: the page is left out of attention from now on", exc)
        lost.add(page)
        self.counters["pages_lost"] += 1

    def _spill_oldest(self) -> None:
        """Write the oldest full host chunks (across layers) to disk until the host tier fits.
        A failure keeps the chunk on the host and is reported at the start of the next step."""
        if self.prune is not None:
            self._prune_spill()
            return
        if self.spill is None:
            return
        if self.pinned:
            self._writes_done()  # the chunks are read on the host below
        while self.host_bytes() > self.host_bytes_limit:
            candidates = [(c.first, layer.index, layer, c) for layer in self.layers
                          for c in layer.pages.spillable()]
            if not candidates:
                return
            _, _, layer, chunk = min(candidates, key=lambda x: (x[0], x[1]))
            try:
                spilled = self.spill.write_chunk(f"L{layer.index:03d}-P{chunk.first:08d}",
                                                 chunk.tensor)
            except KVSpillFailed as exc:
                self._spill_failed(exc)
                return
            self.host_memory.free(chunk.tensor)
            chunk.spilled, chunk.tensor = spilled, None
            layer.pages.invalidate_span()
            self.counters["chunks_spilled"] += 1

    # --- Cache API ---------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].length if layer_idx < len(self.layers) else 0

    def _observe_ids(self, ids: torch.Tensor) -> None:
        """The model's input ids of a step (for the pruning offsets' patterns)."""
        from .prune.offsets import OffsetMatcher

        if not self._matchers:
            self._matchers = [OffsetMatcher(self.prune.offsets, self.prune.tokenizer)
                              for _ in range(ids.shape[0])]
        for row, m in enumerate(self._matchers):
            m.append(ids[row].tolist())

    def prune_offsets_for(self, layer) -> torch.Tensor | None:
        """Offsets ``[b, paged tokens]`` of ``layer``'s paged tokens, or None."""
        if not self._matchers:
            return None
        s = layer.sinks
        return offset_values(self._matchers, s, s + layer.paged_tokens, layer.device)

    def stats(self) -> dict:
        """Bytes per tier, ``full_bytes`` and the counters (docs/kv.md, kv/stats.py)."""
        return _stats.collect(self)

    def report(self) -> bool:
        """Send the stats to the controller of the model's ``load_model`` now (they also go at
        the start of a step every ``report_interval`` seconds and at close); False when the
        model has no controller or reporting is off (``report_interval=None``)."""
        if self._reporter is None:
            return False
        self._reporter.send(self)
        return True

    def _fused_settings(self) -> tuple:
        """What a fused top-K step (kv/fused.py) was built for, of the cache's settings."""
        return (self.top_k_pages, self.page_cache, self.score, self.window_pages,
                self.select_graphs, self.fused)

    def _graph_pool(self):
        """One memory pool for the captured graphs of all layers (replayed one after the other
        on one stream, their temporaries may share memory)."""
        if self._graph_pool_handle is None:
            self._graph_pool_handle = torch.cuda.graph_pool_handle()
        return self._graph_pool_handle

    def _writes_done(self) -> None:
        """Wait for every device->host page write issued so far (CUDA)."""
        torch.cuda.current_stream(self.device).synchronize()
        if self._write_stream is not None:
            self._write_stream.synchronize()

    def close(self) -> None:
        """Free the host pages and remove the spill files now (also done when collected)."""
        if self.pinned and self._write_stream is not None:
            self._write_stream.synchronize()  # no write into a chunk given back
        self._select_out = SharedOut()
        for layer in self.layers:
            if layer.page_cache is not None:
                self._release_page_cache(layer)
            layer.graphs = LayerGraphs()  # the graphs read the host pages freed below
            layer._fused, layer._fused_holds = None, False
            layer.pages.clear()
        if self.spill is not None:
            self.spill.close()
        if self.host_memory is not None:
            self.host_memory.close()
        if self._reporter is not None:
            self._reporter.close()

    def __del__(self):
        try:
            if self.spill is not None:
                self.spill.close()
        except Exception:
            pass


def _watch_tokens(model, cache: TieredCache) -> None:
    """Hand the input ids of each forward to ``cache`` (the most recent pruning cache built for
    ``model`` with offsets): a pre-hook on the input embeddings, installed once per model."""
    emb = model.get_input_embeddings()
    emb._kv_prune_cache = weakref.ref(cache)
    if getattr(emb, "_kv_prune_hook", None) is None:
        def hook(module, args):
            target = module._kv_prune_cache() if module._kv_prune_cache else None
            if target is not None and args and isinstance(args[0], torch.Tensor):
                target._observe_ids(args[0])
        emb._kv_prune_hook = emb.register_forward_pre_hook(hook)
