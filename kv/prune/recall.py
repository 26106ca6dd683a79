"""The recall of one layer's demoted pages (levels 2 and 3) for a step, as ``LayerPrune``'s
``Recall`` part (kv/prune/state.py holds the levels and their moves; docs/kv.md, "Importance
pruning: what a recall costs").

A page of level 2 or 3 is attended when the step recalls it: every such page when ``top_k_pages``
is None (lossless recall) or in a dense layer or a prefill -- one copy per store, on a GPU copied
a layer ahead on the cache's copy stream (``prefetch``) -- else the best ``top_k_pages`` of them
(a fraction: of the demoted pages), split over the stores by their sizes (``split_k``), by the
Quest bound (the layer's page summaries) -- one gather per store, indices on the device, no host
sync. Level-3 rows are decompressed on the device straight into the keys-and-values layout. The
slot indices of what a step attends are kept while the levels do not change.
"""
from __future__ import annotations

import torch

from .compress import decompress_pages, from_rows


class Recall:
    """The recall half of ``LayerPrune`` (a mixin: it reads the layer, the stores and the
    counters ``LayerPrune`` sets up)."""

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
        from .compress import decompress_rows_into

        b, shape = self.layer.batch, self.layer._cache.layout.shape  # (2, h, p, d)
        lead = (b, n) if seq_major else (n, b)
        _, h, p, d = shape
        out = torch.empty((2, b, h, n, p, d), dtype=torch.float32, device=rows.device)
        decompress_rows_into(rows, self._like, lead, out.permute(1, 3, 0, 2, 4, 5) if seq_major
                             else out.permute(3, 1, 0, 2, 4, 5))
        kv = out.to(self.layer.dtype).view(2, b, h, n * p, d)
        return kv[0], kv[1]

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

    def past(self, query: torch.Tensor, recall_all: bool):
        """Parts (slot order not required) and slot indices ``[b, n]`` of the committed tokens to
        attend: sinks, level-1 pages, recalled pages, recent window. The slots of all but the
        recent window are kept while the levels and the recall mode stay the same (lossless
        recall: every step)."""
        layer, cache = self.layer, self.layer._cache
        p, s, b, dev = cache.page_tokens, layer.sinks, layer.batch, layer.device
        if query.shape[2] <= cache.select_max_queries:  # a decode step
            nxt = cache.layers[(layer.index + 1) % len(cache.layers)]
            if nxt.prune is not None and (cache.top_k_pages is None or nxt.dense):
                # the next layer's lossless recall, copied during this one -- queued before this
                # layer's own recall work, so the copy engine goes on from this layer's copy
                nxt.prune.prefetch()
        k_parts, v_parts = [layer.sink_k], [layer.sink_v]
        if self.l1_pages:
            k_parts.append(self.l1_k)
            v_parts.append(self.l1_v)
        recalled = self._recall(query, recall_all) if self.l2 is not None else []
        for k, v, _ in recalled:
            k_parts.append(k)
            v_parts.append(v)
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
        # the recent window's slots and this step's new tokens' (``shares`` reads them all)
        q_len = query.shape[2]
        recent = torch.arange(layer.length - n_rec, layer.length + q_len, device=dev)
        self._slots = torch.cat((head, recent.expand(b, -1)), 1)
        return k_parts, v_parts, self._slots[:, :self._slots.shape[1] - q_len]

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
