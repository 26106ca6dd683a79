"""``TieredLayer``: one decoder layer of a ``TieredCache`` -- transformers' layer contract, the
tokens kept on the device (sinks and the recent window), and the order of a step:

``update`` only records the step's new keys and values (and returns them as a marker); the
registered attention function (kv/attention.py) then calls ``attend`` with the queries, which
chooses the pages (kv/summaries.py), fetches them (kv/pages.py), attends (kv/compute.py) and
finally commits the new tokens (sinks, recent window, full pages written out).
"""
from __future__ import annotations

import weakref

import torch

try:
    from transformers.cache_utils import CacheLayerMixin
except ImportError:  # transformers too old: TieredCache.for_model says so (KVUnsupported)
    CacheLayerMixin = object

from deepseek_flash.errors import KVCacheMismatch, KVError

from . import fused as _fused
from .attention import _ACTIVE
from .compute import attend_columns
from . import graphs
from .graphs import LayerGraphs
from .layout import pack_pages
from .mirror import DenseMirror
from .pagecache import PageCache
from .pages import LayerPages
from .plan import StepPlan, attend_planned, attention_input
from .prune.state import LayerPrune
from .select import resolve_top_k
from .summaries import PageSummaries
from .window import RecentWindow


class TieredLayer(CacheLayerMixin):
    """One decoder layer's tiered KV. Not compileable: it changes shape every step."""

    is_compileable = False
    is_sliding = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, cache, index: int):
        super().__init__()
        self._cache = weakref.proxy(cache)
        self.index = index
        self.dense = index < cache.dense_layers
        self.length = 0
        self.batch = 0
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.sink_k = self.sink_v = None
        self._recent_k = self._recent_v = None
        # a top-K layer whose choice runs as a captured graph keeps its recent window in fixed
        # buffers (kv/window.py; recent_k/v are then views of its first tokens): its graph writes
        # the step's tokens there and assembles the attention's keys and values (kv/graphs.py,
        # AttentionInput) -- no concatenation per step
        self.window: RecentWindow | None = None
        self._joined = None  # (keys, values) of the running step, assembled by the graph
        self._plan: StepPlan | None = None  # the graphed decode step, while it holds
        self._sinks_kv = None  # the sinks' keys and values stacked (graphs read them)
        self.summaries = PageSummaries()
        # pruning with lossless recall (top_k_pages None) never ranks pages: no summaries kept
        self.keeps_summaries = cache.prune is None or cache.top_k_pages is not None
        self.pages = LayerPages(self._cache, index)
        self.graphs = LayerGraphs()  # CUDA: the top-K choice and gather as one graph
        self.mirror: DenseMirror | None = None  # a dense layer's pages on the device as well
        self.page_cache: PageCache | None = None  # top-K: chosen pages kept on the device
        self.prune = LayerPrune(self, cache.prune) if cache.prune is not None else None
        self._fused: _fused.FusedStep | None = None  # kv/fused.py: the Triton decode step
        self._fused_failed = False
        self.fused_builds = 0  # fused steps built (and captured): a new key (kv/fused.py)
        # the last step was fused and nothing it depends on changed since (no page written, no
        # other path taken): the next one replays it with no decision made again
        self._fused_holds = False

    # --- the recent window: its own tensors, or views of a RecentWindow's buffers --------------
    @property
    def recent_k(self):
        return self._recent_k if self.window is None else self.window.parts()[0]

    @recent_k.setter
    def recent_k(self, value):
        self._recent_k = value

    @property
    def recent_v(self):
        return self._recent_v if self.window is None else self.window.parts()[1]

    @recent_v.setter
    def recent_v(self, value):
        self._recent_v = value

    @property
    def recent_tokens(self) -> int:
        return self._recent_k.shape[2] if self.window is None else self.window.length

    @property
    def win_k(self):
        """The window's key buffer (all of its capacity), or None."""
        return self.window.keys if self.window is not None else None

    # --- the page store's state, as the layer's ------------------------------------------------
    @property
    def n_pages(self) -> int:
        return self.prune.n_pages if self.prune is not None else self.pages.n_pages

    @property
    def lost_pages(self) -> set[int]:
        return self.pages.lost_pages

    @property
    def chunks(self):
        return self.pages.chunks

    @property
    def kmin(self):
        return self.summaries.kmin

    @property
    def kmax(self):
        return self.summaries.kmax

    # --- transformers' layer contract ---------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        cache = self._cache
        b, h, t, d = key_states.shape
        cache._check_geometry(self.index, h, d, value_states.shape[-1])
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.batch = b
        cache._fix_layout(b, h, d, key_states.dtype, key_states.device, t)
        if self.dense and cache.prune is None and cache.mirrors_dense():
            self.mirror = DenseMirror(front=cache.sink_tokens)
        empty = key_states.new_empty((b, h, 0, d))
        self.sink_k = self.sink_v = self.recent_k = self.recent_v = empty
        self.summaries.init(key_states)
        self.pages.bind(b, key_states.dtype, key_states.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self.batch:
            raise KVCacheMismatch(f"layer {self.index}: batch {key_states.shape[0]} given to a "
                                  f"TieredCache holding batch {self.batch}")
        self.pending = (key_states, value_states)
        _ACTIVE[id(key_states)] = self
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # the same, under its name before transformers 5
        return -1

    def reset(self) -> None:
        raise KVError("a TieredCache cannot be reset in place; make a new one with "
                      "TieredCache.for_model")

    def crop(self, tokens_to_remove: int) -> None:
        raise KVError("a TieredCache cannot be cropped (pages already written are immutable)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise KVError("a TieredCache does not support beam search")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise KVError("a TieredCache does not support batch expansion (num_return_sequences)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise KVError("a TieredCache does not support batch selection")

    def offload(self):
        pass

    def prefetch(self):
        pass

    # --- geometry ------------------------------------------------------------------------------
    @property
    def sinks(self) -> int:
        return self.sink_k.shape[2]

    @property
    def paged_tokens(self) -> int:
        return self.n_pages * self._cache.page_tokens

    def gpu_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        tensors = (self.sink_k, self.sink_v) + ((self._recent_k, self._recent_v)
                                                if self.window is None else ())
        total = sum(t.numel() * t.element_size() for t in tensors) + self.summaries.gpu_bytes()
        if self.window is not None:
            total += self.window.nbytes()  # all of its capacity
        if self.mirror is not None:
            total += self.mirror.nbytes()
        if self.page_cache is not None:
            total += self.page_cache.nbytes()
        return total + (self.prune.gpu_bytes() if self.prune is not None else 0)

    def host_bytes(self) -> int:
        return self.pages.host_bytes() + (self.prune.host_bytes() if self.prune is not None else 0)

    def level_tokens(self) -> list[int]:
        """Tokens (per sequence) at levels 1 (on the device: sinks, recent window, level-1 pages),
        2 (full precision on the host or spilled) and 3 (int4 on the host or spilled)."""
        if not self.is_initialized:
            return [0, 0, 0]
        p = self._cache.page_tokens
        on_device = self.sinks + self.recent_tokens
        if self.prune is None:
            return [on_device, self.paged_tokens, 0]
        l1, l2, l3 = self.prune.level_pages()
        return [on_device + l1 * p, l2 * p, l3 * p]

    def spilled_bytes(self) -> int:
        return self.pages.spilled_bytes() + (self.prune.spilled_bytes() if self.prune else 0)

    def reads_every_page(self) -> bool:
        """Whether this layer's next decode step attends to every page (lossless or dense)."""
        cache = self._cache
        if self.prune is not None:
            return False  # the pruned levels are fetched by kv/prune/state.py, not prefetched
        return self.dense or resolve_top_k(cache.top_k_pages, self.n_pages) is None

    def copies_every_page(self) -> bool:
        """Whether this layer's next decode step copies every page to the device (reads every
        page and keeps no mirror of them there): what is worth copying ahead."""
        return self.mirror is None and self.reads_every_page()

    # --- a step --------------------------------------------------------------------------------
    def attend(self, module, query: torch.Tensor, pad_mask: torch.Tensor | None,
               scaling: float) -> torch.Tensor:
        """Attention of ``query`` ``[b, q_heads, q_len, d]`` over sinks + pages (all, or the
        top-K) + recent tokens + this step's tokens; commits the step. -> ``[b, q_len, q_heads, d]``."""
        step = self._fused
        if (self._fused_holds and pad_mask is None and query.shape == step.shape
                and query.dtype == step.dtype and scaling == step.scaling
                and step.settings == self._cache._fused_settings()):
            # the last step was fused and nothing it depends on changed (``_fused_holds``: then
            # this layer is a top-K one, no pruning, the fused step never failed; the settings
            # and the query's shape are what it was built for): replayed, nothing decided again
            k_new, v_new = self.pending
            return self._attend_fused_again(step, query, k_new, v_new)
        cache = self._cache
        k_new, v_new = self.pending
        q_len = query.shape[2]
        if (cache.fused and cache.top_k_pages is not None and pad_mask is None and q_len == 1
                and self.prune is None and not self.dense and not self._fused_failed):
            out = self._attend_fused(query, k_new, v_new, scaling)
            if out is not None:
                return out
        self._fused_holds = False
        plan = self._plan
        if plan is not None and pad_mask is None:
            if plan.holds(self, cache, query):
                out = attend_planned(self, plan, query, k_new, v_new, scaling)
                if out is not None:
                    return out
            self._plan = None
        try:
            if self.prune is not None:
                recall_all = self.dense or q_len > cache.select_max_queries
                k_parts, v_parts, cols = self.prune.past(query, recall_all)
            else:
                k_parts, v_parts, cols = self._past(query, q_len, pad_mask is not None)
            keys = [] if self.prune is not None else None
            joined, self._joined = self._joined, None
            out = attend_columns(query, k_parts, v_parts, cols, k_new, v_new, pad_mask, scaling,
                                 length=self.length, prefill_chunk=cache.prefill_chunk,
                                 keys_out=keys, joined=joined)
            if self.prune is not None:
                shares = self.prune.shares(query, keys[0], cols, pad_mask, scaling, q_len)
        except BaseException:
            self.pending = None
            self._joined = None
            cache._poison(f"layer {self.index} failed during attention")
            raise
        self.pending = None
        self._commit(k_new, v_new)
        if self.prune is not None:
            self.prune.committed(k_new, v_new, *shares, q_len)
        return out

    def _attend_fused(self, query, k_new, v_new, scaling):
        """A top-K decode step through kv/fused.py's kernels (one CUDA graph of five kernels):
        the output ``[b, 1, q_heads, d]``, or None where the fused step does not serve (the torch
        path then runs)."""
        cache = self._cache
        n = self.n_pages
        if not n or self.lost_pages or not cache.page_cache or not _fused.available(self.device):
            return None
        k = resolve_top_k(cache.top_k_pages, n)
        if k is None or _fused.applies(self, cache, k) is not None:
            return None
        pc = self.page_cache
        if (pc is not None and pc.refused) or self.pages.span() is None:
            return None
        cap = cache.gpu_tokens + cache.page_tokens + cache.select_max_queries
        if self.sinks < cache.sink_tokens or self.recent_tokens + 1 > cap:
            return None
        try:
            self._before_step()
            if pc is None:
                pc = self.page_cache = PageCache(cache.page_cache)
            pc.ensure(self, k)
            span = None if pc.refused else pc.span(self)
            if span is None:
                return None
            if self.window is None or self.window.capacity != cap:
                self.window = RecentWindow(self.recent_k, self.recent_v, cap)
                self._recent_k = self._recent_v = None
            if self._sinks_kv is None or self._sinks_kv.shape[3] != self.sinks:
                self._sinks_kv = torch.stack((self.sink_k, self.sink_v))  # final: made once
            window = self.window
            # the page count is not in the key: the kernels read it from the device
            # (FusedStep.set_pages), one graph serves while pages are added within its room
            key = (_fused.pages_room(n), k, id(span), self.summaries.minmax.data_ptr(),
                   pc.key(), window.kv.data_ptr(), window.pos.data_ptr(),
                   self._sinks_kv.data_ptr(), tuple(query.shape), query.dtype, scaling,
                   cache.scale, cache.window_pages)
            self._plan = None
            window.sync_pos()
            step = self._fused
            if step is None or step.key != key:
                self._fused = None
                try:
                    self.fused_builds += 1
                    step = _fused.FusedStep(key, self, span, pc, window, self._sinks_kv, query,
                                            k, scaling)
                    step.load(query, k_new, v_new)
                    if graphs.applies(self.device) and cache.select_graphs:
                        step.capture(cache._graph_pool())
                    else:
                        step.run()
                except Exception as exc:  # refused by Triton, torch or the driver: torch path
                    self._fused_failed = True
                    window.pos_value = None
                    pc.refuse()  # its tables may be part-updated: no slots read from now on
                    graphs.log.warning("layer %d: the fused top-K step failed (%s); the torch "
                                       "path serves from now on", self.index, exc)
                    return None
                self._fused = step
            else:
                step.set_pages(n)
                step.go(query, k_new, v_new, cache._graph_pool)
            window.ahead = 1
            window.pos_value = window.length + 1
            out = step.out
        except BaseException:
            self.pending = None
            cache._poison(f"layer {self.index} failed during attention")
            raise
        self.pending = None
        self._fused_holds = self._fused is step and step.settings == cache._fused_settings()
        self._commit(k_new, v_new)  # a page written out ends the hold
        return out

    def _before_step(self) -> None:
        """A graphed decode step's host work before its kernels (pinned host pages only): pages
        written but not yet readable made readable, this layer's prefetched pages dropped, the next
        layer's prefetch issued."""
        cache = self._cache
        if cache.pinned:
            if self.pages._unread_writes:
                self.pages.before_read()
            if cache._prefetched:
                if self.index in cache._prefetched:
                    cache._drop_prefetched(self)
                cache._prefetch_next(self)
            elif cache._copies_any:  # (else no layer copies every page: nothing to prefetch)
                cache._prefetch_next(self)

    def _attend_fused_again(self, step, query, k_new, v_new):
        """``_attend_fused`` of a step that repeats the last one: the graph replayed (or its
        kernels launched), the commit."""
        cache = self._cache
        window = self.window
        try:
            self._before_step()
            window.sync_pos()
            step.go(query, k_new, v_new, cache._graph_pool)
            window.ahead = 1
            window.pos_value = window.length + 1
        except BaseException:
            self.pending = None
            self._fused_holds = False
            cache._poison(f"layer {self.index} failed during attention")
            raise
        self.pending = None
        self._commit(k_new, v_new)
        return step.out

    def _past(self, query, q_len, need_cols=True):
        """Keys and values of the committed tokens to attend (lists of parts in slot order) and
        which slots they are: None (every slot 0..length), a bool mask over the slots (pages
        lost in graceful mode), or slot indices ``[b, n]`` (top-K; only when ``need_cols``: the
        slots matter to the padding mask alone, causality is over the new tokens)."""
        cache = self._cache
        if cache.pinned:
            self.pages.before_read()  # the host pages written last are there
        if self.page_cache is not None and (cache.top_k_pages is None or not cache.page_cache):
            cache._release_page_cache(self)  # lossless, or the page cache off: slots not read
        k = resolve_top_k(cache.top_k_pages, self.n_pages) if self.n_pages else None
        if k is None or self.dense or q_len > cache.select_max_queries:
            if self.n_pages == 0:
                return [self.sink_k, self.recent_k], [self.sink_v, self.recent_v], None
            if (self.mirror is not None and self.mirror.tokens == self.paged_tokens
                    and not self.lost_pages):
                pk, pv = self.mirror.parts()  # on the device already: nothing copied
                if q_len <= cache.select_max_queries and self.pending is not None:
                    # sinks, pages, recent and new tokens read as one prefix of the mirror's
                    # buffer: no concatenation of every page each step (kv/mirror.py)
                    self._joined = self.mirror.joined(self.sink_k, self.sink_v, self.recent_k,
                                                      self.recent_v, *self.pending)
            else:
                pk, pv = cache._take_prefetched(self) or self.pages.fetch_all()
            if q_len <= cache.select_max_queries:
                cache._prefetch_next(self)
            cols = self._cols_without_lost() if self.lost_pages else None
            return [self.sink_k, pk, self.recent_k], [self.sink_v, pv, self.recent_v], cols
        if cache.pinned:  # CUDA: the dense layers' pages of the next step copied meanwhile
            if self.index in cache._prefetched:
                cache._drop_prefetched(self)
            cache._prefetch_next(self)
        got = None
        pc, span = None, None
        if (cache.page_cache and not (self.page_cache is not None and self.page_cache.refused)
                and self.pages.span() is not None):
            # the chosen pages kept on the device (kv/pagecache.py); only where the host pages
            # have one view (not with a spilled chunk, nor the controller's arena on a GPU)
            if self.page_cache is None:
                self.page_cache = PageCache(cache.page_cache)
            self.page_cache.ensure(self, k)
            span = None if self.page_cache.refused else self.page_cache.span(self)
            pc = self.page_cache if span is not None else None
        elif (cache.page_cache and self.page_cache is not None
              and not self.page_cache.refused):
            self.page_cache.refuse()  # a chunk was spilled: no single view any more
        attention = None
        if (cache.select_graphs and graphs.applies(self.device) and cache.score == "hybrid"
                and not self.lost_pages):
            span = span if pc is not None else self.pages.span()
            if span is not None:
                attention = attention_input(self, query, k)
                got = self.graphs.select(cache, self, span, query, k, pc, attention)
        if got is not None:
            chosen, pk, pv = got
            if attention is not None:  # the graph assembled sinks, pages, window and new tokens
                n = attention.sinks + k * cache.page_tokens + self.window.length + q_len
                self._joined = (attention.keys.narrow(2, 0, n), attention.values.narrow(2, 0, n))
                if not need_cols and q_len == 1:  # the next steps repeat this one's path
                    self._plan = StepPlan(self, cache, query, attention, k, pc)
            if pc is None:  # with the page cache its misses are the pages fetched (stats)
                cache.counters["pages_fetched"] += self.batch * k
        else:
            chosen = self.summaries.choose(query, k, scale=cache.scale, score=cache.score,
                                           window_pages=cache.window_pages, lost=self.lost_pages)
            if pc is not None:
                pk, pv = pc.gather(span, chosen)
            else:
                pk, pv = self.pages.fetch_selected(chosen)
        joined = self._joined is not None  # the parts are not read: no views made
        if not need_cols:
            if joined:
                return None, None, None
            return [self.sink_k, pk, self.recent_k], [self.sink_v, pv, self.recent_v], None
        p, s, b = cache.page_tokens, self.sinks, self.batch
        dev = chosen.device
        page_cols = (s + chosen[:, :, None] * p + torch.arange(p, device=dev)).reshape(b, -1)
        recent_cols = torch.arange(s + self.paged_tokens, self.length, device=dev).expand(b, -1)
        cols = torch.cat((torch.arange(s, device=dev).expand(b, s), page_cols, recent_cols), 1)
        if joined:
            return None, None, cols
        return [self.sink_k, pk, self.recent_k], [self.sink_v, pv, self.recent_v], cols

    def _cols_without_lost(self):
        """Bool mask over the committed slots: False on the tokens of lost pages."""
        keep = torch.ones(self.length, dtype=torch.bool, device=self.device)
        p, s = self._cache.page_tokens, self.sinks
        for page in self.lost_pages:
            keep[s + page * p: s + (page + 1) * p] = False
        return keep

    # --- commit: sinks, recent window, pages -----------------------------------------------------
    def _commit(self, k_new, v_new):
        cache = self._cache
        t = k_new.shape[2]
        window = self.window
        ahead = 0
        if window is not None:
            ahead, window.ahead = window.ahead, 0
        take = min(cache.sink_tokens - self.sinks, t)
        if take > 0:
            self.sink_k = torch.cat((self.sink_k, k_new[:, :, :take]), 2)
            self.sink_v = torch.cat((self.sink_v, v_new[:, :, :take]), 2)
            k_new, v_new = k_new[:, :, take:], v_new[:, :, take:]
        p = cache.page_tokens
        if window is not None:
            if ahead or window.length + t - take <= window.capacity:
                self._commit_window(k_new, v_new, ahead)
                return
            self._plan = None
            # more tokens than the window holds (a prompt chunk): plain tensors again
            self._recent_k, self._recent_v = (x.clone() for x in window.parts())
            self.window = None
        recent_k = torch.cat((self._recent_k, k_new), 2)
        recent_v = torch.cat((self._recent_v, v_new), 2)
        self.length += t
        n = max(0, recent_k.shape[2] - cache.gpu_tokens) // p
        if n and cache.gpu_tokens + p <= recent_k.shape[2]:
            self._write_pages(recent_k[:, :, :n * p], recent_v[:, :, :n * p])
            recent_k = recent_k[:, :, n * p:].clone()
            recent_v = recent_v[:, :, n * p:].clone()
        self._recent_k, self._recent_v = recent_k, recent_v

    def _commit_window(self, k_new, v_new, ahead):
        """``_commit`` with the recent window in its fixed buffers (kv/window.py): the tokens
        written in place (unless the graph wrote them), full pages out, the rest to the front."""
        cache = self._cache
        window = self.window
        p = cache.page_tokens
        t = k_new.shape[2]
        if not ahead:
            window.write(k_new, v_new)
        self.length += t
        window.length += t
        r = window.length
        n = max(0, r - cache.gpu_tokens) // p
        if n and cache.gpu_tokens + p <= r:
            self._plan = None  # pages, k and the graph change
            self._write_pages(window.keys[:, :, :n * p], window.values[:, :, :n * p])
            window.drop_front(n * p)

    def _write_pages(self, keys, values):
        """Full pages leave the recent window: summaries on the device (when top-K reads them), BICL
        pages to the host (or, pruning, to level 1)."""
        cache = self._cache
        self._fused_holds = False  # pages, k, the host view and the summaries change
        p = cache.page_tokens
        if self.keeps_summaries:
            self.summaries.append_keys(keys, p)
        if self.mirror is not None:
            self.mirror.append(keys, values)
        if self.prune is not None:
            self.prune.append(pack_pages(keys, values, p))  # level 1: stays on the device
            return
        self.pages.append(pack_pages(keys, values, p))
        cache._pages_written(self)

