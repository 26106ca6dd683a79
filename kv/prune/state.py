"""One layer's pruning state: where each page of the layer lives (its level), the statistics the
scorer reads, and the step's part of the work -- which pages to attend, what the attention showed,
when to re-evaluate the levels (docs/kv.md, "Importance pruning").

A page lives in exactly one place:

* level 1: on the model's device, attended every step, as one run per layer: ``l1_k``/``l1_v``
  ``[batch, heads, n * page_tokens, head_dim]`` holding pages ``l1_pages`` in that order (pages
  join at the end; a demotion copies its page out and compacts the run);
* level 2: ``l2`` -- the same, as rows of one host buffer (kv/prune/rows.py; page-locked when
  CUDA is present);
* level 3: ``l3`` -- int4 (kv/prune/compress.py), rows of another such buffer; past the cache's
  ``host_bytes``, ``spilled[page]`` -- the same bytes in a spill file (kv/spill.py: the tiered
  cache's NVMe path, crc32c per page), oldest pages first (``TieredCache._prune_spill``).

A page of level 2 or 3 is attended when the step recalls it: every such page when ``top_k_pages``
is None (lossless recall) or in a dense layer or a prefill -- one copy per store -- else the best
``top_k_pages`` of them (a fraction: of the demoted pages), split over the stores by their sizes,
by the Quest bound (the layer's page summaries) -- one gather per store, indices on the device, no
host sync. A recalled page is on the device for the step (a level-3 page as int4, decompressed
there) and dropped after it; a page that keeps drawing attention comes back to level 1 at the next
evaluation (within ``prune_device_tokens``). ``counters["recall_bytes"]`` and
``["recall_copies"]`` count what the recalls moved.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .compress import compress_pages, compressed_bytes, decompress_pages, from_rows, like_page, rows_of
from .offsets import OffsetMatcher, check_offsets
from .policy import adjust_scores, next_levels, page_offsets, page_scores
from .rows import HostRows
from .scorers import TokenStats, attention_probs


PRUNE_GPU_TOKENS = 64
"""The recent window (``gpu_tokens``) when pruning is on and ``gpu_tokens`` is not given: the
scores, not the age, decide what else stays on the device."""


@dataclass
class PruneSettings:
    threshold: float
    scorer: object                      # callable ScoreInput -> [b, n]
    offsets: list = field(default_factory=list)   # (pattern, offset) pairs as given
    tokenizer: object = None
    compensate: bool = True
    every: int = 8                      # decode steps between evaluations of the levels
    window: int = 32                    # moving-average window of the attention share, in steps
    observe_queries: int = 32           # a prefill's last queries observed (SnapKV's window)
    device_tokens: int | None = 512     # sinks + recent window + level-1 pages, at most (None: any)


def validate_prune(threshold, scorer, offsets, tokenizer, compensate, every, window,
                   device_tokens=512) -> None:
    from deepseek_flash.errors import ConfigError

    def bad(key, value, allowed):
        raise ConfigError(f"{key}: {value!r} is not allowed; use {allowed}", key=key,
                          value=value, allowed=allowed)

    ok = (threshold is None or (isinstance(threshold, (int, float))
                                and not isinstance(threshold, bool) and 0.0 <= threshold <= 1.0))
    if not ok:
        bad("prune_threshold", threshold, "null (off) or a number in [0, 1]")
    if not (scorer in ("attention", "mlp") or callable(scorer) or isinstance(scorer, str)
            or hasattr(scorer, "__fspath__")):
        bad("prune_scorer", scorer, "'attention', 'mlp', a scorer file or a callable")
    try:
        check_offsets(offsets, tokenizer)
    except ValueError as exc:
        bad("prune_offsets", offsets, f"[(pattern, offset), ...] ({exc})")
    if not isinstance(compensate, bool):
        bad("prune_compensation", compensate, "true or false")
    for key, v in (("prune_every", every), ("prune_window", window)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            bad(key, v, "an integer >= 1")
    if device_tokens is not None and (not isinstance(device_tokens, int)
                                      or isinstance(device_tokens, bool) or device_tokens < 0):
        bad("prune_device_tokens", device_tokens, "null (unbounded) or an integer >= 0")


class LayerPrune:
    """The pruning state of one ``TieredLayer`` (``layer``: a weak proxy is fine)."""

    def __init__(self, layer, settings: PruneSettings):
        self.layer = layer
        self.s = settings
        self.stats = TokenStats(settings.window)
        self.level = torch.empty(0, dtype=torch.int8)
        self.l1_pages: list[int] = []
        self.l1_k = self.l1_v = None
        self.l2: HostRows | None = None       # level 2: full-precision pages (kv/prune/rows.py)
        self.l3: HostRows | None = None       # level 3: int4 pages (kv/prune/compress.py)
        self.spilled: dict[int, tuple] = {}   # page -> (SpilledChunk, row)
        self.lost: set[int] = set()           # spilled pages whose bytes failed their crc (graceful)
        self._like = None                     # a compressed page of one sequence: the row's shapes
        self._cols = None                     # (levels' key, slots of all but the recent window)
        self._recalled_stores = []            # the store of each part ``_recall`` returned
        self._ahead = None                    # a lossless recall's rows copied ahead (prefetch)
        self.steps = 0
        self.due = False                      # an evaluation is due at the end of the step
        self.counters = {"demotions": 0, "promotions": 0, "recalls": 0, "evaluations": 0,
                         "recall_bytes": 0, "recall_copies": 0}

    def _stores(self) -> None:
        """The level-2 and level-3 row stores, once the layer knows its batch and device."""
        if self.l2 is not None:
            return
        layer, cache = self.layer, self.layer._cache
        h, p, d = cache.kv_heads, cache.page_tokens, cache.head_dim
        self._like = like_page(h, p, d, layer.dtype)
        self.l2 = HostRows(cache.layout.page_bytes, layer.batch, layer.device)
        self.l3 = HostRows(compressed_bytes(h, p, d), layer.batch, layer.device)

    # --- accounting ------------------------------------------------------------------------------
    @property
    def n_pages(self) -> int:
        return self.level.numel()

    def level_pages(self) -> list[int]:
        return [int((self.level == lv).sum()) for lv in (1, 2, 3)]

    def gpu_bytes(self) -> int:
        """KV bytes of level 1 on the device (the scorer's statistics: ``scorer_gpu_bytes``)."""
        return 0 if self.l1_k is None else 2 * self.l1_k.numel() * self.l1_k.element_size()

    def scorer_gpu_bytes(self) -> int:
        """The scorer's per-token attention statistics on the device (not KV)."""
        return self.stats.nbytes()

    def host_bytes(self) -> int:
        rows = 0 if self.l2 is None else self.l2.nbytes() + self.l3.nbytes()
        return rows + self.stats.host_nbytes()

    def spilled_bytes(self) -> int:
        """Bytes of the spill files holding this layer's live level-3 pages."""
        return sum(chunk.file_bytes for chunk in {id(c): c for c, _ in
                                                   self.spilled.values()}.values())

    def compressed_saved(self) -> int:
        """Bytes level 3 saves against holding the same pages at full precision."""
        if self.l3 is None:
            return 0
        per_page = self.l2.page_bytes() - self.l3.page_bytes()
        return (len(self.l3) + len(self.spilled)) * per_page

    # --- pages ----------------------------------------------------------------------------------
    def append(self, pages: torch.Tensor) -> None:
        """Full pages leave the recent window: ``pages`` ``[n, b, 2, h, p, d]`` on the device join
        level 1."""
        first = self.n_pages
        self._join_l1(list(range(first, first + pages.shape[0])), pages)
        self.level = torch.cat((self.level, torch.ones(pages.shape[0], dtype=torch.int8)))

    def _join_l1(self, ids: list[int], pages: torch.Tensor) -> None:
        from ..layout import unpack_pages

        k, v = unpack_pages(pages)
        if self.l1_k is None or not self.l1_pages:
            self.l1_k, self.l1_v = k.contiguous(), v.contiguous()
        else:
            self.l1_k = torch.cat((self.l1_k, k), 2)
            self.l1_v = torch.cat((self.l1_v, v), 2)
        self.l1_pages.extend(ids)

    def _leave_l1(self, ids: set[int]) -> tuple[list[int], torch.Tensor]:
        """Take pages ``ids`` out of the level-1 run -> those pages (in run order) and their
        bytes ``[n, b, 2, h, p, d]`` on the device (one gather)."""
        from ..layout import pack_pages

        p = self.layer._cache.page_tokens
        dev = self.l1_k.device
        ar = torch.arange(p, device=dev)
        out = [pos for pos, page in enumerate(self.l1_pages) if page in ids]
        keep = [pos for pos, page in enumerate(self.l1_pages) if page not in ids]
        gone = (torch.tensor(out, dtype=torch.long, device=dev)[:, None] * p + ar).flatten()
        pages = pack_pages(self.l1_k.index_select(2, gone), self.l1_v.index_select(2, gone), p)
        cols = (torch.tensor(keep, dtype=torch.long, device=dev)[:, None] * p + ar).flatten()
        self.l1_k = self.l1_k.index_select(2, cols)
        self.l1_v = self.l1_v.index_select(2, cols)
        leaving = [self.l1_pages[pos] for pos in out]
        self.l1_pages = [self.l1_pages[pos] for pos in keep]
        return leaving, pages

    def _full(self, rows: torch.Tensor, lead: tuple) -> torch.Tensor:
        """Level-2 rows (uint8) -> pages ``[*lead, 2, h, p, d]`` of the layer's dtype (a view)."""
        return rows.view(self.layer.dtype).view(*lead, *self.layer._cache.layout.shape)

    def _decompressed(self, rows: torch.Tensor, lead: tuple) -> torch.Tensor:
        """Level-3 rows (uint8, on the device) -> pages ``[*lead, 2, h, p, d]``."""
        c = from_rows(rows, self._like, copy=False)
        return decompress_pages(c, self.layer.dtype).view(*lead, *self.layer._cache.layout.shape)

    def _decompressed_kv(self, rows: torch.Tensor, n: int, seq_major: bool):
        """Level-3 rows (uint8, on the device) of ``n`` pages -> keys, values ``[b, h, n * p,
        d]``, decompressed straight into that layout (no copy of the pages to reorder them).
        Rows are page-major (``slot * b + sequence``) or, ``seq_major``, sequence-major."""
        from .compress import CompressedPages, decompress_into

        b, shape = self.layer.batch, self.layer._cache.layout.shape  # (2, h, p, d)
        c = from_rows(rows, self._like, copy=False)
        lead = (b, n) if seq_major else (n, b)
        fields = {f: getattr(c, f).reshape(*lead, *getattr(c, f).shape[1:])
                  for f in ("k_codes", "v_codes", "k_lo", "k_step", "v_lo", "v_step")}
        c = CompressedPages(**fields, shape=(*lead, *shape), dtype=self.layer.dtype)
        _, h, p, d = shape
        out = torch.empty((2, b, h, n, p, d), dtype=torch.float32, device=rows.device)
        decompress_into(c, out.permute(1, 3, 0, 2, 4, 5) if seq_major
                        else out.permute(3, 1, 0, 2, 4, 5))
        kv = out.to(self.layer.dtype).view(2, b, h, n * p, d)
        return kv[0], kv[1]

    def _pages_to_device(self, pages: list[int]) -> torch.Tensor:
        """Demoted ``pages`` (named on the host: an evaluation's promotions) on the device,
        ``[n, b, 2, h, p, d]`` in the order given: one copy per level."""
        layer = self.layer
        b, dev = layer.batch, layer.device
        out = torch.empty((len(pages), *self._page_shape()), dtype=layer.dtype, device=dev)
        for store in (self.l2, self.l3, None):
            at = [i for i, pg in enumerate(pages) if (pg in store if store is not None
                                                       else pg in self.spilled)]
            if not at:
                continue
            named = [pages[i] for i in at]
            if store is None:
                rows = torch.cat([self._read_spilled(pg) for pg in named]).to(dev)
            else:
                rows = store.fetch(named)
            got = (self._full(rows, (len(at), b)) if store is self.l2
                   else self._decompressed(rows, (len(at), b)))
            out[torch.tensor(at, device=dev)] = got
        return out

    # --- level 3 on NVMe --------------------------------------------------------------------------
    def spill(self, pages: list[int]) -> int:
        """Write level-3 ``pages`` to one spill file and free their host rows -> bytes freed.
        Raises ``KVSpillFailed`` with every page still on the host."""
        cache = self.layer._cache
        self._drop_ahead()
        self._sync()
        rows = self.l3.rows(pages).view(len(pages), -1)
        chunk = cache.spill.write_chunk(f"L{self.layer.index:03d}-P{pages[0]:08d}-int4", rows)
        before = self.l3.nbytes()
        self.l3.remove(pages)
        for i, pg in enumerate(pages):
            self.spilled[pg] = (chunk, i)
        cache.counters["chunks_spilled"] += 1
        return before - self.l3.nbytes()

    def _read_spilled(self, page: int) -> torch.Tensor:
        """A spilled level-3 page read back (crc-checked) -> its rows ``[b, row_bytes]`` (CPU).
        A page that fails its crc raises ``KVPageCorrupt`` (strict); graceful: it is lost -- left
        out of attention from now on (``lost``, ``pages_lost``) and zeros stand in for this
        step."""
        from deepseek_flash.errors import KVPageCorrupt

        cache = self.layer._cache
        chunk, row = self.spilled[page]
        buf = torch.empty(chunk.page_bytes, dtype=torch.uint8)
        try:
            cache.spill.read_page(chunk, row, buf, layer=self.layer.index, page=page, row=0)
        except KVPageCorrupt as exc:
            cache.page_lost(exc, self.lost, page)
            buf.zero_()
        else:
            cache.counters["pages_read_spilled"] += 1
        return buf.view(self.layer.batch, -1)

    def _unspill(self, page: int) -> None:
        """``page`` left level 3 on disk: remove its file once no live page is in it."""
        chunk, _ = self.spilled.pop(page)
        if all(c is not chunk for c, _ in self.spilled.values()):
            self.layer._cache.spill.remove(chunk)

    def _page_shape(self) -> tuple:
        cache = self.layer._cache
        return (self.layer.batch, 2, cache.kv_heads, cache.page_tokens, cache.head_dim)

    def _sync(self) -> None:
        """Before the host side writes or reads the row stores: the device's copies of them
        (recalls, page writes) are done."""
        if self.layer.device.type == "cuda":
            torch.cuda.current_stream(self.layer.device).synchronize()

    def _versions(self) -> tuple[int, int]:
        return (self.l2.version, self.l3.version)

    def prefetch(self) -> None:
        """Copy every level-2 and level-3 row of this layer to the device ahead of its step
        (called by the layer before, during a decode step, when this one recalls losslessly): on
        a GPU on the cache's copy stream, so the copy overlaps the layer before's compute. Used
        by ``_recall`` when the stores did not change in between; else dropped."""
        if self.l2 is None or not (len(self.l2) or len(self.l3)):
            return
        key = self._versions()
        if self._ahead is not None and self._ahead[0] == key:
            return
        dev = self.layer.device
        grab = lambda store: store.all() if len(store) else None  # noqa: E731
        if dev.type != "cuda":
            self._ahead = (key, None, grab(self.l2), grab(self.l3))
            return
        cache = self.layer._cache
        if cache._copy_stream is None:
            cache._copy_stream = torch.cuda.Stream(dev)
        stream = cache._copy_stream
        stream.wait_stream(torch.cuda.current_stream(dev))  # after the rows were written
        with torch.cuda.stream(stream):
            r2, r3 = grab(self.l2), grab(self.l3)
            done = torch.cuda.Event()
            done.record(stream)
        self._ahead = (key, done, r2, r3)

    def _take_ahead(self):
        """The rows ``prefetch`` copied -> ``{store: rows}``, or None (none, or stale)."""
        entry, self._ahead = self._ahead, None
        if entry is None or entry[0] != self._versions():
            if entry is not None and entry[1] is not None:
                entry[1].synchronize()
            return None
        key, done, r2, r3 = entry
        if done is not None:
            current = torch.cuda.current_stream(self.layer.device)
            current.wait_event(done)
            for t in (r2, r3):
                if t is not None:
                    t.record_stream(current)
        return {id(self.l2): r2, id(self.l3): r3}

    def _drop_ahead(self) -> None:
        """Before the stores change: no copy of them may still be running."""
        entry, self._ahead = self._ahead, None
        if entry is not None and entry[1] is not None:
            entry[1].synchronize()

    def _apply(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """Move the pages whose level changes from ``old`` to ``new`` (int8 ``[n]``): the reads
        first (one copy per level), then the removals, then the writes."""
        moved = new != old
        if not bool(moved.any()):
            return
        self._stores()
        self._drop_ahead()
        self._sync()
        b = self.layer.batch
        pages_of = lambda mask: torch.nonzero(mask).flatten().tolist()  # noqa: E731
        leaving = pages_of(moved & (old == 1))                    # 1 -> 2
        compressing = pages_of(moved & (old == 2) & (new == 3))   # 2 -> 3
        joining = pages_of(moved & (new == 1))                    # -> 1
        got = self._pages_to_device(joining) if joining else None
        comp_rows = None
        if compressing:
            full = self._full(self.l2.fetch(compressing), (len(compressing) * b,))
            comp_rows = rows_of(compress_pages(full))
        if joining or compressing:
            self._sync()  # the gathers above read the rows the removals below move
        self.l2.remove([pg for pg in compressing + joining if pg in self.l2])
        self.l3.remove([pg for pg in joining if pg in self.l3])
        for pg in joining:
            if pg in self.spilled:
                self._unspill(pg)
        if comp_rows is not None:
            self.l3.put(compressing, comp_rows)
        if leaving:
            leaving, pages = self._leave_l1(set(leaving))  # [n, b, 2, h, p, d] on the device
            self.l2.put(leaving, pages.view(torch.uint8))
        if joining:
            self._join_l1(joining, got)

    # --- a step ---------------------------------------------------------------------------------
    def past(self, query: torch.Tensor, recall_all: bool):
        """Parts (slot order not required) and slot indices ``[b, n]`` of the committed tokens to
        attend: sinks, level-1 pages, recalled pages, recent window. The slots of all but the
        recent window are kept while the levels and the recall mode stay the same (lossless
        recall: every step)."""
        layer, cache = self.layer, self.layer._cache
        p, s, b, dev = cache.page_tokens, layer.sinks, layer.batch, layer.device
        k_parts, v_parts = [layer.sink_k], [layer.sink_v]
        if self.l1_pages:
            k_parts.append(self.l1_k)
            v_parts.append(self.l1_v)
        recalled = self._recall(query, recall_all) if self.l2 is not None else []
        for k, v, _ in recalled:
            k_parts.append(k)
            v_parts.append(v)
        if query.shape[2] <= cache.select_max_queries:  # a decode step
            nxt = cache.layers[(layer.index + 1) % len(cache.layers)]
            if nxt.prune is not None and (cache.top_k_pages is None or nxt.dense):
                nxt.prune.prefetch()  # the next layer's lossless recall, copied during this one
        k_parts.append(layer.recent_k)
        v_parts.append(layer.recent_v)
        n_rec = layer.recent_k.shape[2]
        fixed = all(c is None for _, _, c in recalled)  # every recalled page: slots from the ids
        key = (s, b, tuple(self.l1_pages), self._versions() if self.l2 is not None else None,
               tuple(id(store) for store in self._recalled_stores) if recalled else ())
        if not fixed or self._cols is None or self._cols[0] != key:
            ar = torch.arange(p, device=dev)
            cols = [torch.arange(s, device=dev).expand(b, s)]
            if self.l1_pages:
                idx = torch.tensor(self.l1_pages, device=dev)
                cols.append((s + idx[:, None] * p + ar).reshape(1, -1).expand(b, -1))
            for store, (_, _, c) in zip(self._recalled_stores, recalled):
                if c is None:
                    ids = store.ids()
                    c = (s + ids[:, None] * p + ar).reshape(1, -1).expand(b, -1)
                cols.append(c)
            head = torch.cat(cols, 1)
            self._cols = (key, head) if fixed else None
        else:
            head = self._cols[1]
        recent = torch.arange(layer.length - n_rec, layer.length, device=dev).expand(b, -1)
        return k_parts, v_parts, torch.cat((head, recent), 1)

    def _recall(self, query: torch.Tensor, recall_all: bool):
        """The demoted pages this step attends, per store (level 2, level 3, level 3 on disk):
        keys, values ``[b, h, k * p, d]`` and their slots ``[b, k * p]`` (None: every page of the
        store, in its slot order -- ``past`` makes them from the store's ids). Lossless
        (``recall_all`` or no ``top_k_pages``): every page, one copy per store. Top-K: the budget
        split over the stores by their sizes (``split_k``), the best pages of each by the layer's
        page scores, one gather per store with the indices on the device. ``_recalled_stores``:
        the store of each part returned."""
        from ..layout import unpack_pages
        from ..select import resolve_top_k

        layer, cache = self.layer, self.layer._cache
        p, s, b, dev = cache.page_tokens, layer.sinks, layer.batch, layer.device
        self._recalled_stores = []
        disk = [pg for pg in self.spilled if pg not in self.lost] if self.spilled else []
        sizes = [len(self.l2), len(self.l3), len(disk)]
        total = sum(sizes)
        if total == 0:
            return []
        k = None if recall_all else resolve_top_k(cache.top_k_pages, total)
        scores = None
        if k is not None:
            scores = layer.summaries.scores(query, cache.scale, cache.score, cache.window_pages)
        ahead = self._take_ahead() if k is None else None
        out = []
        for store, n, kg in zip((self.l2, self.l3, None), sizes,
                                [None] * 3 if k is None else split_k(k, sizes)):
            if n == 0 or kg == 0:
                continue
            if store is None:
                pages, kv = self._recall_disk(disk, scores, kg)
                m = pages.shape[1]
                cols = (s + pages[:, :, None] * p + torch.arange(p, device=dev)).reshape(b, -1)
            elif kg is None:  # every page of the store, the same for every sequence
                rows = ahead[id(store)] if ahead is not None else store.all()
                kv = (unpack_pages(self._full(rows, (n, b))) if store is self.l2
                      else self._decompressed_kv(rows, n, seq_major=False))
                m, cols = n, None
            else:
                ids = store.ids()
                slots = scores.index_select(1, ids).topk(kg, dim=-1).indices.sort(-1).values
                rows = store.gather((slots * b + torch.arange(b, device=dev)[:, None]).flatten())
                kv = (unpack_pages(self._full(rows, (b, kg)).transpose(0, 1))
                      if store is self.l2 else self._decompressed_kv(rows, kg, seq_major=True))
                m = kg
                cols = (s + ids[slots][:, :, None] * p + torch.arange(p, device=dev)).reshape(b, -1)
            if store is not None:
                self.counters["recall_bytes"] += rows.numel()
                self.counters["recall_copies"] += 1
            self.counters["recalls"] += b * m
            cache.counters["pages_fetched"] += b * m
            self._recalled_stores.append(store)
            out.append((kv[0], kv[1], cols))
        return out

    def _recall_disk(self, disk: list[int], scores, k):
        """Spilled level-3 pages to attend: all of ``disk`` (``k`` None) or the best ``k`` per
        sequence (the indices come to the host: pages on disk are read one by one anyway) ->
        slots' pages ``[b, m]`` and keys, values."""
        from ..layout import unpack_pages

        layer = self.layer
        b, dev = layer.batch, layer.device
        if k is None:
            rows = [disk] * b
        else:
            ids = torch.tensor(disk, device=dev)
            best = scores.index_select(1, ids).topk(k, dim=-1).indices.sort(-1).values
            rows = ids[best].cpu().tolist()
        wanted = sorted({pg for r in rows for pg in r})
        read = {pg: self._read_spilled(pg) for pg in wanted}  # [b, row_bytes] each
        m = len(rows[0])
        got = torch.stack([torch.stack([read[pg][r] for pg in rows[r]]) for r in range(b)])
        self.counters["recall_bytes"] += got.numel()
        self.counters["recall_copies"] += len(wanted)
        pages = self._decompressed(got.view(b * m, -1).to(dev), (b, m))  # [b, m, 2, h, p, d]
        return torch.tensor(rows, device=dev), unpack_pages(pages.transpose(0, 1))

    def shares(self, query, keys, cols, pad_mask, scale, q_len):
        """The attention share ``[b, n]`` of the attended slots (committed ``cols`` and the new
        tokens; ``keys``: theirs, as the attention concatenated them) for the last
        ``observe_queries`` queries, and those slots ``[b, n]``."""
        layer = self.layer
        b = keys.shape[0]
        new_slots = torch.arange(layer.length, layer.length + q_len, device=keys.device)
        slots = torch.cat((cols, new_slots.expand(b, -1)), 1)
        valid = None
        if pad_mask is not None:
            valid = torch.gather(pad_mask[:, :layer.length + q_len].to(torch.bool), 1, slots)
        w = min(q_len, self.s.observe_queries)
        n_past = cols.shape[1]
        probs = attention_probs(query[:, :, q_len - w:], keys, scale, valid,
                                causal_offset=n_past + q_len - w if q_len > 1 else None)
        return probs, slots

    def committed(self, k_new, v_new, probs, slots, q_len: int) -> None:
        """After the layer committed the step: record the new tokens and what the attention
        showed; evaluate the levels every ``every`` decode steps (and after each prefill)."""
        self.stats.append(k_new, v_new)
        self.stats.observe(probs, slots)
        if q_len > self.layer._cache.select_max_queries:
            self.due = True
            self.steps = 0
        else:
            self.steps += 1
            if self.steps % self.s.every == 0:
                self.due = True
        cache = self.layer._cache
        if self.layer.index == len(cache.layers) - 1:
            evaluate_due(cache.layers)

    def page_scores(self) -> torch.Tensor:
        """Scores ``[n_pages]`` (CPU) of the layer's pages (``device_page_scores``, brought to
        the host)."""
        return self.device_page_scores().cpu()

    def device_page_scores(self) -> torch.Tensor:
        """Scores ``[n_pages]`` of the layer's pages, on its device: the scorer's token scores,
        averaged per page, times the compensation, plus the pattern offsets
        (kv/prune/policy.py)."""
        layer, cache = self.layer, self.layer._cache
        s, p = layer.sinks, cache.page_tokens
        inp = self.stats.input(layer.index, cache.num_layers, s, s + self.n_pages * p,
                               layer.length)
        raw = page_scores(self.s.scorer(inp).float().clamp(0.0, 1.0), p)
        tok_off = cache.prune_offsets_for(layer)
        off = page_offsets(tok_off, p) if tok_off is not None else None
        l1, l2, _ = self.level_pages()
        n_active = layer.sinks + layer.recent_k.shape[2] + (l1 + l2) * p
        return adjust_scores(raw, n_active, off, compensate=self.s.compensate)

    def l1_cap(self) -> int | None:
        """Level-1 pages the layer may hold: what ``device_tokens`` leaves after the sinks and
        the recent window (``gpu_tokens``), in whole pages; None: unbounded."""
        if self.s.device_tokens is None:
            return None
        cache = self.layer._cache
        left = self.s.device_tokens - cache.sink_tokens - cache.gpu_tokens
        return max(0, left) // cache.page_tokens

    def evaluate(self, scores: torch.Tensor | None = None) -> None:
        """Move the pages to their levels by ``scores`` (CPU ``[n_pages]``; None: scored now)."""
        self.due = False
        if self.n_pages == 0:
            return
        if scores is None:
            scores = self.page_scores()
        if self.lost:  # a lost page has no bytes to come back with: it stays at level 3
            scores[torch.tensor(sorted(self.lost))] = -1.0
        new, promoted, demoted = next_levels(self.level, scores, self.s.threshold,
                                             self.l1_cap())
        self._apply(self.level, new)
        self.level = new
        self.counters["promotions"] += int(promoted.sum())
        self.counters["demotions"] += int(demoted.sum())
        self.counters["evaluations"] += 1
        self.layer._cache._prune_spill()


def evaluate_due(layers) -> None:
    """After a step's last layer: evaluate every layer that is due (``LayerPrune.due``), their
    page scores computed on the device first and brought to the host together (one sync for the
    step, not one per layer), the levels then moved layer by layer (kv/prune/policy.py)."""
    due = [layer.prune for layer in layers
           if layer.prune is not None and layer.prune.due and layer.prune.n_pages]
    for layer in layers:
        if layer.prune is not None:
            layer.prune.due = False
    if not due:
        return
    for p, sc in zip(due, score_layers(due)):
        p.evaluate(sc)


def score_layers(prunes) -> list[torch.Tensor]:
    """Page scores of each layer in ``prunes`` (``LayerPrune.device_page_scores``), on the host:
    computed on the device first, one copy to the host for all of them."""
    scores = [p.device_page_scores() for p in prunes]
    host = torch.cat([t.float() for t in scores]).cpu().split([t.numel() for t in scores])
    return [t.clone() for t in host]


def split_k(k: int, sizes: list[int]) -> list[int]:
    """A top-K budget of ``k`` pages over stores of ``sizes`` pages: proportional to the sizes
    (largest remainders first, ties: the earlier store), each at most its size, ``k`` in all
    (when the stores hold that many)."""
    total = sum(sizes)
    k = min(k, total)
    share = [k * n // total if total else 0 for n in sizes]
    rest = sorted(range(len(sizes)), key=lambda i: (-(k * sizes[i] % total) if total else 0, i))
    left = k - sum(share)
    for i in rest:
        if left == 0:
            break
        if share[i] < sizes[i]:
            share[i] += 1
            left -= 1
    return share


def offset_values(matchers: list[OffsetMatcher], start: int, stop: int,
                  device) -> torch.Tensor | None:
    """Offsets ``[b, stop - start]`` of token slots ``start .. stop - 1`` (None: no rules)."""
    if not matchers or not matchers[0].rules:
        return None
    rows = []
    for m in matchers:
        vals = m.values[start:stop]
        rows.append(vals + [0.0] * (stop - start - len(vals)))
    return torch.tensor(rows, dtype=torch.float32, device=device)


def prune_settings(threshold, scorer, offsets, tokenizer, compensate, every,
                   window, device_tokens=512) -> PruneSettings | None:
    """Validated settings, or None when pruning is off (``threshold`` None)."""
    validate_prune(threshold, scorer, offsets, tokenizer, compensate, every, window, device_tokens)
    if threshold is None:
        return None
    from .scorers import resolve_scorer
    try:
        fn = resolve_scorer(scorer)
    except ValueError as exc:
        from deepseek_flash.errors import ConfigError
        raise ConfigError(str(exc), key="prune_scorer", value=str(scorer),
                          allowed="'attention', 'mlp', a scorer file or a callable") from None
    return PruneSettings(float(threshold), fn, list(offsets or ()), tokenizer, compensate, every,
                         window, device_tokens=device_tokens)
