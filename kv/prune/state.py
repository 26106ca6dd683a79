"""One layer's pruning state: where each page of the layer lives (its level), the statistics the
scorer reads, and the step's part of the work -- which pages to attend, what the attention showed,
when to re-evaluate the levels (docs/kv.md, "Importance pruning").

A page lives in exactly one place:

* level 1: on the model's device, attended every step, as one run per layer: ``l1_k``/``l1_v``
  ``[batch, heads, n * page_tokens, head_dim]`` holding pages ``l1_pages`` in that order (pages
  join at the end; a demotion copies its page out and compacts the run);
* level 2: ``host[page]`` -- the same, on the host (page-locked when CUDA is present);
* level 3: ``comp[page]`` -- int4 (kv/prune/compress.py) on the host; past the cache's
  ``host_bytes``, ``spilled[page]`` -- the same bytes in a spill file (kv/spill.py: the tiered
  cache's NVMe path, crc32c per page), oldest pages first (``TieredCache._prune_spill``).

A page of level 2 or 3 is attended when the step recalls it: every such page when ``top_k_pages``
is None (lossless recall) or in a dense layer or a prefill, else the best ``top_k_pages`` of them
(a fraction: of the demoted pages) by the Quest bound (the layer's page summaries). A recalled
page is copied to the device for the step (a level-3 page as int4, decompressed there) and
dropped after it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .compress import compress_pages, decompress_pages, from_rows, stack_compressed, to_rows
from .offsets import OffsetMatcher, check_offsets
from .policy import adjust_scores, next_levels, page_offsets, page_scores
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
        self.host: dict[int, torch.Tensor] = {}
        self.comp: dict = {}
        self.spilled: dict[int, tuple] = {}   # page -> (SpilledChunk, row)
        self.lost: set[int] = set()           # spilled pages whose bytes failed their crc (graceful)
        self._like = None                     # a compressed page: the shapes of the spill form
        self.steps = 0
        self.counters = {"demotions": 0, "promotions": 0, "recalls": 0, "evaluations": 0}

    # --- accounting ------------------------------------------------------------------------------
    @property
    def n_pages(self) -> int:
        return self.level.numel()

    def level_pages(self) -> list[int]:
        return [int((self.level == lv).sum()) for lv in (1, 2, 3)]

    def gpu_bytes(self) -> int:
        kv = 0 if self.l1_k is None else 2 * self.l1_k.numel() * self.l1_k.element_size()
        return kv + self.stats.nbytes()

    def host_bytes(self) -> int:
        return (sum(t.numel() * t.element_size() for t in self.host.values())
                + sum(c.nbytes for c in self.comp.values()))

    def spilled_bytes(self) -> int:
        """Bytes of the spill files holding this layer's live level-3 pages."""
        return sum(chunk.file_bytes for chunk in {id(c): c for c, _ in
                                                   self.spilled.values()}.values())

    def compressed_saved(self) -> int:
        """Bytes level 3 saves against holding the same pages at full precision."""
        saved = sum(int(torch.Size(c.shape).numel()) * torch.empty((), dtype=c.dtype).element_size()
                    - c.nbytes for c in self.comp.values())
        if self.spilled and self._like is not None:
            c = self._like
            full = int(torch.Size(c.shape).numel()) * torch.empty((), dtype=c.dtype).element_size()
            saved += len(self.spilled) * (full - c.nbytes)
        return saved

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

    def _leave_l1(self, ids: set[int]) -> dict[int, torch.Tensor]:
        """Take pages ``ids`` out of the level-1 run -> their pages ``[b, 2, h, p, d]`` (device)."""
        p = self.layer._cache.page_tokens
        out = {}
        for pos, page in enumerate(self.l1_pages):
            if page in ids:
                sl = slice(pos * p, (pos + 1) * p)
                out[page] = torch.stack((self.l1_k[:, :, sl], self.l1_v[:, :, sl]), 1)
        keep = [pos for pos, page in enumerate(self.l1_pages) if page not in ids]
        cols = (torch.tensor(keep, dtype=torch.long, device=self.l1_k.device)[:, None] * p
                + torch.arange(p, device=self.l1_k.device)).flatten()
        self.l1_k = self.l1_k.index_select(2, cols)
        self.l1_v = self.l1_v.index_select(2, cols)
        self.l1_pages = [self.l1_pages[pos] for pos in keep]
        return out

    def _pages_to_device(self, pages: list[int]) -> torch.Tensor:
        """Demoted ``pages`` on the device, ``[n, b, 2, h, p, d]`` in the order given: each level-2
        one copied straight into place, the level-3 ones in one copy of their int4 form,
        decompressed there."""
        layer = self.layer
        pinned = layer.device.type == "cuda"
        out = torch.empty((len(pages), *self._page_shape()), dtype=layer.dtype,
                          device=layer.device)
        full = [i for i, pg in enumerate(pages) if pg in self.host]
        small = [i for i, pg in enumerate(pages) if pg not in self.host]
        for i in full:
            # one copy per page, straight from its (page-locked) host tensor into place: no
            # host-side stack into pageable memory first (that was a second pass over the bytes
            # and made the copy to the GPU a synchronous pageable one)
            out[i].copy_(self.host[pages[i]], non_blocking=pinned)
        if small:
            c = stack_compressed([self.comp[pages[i]] if pages[i] in self.comp
                                  else self._read_spilled(pages[i]) for i in small])
            c = c.to(layer.device, non_blocking=pinned)
            out[torch.tensor(small, device=layer.device)] = decompress_pages(c, layer.dtype)
        return out

    # --- level 3 on NVMe --------------------------------------------------------------------------
    def spill(self, pages: list[int]) -> int:
        """Write level-3 ``pages`` (held in ``comp``) to one spill file and free their host bytes
        -> bytes freed. Raises ``KVSpillFailed`` with every page still on the host."""
        cache = self.layer._cache
        rows = to_rows([self.comp[pg] for pg in pages])
        chunk = cache.spill.write_chunk(f"L{self.layer.index:03d}-P{pages[0]:08d}-int4", rows)
        freed = 0
        for i, pg in enumerate(pages):
            freed += self.comp.pop(pg).nbytes
            self.spilled[pg] = (chunk, i)
        cache.counters["chunks_spilled"] += 1
        return freed

    def _read_spilled(self, page: int):
        """A spilled level-3 page read back (crc-checked) -> its compressed form (CPU). A page
        that fails its crc raises ``KVPageCorrupt`` (strict); graceful: it is lost -- left out of
        attention from now on (``lost``, ``pages_lost``) and zeros stand in for this step."""
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
        return from_rows(buf[None], self._like).select(0)

    def _unspill(self, page: int) -> None:
        """``page`` left level 3 on disk: remove its file once no live page is in it."""
        chunk, _ = self.spilled.pop(page)
        if all(c is not chunk for c, _ in self.spilled.values()):
            self.layer._cache.spill.remove(chunk)

    def _page_shape(self) -> tuple:
        cache = self.layer._cache
        return (self.layer.batch, 2, cache.kv_heads, cache.page_tokens, cache.head_dim)

    def _compress(self, pages: list[int]) -> None:
        """Level-2 ``pages`` -> level 3: int4 in one batch (on the device when it is a GPU: the
        pages go there, are quantized, and only their int4 form comes back)."""
        layer = self.layer
        batch = torch.stack([self.host.pop(pg) for pg in pages])
        if layer.device.type == "cuda":
            c = compress_pages(batch.to(layer.device, non_blocking=True)).to("cpu")
        else:
            c = compress_pages(batch)
        for i, pg in enumerate(pages):
            self.comp[pg] = c.select(i)
        self._like = self.comp[pages[0]]

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu":
            return t.clone()
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t)
        return out

    def _apply(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """Move the pages whose level changes from ``old`` to ``new`` (int8 ``[n]``)."""
        changed = torch.nonzero(new != old).flatten().tolist()
        leaving = {pg for pg in changed if int(old[pg]) == 1}
        if leaving:
            for page, t in self._leave_l1(leaving).items():
                self.host[page] = self._to_host(t)          # 1 -> 2
        joining, compressing = [], []
        for page in changed:
            lv_old, lv_new = int(old[page]), int(new[page])
            if lv_new == 1:
                joining.append(page)
            elif lv_new == 3 and lv_old == 2:
                compressing.append(page)
        if compressing:
            self._compress(compressing)
        if joining:
            got = self._pages_to_device(joining)
            for pg in joining:
                self.host.pop(pg, None)
                self.comp.pop(pg, None)
                if pg in self.spilled:
                    self._unspill(pg)
            self._join_l1(joining, got)

    # --- a step ---------------------------------------------------------------------------------
    def past(self, query: torch.Tensor, recall_all: bool):
        """Parts (slot order not required) and slot indices ``[b, n]`` of the committed tokens to
        attend: sinks, level-1 pages, recalled pages, recent window."""
        layer, cache = self.layer, self.layer._cache
        p, s, b, dev = cache.page_tokens, layer.sinks, layer.batch, layer.device
        ar = torch.arange(p, device=dev)
        k_parts, v_parts, cols = [layer.sink_k], [layer.sink_v], [torch.arange(s, device=dev)
                                                                  .expand(b, s)]
        if self.l1_pages:
            k_parts.append(self.l1_k)
            v_parts.append(self.l1_v)
            idx = torch.tensor(self.l1_pages, device=dev)
            cols.append((s + idx[:, None] * p + ar).reshape(1, -1).expand(b, -1))
        demoted = torch.nonzero(self.level > 1).flatten().tolist()
        if self.lost:
            demoted = [pg for pg in demoted if pg not in self.lost]
        if demoted:
            from ..select import resolve_top_k, select_pages
            k = None if recall_all else resolve_top_k(cache.top_k_pages, len(demoted))
            if k is None:
                rows = [demoted] * b
            else:
                scores = layer.summaries.scores(query, cache.scale, cache.score,
                                                cache.window_pages)
                mask = torch.full((self.n_pages,), float("-inf"), device=scores.device)
                mask[torch.tensor(demoted, device=scores.device)] = 0.0
                rows = select_pages(scores + mask, k).cpu().tolist()
            wanted = sorted({pg for r in rows for pg in r})
            got = self._pages_to_device(wanted)  # [n, b, 2, h, p, d]
            if all(r == wanted for r in rows):
                per_row = got.transpose(0, 1)  # [b, k, 2, h, p, d]
            else:
                at = {pg: i for i, pg in enumerate(wanted)}
                per_row = torch.stack([got[torch.tensor([at[pg] for pg in rows[r]],
                                                        device=dev), r] for r in range(b)])
            kb = per_row[:, :, 0].permute(0, 2, 1, 3, 4).reshape(b, per_row.shape[3], -1,
                                                                 per_row.shape[-1])
            vb = per_row[:, :, 1].permute(0, 2, 1, 3, 4).reshape(b, per_row.shape[3], -1,
                                                                 per_row.shape[-1])
            k_parts.append(kb)
            v_parts.append(vb)
            ridx = torch.tensor(rows, device=dev)  # [b, k]
            cols.append((s + ridx[:, :, None] * p + ar).reshape(b, -1))
            self.counters["recalls"] += sum(len(r) for r in rows)
            cache.counters["pages_fetched"] += sum(len(r) for r in rows)
        k_parts.append(layer.recent_k)
        v_parts.append(layer.recent_v)
        n_rec = layer.recent_k.shape[2]
        cols.append(torch.arange(layer.length - n_rec, layer.length, device=dev).expand(b, -1))
        return k_parts, v_parts, torch.cat(cols, 1)

    def shares(self, query, k_parts, k_new, cols, pad_mask, scale, q_len):
        """The attention share ``[b, n]`` of the attended slots (committed ``cols`` and the new
        tokens) for the last ``observe_queries`` queries, and those slots ``[b, n]``."""
        layer = self.layer
        keys = torch.cat((*k_parts, k_new), 2)
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
            self.evaluate()
            self.steps = 0
            return
        self.steps += 1
        if self.steps % self.s.every == 0:
            self.evaluate()

    def page_scores(self) -> torch.Tensor:
        """Scores ``[n_pages]`` (CPU) of the layer's pages: the scorer's token scores, averaged
        per page, times the compensation, plus the pattern offsets (kv/prune/policy.py)."""
        layer, cache = self.layer, self.layer._cache
        s, p = layer.sinks, cache.page_tokens
        inp = self.stats.input(layer.index, cache.num_layers, s, s + self.n_pages * p,
                               layer.length)
        raw = page_scores(self.s.scorer(inp).float().clamp(0.0, 1.0), p)
        tok_off = cache.prune_offsets_for(layer)
        off = page_offsets(tok_off, p) if tok_off is not None else None
        l1, l2, _ = self.level_pages()
        n_active = layer.sinks + layer.recent_k.shape[2] + (l1 + l2) * p
        return adjust_scores(raw, n_active, off, compensate=self.s.compensate).cpu()

    def l1_cap(self) -> int | None:
        """Level-1 pages the layer may hold: what ``device_tokens`` leaves after the sinks and
        the recent window (``gpu_tokens``), in whole pages; None: unbounded."""
        if self.s.device_tokens is None:
            return None
        cache = self.layer._cache
        left = self.s.device_tokens - cache.sink_tokens - cache.gpu_tokens
        return max(0, left) // cache.page_tokens

    def evaluate(self) -> None:
        if self.n_pages == 0:
            return
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
