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

A page of level 2 or 3 is attended when the step recalls it (kv/prune/recall.py, ``Recall``);
a page that keeps drawing attention comes back to level 1 at the next evaluation (within
``prune_device_tokens``). Evaluations run after a step's last layer (``evaluate_due``).
``counters["recall_bytes"]`` and ``["recall_copies"]`` count what the recalls moved.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .compress import compress_pages, compressed_bytes, like_page, rows_of
from .offsets import OffsetMatcher, check_offsets
from .policy import adjust_scores, next_levels, page_offsets, page_scores
from .recall import Recall, split_k  # noqa: F401 - split_k: part of this module's interface
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


class LayerPrune(Recall):
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
        self._slots = None                    # the step's attended slots, new tokens' last
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
        pool = cache.host_memory.pool()
        self.l2 = HostRows(cache.layout.page_bytes, layer.batch, layer.device, pool)
        self.l3 = HostRows(compressed_bytes(h, p, d), layer.batch, layer.device, pool)
        if self.l3.pinned:  # int4 room for every page now (the first evaluation), not in decode
            self.l3.reserve(self.n_pages)

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

    def _apply(self, old: torch.Tensor, new: torch.Tensor, comp_rows=None) -> None:
        """Move the pages whose level changes from ``old`` to ``new`` (int8 ``[n]``): the device
        side (``_begin``), one wait for the device, the host side (``_finish``)."""
        st = self._begin(old, new, comp_rows)
        if st is not None:
            self._sync()  # the gathers read the rows the removals move
            self._finish(st)

    def _begin(self, old: torch.Tensor, new: torch.Tensor, comp_rows=None):
        """The device side of moving the pages whose level changes from ``old`` to ``new``:
        the pages joining level 1 gathered to the device (one copy per level), those going
        2 -> 3 compressed (``comp_rows``: their int4 rows in page order when the caller
        compressed them already -- ``compress_moving``, every layer's at once), those leaving
        level 1 taken out of its run -> what ``_finish`` needs, or None (nothing moves). No host
        row changes here; the caller waits for the device before ``_finish``. A host read of
        the rows here (spill files, the no-view fallback) follows the evaluation's own wait for
        the device (the scores' copy to the host)."""
        moved = new != old
        if not bool(moved.any()):
            return None
        self._stores()
        self._drop_ahead()
        pages_of = lambda mask: torch.nonzero(mask).flatten().tolist()  # noqa: E731
        leaving = pages_of(moved & (old == 1))                    # 1 -> 2
        compressing = pages_of(moved & (old == 2) & (new == 3))   # 2 -> 3
        joining = pages_of(moved & (new == 1))                    # -> 1
        got = self._pages_to_device(joining) if joining else None
        if compressing and comp_rows is None:
            comp_rows = rows_of(compress_pages(self._to_compress(compressing)))
        left = None
        if leaving:
            leaving, left = self._leave_l1(set(leaving))  # [n, b, 2, h, p, d] on the device
        return leaving, compressing, joining, got, comp_rows, left

    def _finish(self, st) -> None:
        """The host side of ``_begin``'s moves: removals from the host rows first, then the
        writes (asynchronous from a GPU, ordered on its stream)."""
        leaving, compressing, joining, got, comp_rows, left = st
        self.l2.remove([pg for pg in compressing + joining if pg in self.l2])
        self.l3.remove([pg for pg in joining if pg in self.l3])
        for pg in joining:
            if pg in self.spilled:
                self._unspill(pg)
        if comp_rows is not None:
            self.l3.put(compressing, comp_rows)
        if leaving:
            self.l2.put(leaving, left.view(torch.uint8))
        if joining:
            self._join_l1(joining, got)

    # --- a step ---------------------------------------------------------------------------------
    def shares(self, query, keys, cols, pad_mask, scale, q_len):
        """The attention share ``[b, n]`` of the attended slots (committed ``cols`` and the new
        tokens; ``keys``: theirs, as the attention concatenated them) for the last
        ``observe_queries`` queries, and those slots ``[b, n]``."""
        layer = self.layer
        slots = self._slots  # ``past``: ``cols`` and then the new tokens' slots
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

    def _to_compress(self, pages: list[int]) -> torch.Tensor:
        """Level-2 ``pages`` on the device, ``[len(pages) * b, 2, h, p, d]`` (one gather)."""
        return self._full(self.l2.fetch(pages), (len(pages) * self.layer.batch,))

    def plan(self, scores: torch.Tensor):
        """The levels ``scores`` (CPU ``[n_pages]``) give -> new levels, promoted, demoted
        (``next_levels``); nothing moves yet."""
        if self.lost:  # a lost page has no bytes to come back with: it stays at level 3
            scores[torch.tensor(sorted(self.lost))] = -1.0
        return next_levels(self.level, scores, self.s.threshold, self.l1_cap())

    def evaluate(self, scores: torch.Tensor | None = None, planned=None,
                 comp_rows=None) -> None:
        """Move the pages to their levels by ``scores`` (CPU ``[n_pages]``; None: scored now) or
        by ``planned`` (``plan``'s result; ``comp_rows``: see ``_apply``)."""
        self.due = False
        if self.n_pages == 0:
            return
        if planned is None:
            planned = self.plan(scores if scores is not None else self.page_scores())
        self._apply(self.level, planned[0], comp_rows)
        self._planned(planned)

    def _planned(self, planned) -> None:
        """After the pages moved: the new levels, the counters, the spill check."""
        new, promoted, demoted = planned
        self.level = new
        self.counters["promotions"] += int(promoted.sum())
        self.counters["demotions"] += int(demoted.sum())
        self.counters["evaluations"] += 1
        self.layer._cache._prune_spill()


EVAL_BYTES = 256 << 20
"""At most this many bytes of pages (at full precision) move in one group of an evaluation: the
device holds one group's moving pages and their int4 rows at a time, not every layer's (at 32K on
the 8B shape the first decode evaluation compresses ~2.6 GB of level-2 pages: all at once, its
fp32 working copies took ~15 GB of GPU memory)."""
COMPRESS_BYTES = 64 << 20
"""At most this many bytes of full-precision pages in one ``compress_pages`` call (its fp32
working copies are ~4x that)."""


def evaluate_due(layers) -> None:
    """After a step's last layer: evaluate every layer that is due (``LayerPrune.due``), their
    page scores computed on the device first and brought to the host together (one sync for the
    step, not one per layer); then, group by group of layers whose moving pages come to at most
    ``EVAL_BYTES`` (one layer at least), their 2 -> 3 pages compressed together (``COMPRESS_BYTES``
    at a time), every layer's device side of the moves launched, one wait for the device, every
    layer's host side (kv/prune/policy.py). Later evaluations move few pages: one group."""
    due = [layer.prune for layer in layers
           if layer.prune is not None and layer.prune.due and layer.prune.n_pages]
    for layer in layers:
        if layer.prune is not None:
            layer.prune.due = False
    if not due:
        return
    plans = [p.plan(sc) for p, sc in zip(due, score_layers(due))]
    for group in _groups(due, plans, EVAL_BYTES):
        prunes = [due[i] for i in group]
        gplans = [plans[i] for i in group]
        begun = [p._begin(p.level, plan[0], rows)
                 for p, plan, rows in zip(prunes, gplans, compress_moving(prunes, gplans))]
        waited = set()
        for p, st in zip(prunes, begun):
            if st is not None and p.layer.device not in waited:
                p._sync()
                waited.add(p.layer.device)
        for p, plan, st in zip(prunes, gplans, begun):
            if st is not None:
                p._finish(st)
            p._planned(plan)


def _moving_bytes(p, plan) -> int:
    """Bytes at full precision of the pages ``plan`` moves in layer ``p`` (every sequence)."""
    new = plan[0]
    n = int((new != p.level).sum())
    return n * p.layer._cache.layout.page_bytes * p.layer.batch


def _groups(prunes, plans, budget: int) -> list[list[int]]:
    """Consecutive layers, each group's moving bytes at most ``budget`` (one layer at least)."""
    groups, cur, size = [], [], 0
    for i, (p, plan) in enumerate(zip(prunes, plans)):
        b = _moving_bytes(p, plan)
        if cur and size + b > budget:
            groups.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += b
    if cur:
        groups.append(cur)
    return groups


def compress_moving(prunes, plans, budget: int | None = None) -> list:
    """The int4 rows of every layer's pages going 2 -> 3 by ``plans``, compressed in as few
    ``compress_pages`` calls as ``budget`` (``COMPRESS_BYTES``) of full-precision pages per call
    allows -- layers together when they are small, a large layer's pages split (int4 groups are
    per page: the same bytes as layer by layer) -> per layer its rows (page order) or None
    (nothing to compress, or layers on several devices: each compresses its own)."""
    budget = COMPRESS_BYTES if budget is None else budget
    pages = [torch.nonzero((p.level == 2) & (new == 3)).flatten().tolist()
             for p, (new, _, _) in zip(prunes, plans)]
    moving = [(p, pg) for p, pg in zip(prunes, pages) if pg]
    if not moving or len({p.layer.device for p, _ in moving}) > 1:
        return [None] * len(prunes)
    if len(moving) == 1 and _fits(moving[0][0], len(moving[0][1]), budget):
        return [None] * len(prunes)  # one small layer: ``_begin`` compresses it
    # pieces (layer, pages) of at most ``budget`` bytes each, then calls of whole pieces
    per = max(1, budget // (moving[0][0].layer._cache.layout.page_bytes
                            * moving[0][0].layer.batch))
    pieces = [(p, pg[i:i + per]) for p, pg in moving for i in range(0, len(pg), per)]
    got: dict[int, list] = {}
    call, size = [], 0
    for piece in pieces + [None]:
        n = 0 if piece is None else len(piece[1])
        if call and (piece is None or size + n > per):
            fulls = [p._to_compress(pg) for p, pg in call]
            x = torch.cat(fulls) if len(fulls) > 1 else fulls[0]
            del fulls
            rows = rows_of(compress_pages(x)).split([len(pg) * p.layer.batch for p, pg in call])
            del x
            for (p, _), r in zip(call, rows):
                got.setdefault(id(p), []).append(r)
            call, size = [], 0
        if piece is not None:
            call.append(piece)
            size += n
    return [(torch.cat(got[id(p)]) if len(got[id(p)]) > 1 else got[id(p)][0])
            if id(p) in got else None for p in prunes]


def _fits(p, n_pages: int, budget: int) -> bool:
    return n_pages * p.layer._cache.layout.page_bytes * p.layer.batch <= budget


def score_layers(prunes) -> list[torch.Tensor]:
    """Page scores of each layer in ``prunes`` (``LayerPrune.device_page_scores``), on the host:
    computed on the device first -- for the built-in attention scorer every layer at once
    (``attention_scores_together``) -- one copy to the host for all of them."""
    scores = attention_scores_together(prunes)
    if scores is None:
        scores = [p.device_page_scores() for p in prunes]
    host = torch.cat([t.float() for t in scores]).cpu().split([t.numel() for t in scores])
    return [t.clone() for t in host]


def attention_scores_together(prunes) -> list[torch.Tensor] | None:
    """``device_page_scores`` of every layer in ``prunes`` in one set of tensor operations, not
    one per layer, where that gives the same numbers: every layer scored by the built-in
    ``"attention"`` scorer, no pattern offsets, the same paged slots, batch and device (the usual
    case: every layer of a cache holds the same tokens); else None."""
    from .scorers import ATTENTION_HALF, KEY_NORM_WEIGHT, _zscore, attention_scorer
    from .policy import compensation

    if len(prunes) < 2:
        return None
    first = prunes[0]
    cache = first.layer._cache
    key = (first.layer.sinks, first.n_pages, first.layer.batch, first.layer.device)
    if getattr(cache, "_matchers", None) or any(
            q.s.scorer is not attention_scorer or q.stats._f is None
            or (q.layer.sinks, q.n_pages, q.layer.batch, q.layer.device) != key for q in prunes):
        return None
    s, n_pages, b, dev = key
    p = cache.page_tokens
    stop = s + n_pages * p
    f = torch.stack([q.stats._f[:, :, s:stop] for q in prunes])        # [L, 3, b, n]
    norms = torch.empty((len(prunes), stop - s, *first.stats._norms.shape[1:]),
                        dtype=torch.float32, device=dev)
    for i, q in enumerate(prunes):  # the host's norms of the scored slots: one copy per layer
        norms[i].copy_(q.stats._norms[s:stop], non_blocking=dev.type == "cuda")
    knorm = norms[:, :, 0].permute(0, 2, 3, 1)                          # [L, b, h, n]
    # attention_scorer, for every layer at once
    z = _zscore(knorm).mean(2)
    x = f[:, 0].clamp(min=0) * torch.exp(-KEY_NORM_WEIGHT * z)
    score = x / (ATTENTION_HALF + x)
    tok = torch.where(f[:, 2] > 0, score, torch.full_like(score, 0.5))
    # page_scores and adjust_scores (kv/prune/policy.py), per layer's row
    raw = tok.float().clamp(0.0, 1.0).view(len(prunes), b, n_pages, p).mean(3).amax(1)
    factors = []
    for q in prunes:
        l1, l2, _ = q.level_pages()
        n_active = q.layer.sinks + q.layer.recent_k.shape[2] + (l1 + l2) * p
        factors.append(compensation(n_active, q.s.compensate))
    if any(c != 1.0 for c in factors):
        raw = raw * torch.tensor(factors, dtype=raw.dtype, device=dev)[:, None]
    return list(raw.clamp(0.0, 1.0).unbind(0))


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
