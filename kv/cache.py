"""``TieredCache``: a transformers ``Cache`` whose layers keep sink tokens and the most recent
tokens on the model's device, older tokens in BICL pages on the host (page-locked when CUDA is
present), and, past ``host_bytes``, in spill files; with per-page key summaries on the device for
query-aware top-K selection.

How it meets the model: ``TieredLayer.update`` only records the step's new keys and values (and
returns them as a marker); the registered attention function (kv/attention.py) then calls
``TieredLayer.attend`` with the queries, which scores pages, fetches what it needs, attends and
finally commits the new tokens (sinks, recent window, pages written out as they fill).
"""
from __future__ import annotations

import bisect
import logging
import weakref
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from deepseek_flash.errors import KVCacheMismatch, KVError, KVPageCorrupt, KVSpillFailed

from .attention import _ACTIVE
from .layout import PAGE_TOKENS_CHOICES, PageLayout, auto_page_tokens, pack_pages, unpack_pages
from .select import SCORES, group_queries, page_scores, quest_bound, resolve_top_k, select_pages
from .spill import SpilledChunk, SpillStore

log = logging.getLogger(__name__)

CHUNK_BYTES = 16 << 20
"""Host pages are allocated (and spilled) in chunks of up to this many bytes per layer; a layer's
first chunk holds 4 pages and each next one twice as many, so a short context allocates little."""
FIRST_CHUNK_PAGES = 4


@dataclass
class _Chunk:
    """``capacity`` pages of one layer for every sequence: ``tensor[i * batch + b]`` is page
    ``first + i`` of sequence ``b``. On the host (``tensor``) or on disk (``spilled``)."""

    first: int
    capacity: int
    tensor: torch.Tensor | None
    spilled: SpilledChunk | None = None
    filled: int = 0


class TieredLayer(CacheLayerMixin):
    """One decoder layer's tiered KV. Not compileable: it changes shape every step."""

    is_compileable = False
    is_sliding = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, cache: "TieredCache", index: int):
        super().__init__()
        self._cache = weakref.proxy(cache)
        self.index = index
        self.dense = index < cache.dense_layers
        self.length = 0
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.sink_k = self.sink_v = None
        self.recent_k = self.recent_v = None
        self.n_pages = 0
        self.kmin = self.kmax = None  # [b, h, capacity, d] on the device
        self.chunks: list[_Chunk] = []
        self._firsts: list[int] = []
        self.lost_pages: set[int] = set()

    # --- transformers' layer contract ---------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        cache = self._cache
        b, h, t, d = key_states.shape
        cache._check_geometry(self.index, h, d, value_states.shape[-1])
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.batch = b
        cache._fix_layout(b, h, d, key_states.dtype, key_states.device, t)
        empty = key_states.new_empty((b, h, 0, d))
        self.sink_k = self.sink_v = self.recent_k = self.recent_v = empty
        self.kmin = key_states.new_empty((b, h, 0, d))
        self.kmax = key_states.new_empty((b, h, 0, d))
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
        tensors = (self.sink_k, self.sink_v, self.recent_k, self.recent_v, self.kmin, self.kmax)
        total = sum(t.numel() * t.element_size() for t in tensors)
        # the summaries are preallocated by doubling; count only what holds pages
        cap = self.kmin.shape[2]
        if cap:
            total -= 2 * (cap - self.n_pages) * self.kmin[:, :, :1].numel() * self.kmin.element_size()
        return total

    def host_bytes(self) -> int:
        return sum(c.tensor.numel() * c.tensor.element_size() for c in self.chunks
                   if c.tensor is not None)

    def spilled_bytes(self) -> int:
        return sum(c.spilled.file_bytes for c in self.chunks if c.spilled is not None)

    # --- attention -----------------------------------------------------------------------------
    def attend(self, module, query: torch.Tensor, pad_mask: torch.Tensor | None,
               scaling: float) -> torch.Tensor:
        """Attention of ``query`` ``[b, q_heads, q_len, d]`` over sinks + pages (all, or the
        top-K) + recent tokens + this step's tokens; commits the step. -> ``[b, q_len, q_heads, d]``."""
        cache = self._cache
        k_new, v_new = self.pending
        q_len = query.shape[2]
        try:
            k_parts, v_parts, cols = self._past(query, q_len)
            out = self._attention(query, k_parts, v_parts, cols, k_new, v_new, pad_mask, scaling)
        except BaseException:
            self.pending = None
            cache._poison(f"layer {self.index} failed during attention")
            raise
        self.pending = None
        self._commit(k_new, v_new)
        return out

    def _past(self, query, q_len):
        """Keys and values of the committed tokens to attend (lists of parts in slot order) and
        which slots they are: None (every slot 0..length), a bool mask over the slots (pages
        lost in graceful mode), or slot indices ``[b, n]`` (top-K)."""
        cache = self._cache
        k = resolve_top_k(cache.top_k_pages, self.n_pages) if self.n_pages else None
        if k is None or self.dense or q_len > cache.select_max_queries:
            if self.n_pages == 0:
                return [self.sink_k, self.recent_k], [self.sink_v, self.recent_v], None
            pk, pv = cache._take_prefetched(self) or self._fetch_all()
            if q_len <= cache.select_max_queries:
                cache._prefetch_next(self)
            cols = self._cols_without_lost() if self.lost_pages else None
            return [self.sink_k, pk, self.recent_k], [self.sink_v, pv, self.recent_v], cols
        bound = quest_bound(group_queries(query, self.kmin.shape[1]),
                            self.kmin[:, :, :self.n_pages], self.kmax[:, :, :self.n_pages],
                            cache.scale)
        scores = page_scores(bound, cache.score, cache.window_pages)
        if self.lost_pages:
            lost = torch.tensor(sorted(self.lost_pages), device=scores.device)
            scores[:, lost] = float("-inf")
        chosen = select_pages(scores, k)  # [b, k]
        pk, pv = self._fetch_selected(chosen)
        p, s, b = cache.page_tokens, self.sinks, self.batch
        dev = chosen.device
        page_cols = (s + chosen[:, :, None] * p + torch.arange(p, device=dev)).reshape(b, -1)
        recent_cols = torch.arange(s + self.paged_tokens, self.length, device=dev).expand(b, -1)
        cols = torch.cat((torch.arange(s, device=dev).expand(b, s), page_cols, recent_cols), 1)
        return [self.sink_k, pk, self.recent_k], [self.sink_v, pv, self.recent_v], cols

    def _cols_without_lost(self):
        """Bool mask over the committed slots: False on the tokens of lost pages."""
        keep = torch.ones(self.length, dtype=torch.bool, device=self.device)
        p, s = self._cache.page_tokens, self.sinks
        for page in self.lost_pages:
            keep[s + page * p: s + (page + 1) * p] = False
        return keep

    def _attention(self, query, k_parts, v_parts, cols, k_new, v_new, pad_mask, scaling):
        cache = self._cache
        b, hq, q_len, d = query.shape
        keys = torch.cat((*k_parts, k_new), 2)
        values = torch.cat((*v_parts, v_new), 2)
        n_past = keys.shape[2] - q_len
        keep = cols if isinstance(cols, torch.Tensor) and cols.dtype == torch.bool else None
        if keep is not None:
            full = torch.cat((keep, keep.new_ones(q_len)))
            keys, values = keys[:, :, full], values[:, :, full]
            n_past = int(keep.sum())
        # key validity per sequence: padding (2D mask over slots) gathered to the attended columns
        valid = None
        if pad_mask is not None:
            past_mask = pad_mask[:, :self.length]
            if keep is not None:
                past_mask = past_mask[:, keep]
            elif cols is not None:
                past_mask = torch.gather(past_mask, 1, cols)
            valid = torch.cat((past_mask, pad_mask[:, self.length:self.length + q_len]), 1)
        if n_past == 0 and valid is None:
            # a first prompt without padding: plain causal attention, no mask, one call
            out = _sdpa(query, keys, values, None, q_len > 1, scaling)
            return out.transpose(1, 2).contiguous()
        outs = []
        step = q_len if q_len <= cache.prefill_chunk else cache.prefill_chunk
        for a in range(0, q_len, step):
            e = min(q_len, a + step)
            kv_len = n_past + e
            mask = None
            if e - a > 1 or valid is not None:
                causal = (torch.arange(kv_len, device=query.device)[None, :]
                          <= (n_past + torch.arange(a, e, device=query.device))[:, None])
                mask = causal[None, None]
                if valid is not None:
                    mask = mask & valid[:, None, None, :kv_len]
            outs.append(_sdpa(query[:, :, a:e], keys[:, :, :kv_len], values[:, :, :kv_len], mask,
                              False, scaling))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, 2)
        return out.transpose(1, 2).contiguous()

    # --- commit: sinks, recent window, pages -----------------------------------------------------
    def _commit(self, k_new, v_new):
        cache = self._cache
        t = k_new.shape[2]
        take = min(cache.sink_tokens - self.sinks, t)
        if take > 0:
            self.sink_k = torch.cat((self.sink_k, k_new[:, :, :take]), 2)
            self.sink_v = torch.cat((self.sink_v, v_new[:, :, :take]), 2)
            k_new, v_new = k_new[:, :, take:], v_new[:, :, take:]
        recent_k = torch.cat((self.recent_k, k_new), 2)
        recent_v = torch.cat((self.recent_v, v_new), 2)
        self.length += t
        p = cache.page_tokens
        n = max(0, recent_k.shape[2] - cache.gpu_tokens) // p
        if n and cache.gpu_tokens + p <= recent_k.shape[2]:
            self._write_pages(recent_k[:, :, :n * p], recent_v[:, :, :n * p], n)
            recent_k = recent_k[:, :, n * p:].clone()
            recent_v = recent_v[:, :, n * p:].clone()
        self.recent_k, self.recent_v = recent_k, recent_v

    def _write_pages(self, keys, values, n):
        cache = self._cache
        b, h, _, d = keys.shape
        p = cache.page_tokens
        blocks = keys.view(b, h, n, p, d)
        self._append_summaries(blocks.amin(3), blocks.amax(3))
        pages = pack_pages(keys, values, p)  # [n, b, 2, h, p, d]
        done = 0
        while done < n:
            chunk = self._open_chunk()
            room = chunk.capacity - chunk.filled
            m = min(room, n - done)
            dst = chunk.tensor[chunk.filled * b:(chunk.filled + m) * b]
            dst.copy_(pages[done:done + m].reshape(m * b, *pages.shape[2:]),
                      non_blocking=cache.pinned)
            chunk.filled += m
            done += m
        self.n_pages += n
        cache._pages_written(self)

    def _append_summaries(self, kmin, kmax):
        need = self.n_pages + kmin.shape[2]
        cap = self.kmin.shape[2]
        if need > cap:
            new_cap = max(need, 2 * cap, 16)
            b, h, _, d = kmin.shape
            grown_min = kmin.new_empty((b, h, new_cap, d))
            grown_max = kmin.new_empty((b, h, new_cap, d))
            grown_min[:, :, :self.n_pages] = self.kmin[:, :, :self.n_pages]
            grown_max[:, :, :self.n_pages] = self.kmax[:, :, :self.n_pages]
            self.kmin, self.kmax = grown_min, grown_max
        self.kmin[:, :, self.n_pages:need] = kmin
        self.kmax[:, :, self.n_pages:need] = kmax

    def _open_chunk(self) -> _Chunk:
        cache = self._cache
        if self.chunks and self.chunks[-1].filled < self.chunks[-1].capacity:
            return self.chunks[-1]
        last = self.chunks[-1] if self.chunks else None
        first = last.first + last.capacity if last else 0
        capacity = cache.next_chunk_pages(last.capacity if last else 0)
        shape = (capacity * self.batch, *cache.layout.shape)
        tensor = torch.empty(shape, dtype=self.dtype, pin_memory=cache.pinned)
        chunk = _Chunk(first, capacity, tensor)
        self.chunks.append(chunk)
        self._firsts.append(first)
        return chunk

    def _chunk_of(self, page: int) -> _Chunk:
        return self.chunks[bisect.bisect_right(self._firsts, page) - 1]

    # --- fetch -----------------------------------------------------------------------------------
    def _chunk_pages(self, chunk: _Chunk) -> torch.Tensor:
        """The host tensor of a chunk's filled pages; a spilled chunk is read back into a
        staging buffer (every page crc-checked)."""
        b = self.batch
        if chunk.tensor is not None:
            return chunk.tensor[:chunk.filled * b]
        staging = self._cache._staging(chunk.filled * b)
        for j in range(chunk.filled * b):
            if chunk.first + j // b in self.lost_pages:
                staging[j].zero_()  # left out of attention; not read again
            else:
                self._read_spilled(chunk, j, staging[j])
        return staging

    def _read_spilled(self, chunk: _Chunk, j: int, dest: torch.Tensor) -> bool:
        cache = self._cache
        b = self.batch
        page, row = chunk.first + j // b, j % b
        try:
            cache.spill.read_page(chunk.spilled, j, dest, layer=self.index, page=page, row=row)
        except KVPageCorrupt as exc:
            if cache.error_recovery_mode == "strict":
                raise
            log.warning("%s; graceful mode: the page is left out of attention from now on", exc)
            self.lost_pages.add(page)
            cache.counters["pages_lost"] += 1
            dest.zero_()
            return False
        cache.counters["pages_read_spilled"] += 1
        return True

    def reads_every_page(self) -> bool:
        """Whether this layer's next decode step attends to every page (lossless or dense)."""
        cache = self._cache
        return self.dense or resolve_top_k(cache.top_k_pages, self.n_pages) is None

    def _fetch_all(self):
        cache = self._cache
        parts = [self._chunk_pages(c).to(self.device, non_blocking=cache.pinned)
                 for c in self.chunks]
        pages = parts[0] if len(parts) == 1 else torch.cat(parts)
        pages = pages.view(self.n_pages, self.batch, *cache.layout.shape)
        cache.counters["pages_fetched"] += self.n_pages * self.batch
        return unpack_pages(pages)

    def _fetch_selected(self, chosen: torch.Tensor):
        """Pages ``chosen`` ``[b, k]`` -> keys, values ``[b, h, k * page_tokens, d]``.

        On a GPU each run of consecutive host pages is one host->device copy straight into the
        step's buffer (a page is contiguous: BICL); on the CPU one gather per chunk. Spilled
        pages are read into a host buffer first."""
        cache = self._cache
        b, k = chosen.shape
        idx = chosen.cpu().tolist()  # the only host sync of a top-K step
        shape = cache.layout.shape
        if self.device.type == "cpu":
            out = torch.empty((k * b, *shape), dtype=self.dtype)
        else:
            out = torch.empty((k * b, *shape), dtype=self.dtype, device=self.device)
        for row in range(b):
            j = 0
            while j < k:
                page = idx[row][j]
                chunk = self._chunk_of(page)
                # the run of selected pages that are consecutive and in the same chunk
                e = j + 1
                limit = chunk.first + chunk.filled
                while e < k and idx[row][e] == idx[row][e - 1] + 1 and idx[row][e] < limit:
                    e += 1
                local = page - chunk.first
                if chunk.tensor is None:
                    src = cache._staging(e - j)
                    for n in range(e - j):
                        self._read_spilled(chunk, (local + n) * b + row, src[n])
                elif b == 1:
                    src = chunk.tensor[local:local + e - j]
                else:
                    src = chunk.tensor[local * b + row:(local + e - j) * b:b]
                dst = out[j * b + row:e * b:b] if b > 1 else out[j:e]
                dst.copy_(src, non_blocking=cache.pinned)
                j = e
        cache.counters["pages_fetched"] += b * k
        return unpack_pages(out.view(k, b, *shape))


def _sdpa(query, keys, values, mask, is_causal, scale):
    """``scaled_dot_product_attention`` over GQA keys. With a mask on CUDA the kv heads are
    repeated first: the fused kernels that take a mask do not all take GQA, and the fallback
    would materialise every score."""
    groups = query.shape[1] // keys.shape[1]
    if groups > 1 and mask is not None and query.device.type == "cuda":
        keys = keys.repeat_interleave(groups, dim=1)
        values = values.repeat_interleave(groups, dim=1)
        groups = 1
    return torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, is_causal=is_causal, scale=scale,
        enable_gqa=groups > 1)


class TieredCache(Cache):
    """The tiered KV cache of one generation. Build it with ``TieredCache.for_model``."""

    def __init__(self, num_layers: int, *, kv_heads: int, head_dim: int, gpu_tokens: int = 512,
                 sink_tokens: int = 4, page_tokens: int | str = "auto",
                 top_k_pages: int | float | None = None, host_bytes: int | None = None,
                 spill_dir=None, dense_layers: int = 2, score: str = "quest",
                 window_pages: int = 64, select_max_queries: int = 16,
                 prefill_chunk: int = 4096, error_recovery_mode: str = "strict",
                 chunk_pages: int | None = None):
        _validate(gpu_tokens=gpu_tokens, sink_tokens=sink_tokens, page_tokens=page_tokens,
                  top_k_pages=top_k_pages, host_bytes=host_bytes, spill_dir=spill_dir,
                  dense_layers=dense_layers, score=score, window_pages=window_pages,
                  error_recovery_mode=error_recovery_mode, prefill_chunk=prefill_chunk)
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
        self.counters = {"pages_fetched": 0, "pages_read_spilled": 0, "pages_lost": 0,
                         "spill_errors": 0, "chunks_spilled": 0}
        self._modules = weakref.WeakSet()
        self._model_name = ""
        self._poisoned: str | None = None
        self._spill_error: KVSpillFailed | None = None
        self._copy_stream = None
        self._prefetched: dict[int, tuple] = {}
        super().__init__(layers=[TieredLayer(self, i) for i in range(num_layers)])

    # --- construction ------------------------------------------------------------------------
    @classmethod
    def for_model(cls, model, gpu_tokens: int = 512, sink_tokens: int = 4,
                  page_tokens: int | str = "auto", top_k_pages: int | float | None = None,
                  host_bytes: int | None = None, spill_dir=None, **options) -> "TieredCache":
        """Install the tiered attention function on ``model`` and return a new cache for one
        generation: ``model.generate(ids, cache=cache)``. Options: ``dense_layers``
        (2), ``score`` ("quest" | "windowed"), ``window_pages`` (64), ``error_recovery_mode``
        ("strict" | "graceful"), ``prefill_chunk`` (4096 queries).

        A model from ``load_model`` brings its ``kv_*`` keys (``flash.json``, the model's
        ``flash_config``, the open's ``flash_context``): they replace the defaults of the
        arguments left at their default values; an argument given another value wins."""
        from .attention import install

        given = dict(gpu_tokens=gpu_tokens, sink_tokens=sink_tokens, page_tokens=page_tokens,
                     top_k_pages=top_k_pages, host_bytes=host_bytes, spill_dir=spill_dir)
        args = {**flash_kv_settings(model), **_explicit(given)}
        for key, value in given.items():
            args.setdefault(key, value)
        cfg = install(model)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        cache = cls(cfg.num_hidden_layers, kv_heads=kv_heads, head_dim=head_dim, **args, **options)
        cache.bind(model)
        return cache

    def bind(self, model) -> None:
        """Accept attention calls from ``model``'s attention layers only."""
        for module in model.modules():
            if hasattr(module, "layer_idx") and hasattr(module, "num_key_value_groups"):
                self._modules.add(module)
        self._model_name = type(model).__name__

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

    def _prefetch_next(self, layer: TieredLayer) -> None:
        """CUDA: start copying every page of the next layer (cyclically: after the last layer,
        the first layer of the next step, whose pages are final by then) on a copy stream, so
        the copies of a lossless step overlap the previous layer's compute."""
        if not self.pinned:
            return
        nxt = self.layers[(layer.index + 1) % len(self.layers)]
        if (nxt.index in self._prefetched or nxt.n_pages == 0 or not nxt.reads_every_page()
                or any(c.tensor is None for c in nxt.chunks)):
            return
        current = torch.cuda.current_stream(self.device)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        self._copy_stream.wait_stream(current)  # the pages' device->host copies came first
        with torch.cuda.stream(self._copy_stream):
            k, v = nxt._fetch_all()
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

    def _spill_oldest(self) -> None:
        """Write the oldest full host chunks (across layers) to disk until the host tier fits.
        A failure keeps the chunk on the host and is reported at the start of the next step."""
        if self.spill is None:
            return
        if self.pinned:
            torch.cuda.current_stream(self.device).synchronize()  # device->host page copies
        while self.host_bytes() > self.host_bytes_limit:
            candidates = [(c.first, layer.index, layer, c) for layer in self.layers
                          for c in layer.chunks
                          if c.tensor is not None and c.filled == c.capacity]
            if not candidates:
                return
            _, _, layer, chunk = min(candidates, key=lambda x: (x[0], x[1]))
            try:
                spilled = self.spill.write_chunk(f"L{layer.index:03d}-P{chunk.first:08d}",
                                                 chunk.tensor)
            except KVSpillFailed as exc:
                self.counters["spill_errors"] += 1
                log.warning("%s; the pages stay on the host tier", exc)
                if self._spill_error is None:
                    self._spill_error = exc
                return
            chunk.spilled, chunk.tensor = spilled, None
            self.counters["chunks_spilled"] += 1

    # --- Cache API ---------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].length if layer_idx < len(self.layers) else 0

    def stats(self) -> dict:
        layers = self.layers
        tokens = layers[0].length if layers else 0
        batch = layers[0].batch if layers and layers[0].is_initialized else 0
        token_bytes = self.layout.token_bytes if self.layout else 0
        return {
            "tokens": tokens,
            "batch": batch,
            "page_tokens": self.page_tokens,
            "page_bytes": self.layout.page_bytes if self.layout else 0,
            "pages": sum(layer.n_pages for layer in layers) * batch,
            "gpu_bytes": sum(layer.gpu_bytes() for layer in layers),
            "host_bytes": self.host_bytes(),
            "spilled_bytes": sum(layer.spilled_bytes() for layer in layers),
            "full_bytes": tokens * batch * token_bytes * len(layers),
            **self.counters,
        }

    def close(self) -> None:
        """Free the host pages and remove the spill files now (also done when collected)."""
        for layer in self.layers:
            layer.chunks.clear()
        if self.spill is not None:
            self.spill.close()

    def __del__(self):
        try:
            if self.spill is not None:
                self.spill.close()
        except Exception:
            pass


CONFIG_KEYS = {"kv_gpu_tokens": "gpu_tokens", "kv_sink_tokens": "sink_tokens",
               "kv_page_tokens": "page_tokens", "kv_top_k_pages": "top_k_pages",
               "kv_host_bytes": "host_bytes", "kv_spill_dir": "spill_dir"}
"""The configuration keys (daemon/config.py) and the ``for_model`` arguments they set."""

_DEFAULTS = dict(gpu_tokens=512, sink_tokens=4, page_tokens="auto", top_k_pages=None,
                 host_bytes=None, spill_dir=None)


def _explicit(given: dict) -> dict:
    """The arguments whose value differs from ``for_model``'s default (given by the caller)."""
    return {k: v for k, v in given.items() if v != _DEFAULTS[k] or type(v) is not type(_DEFAULTS[k])}


def flash_kv_settings(model) -> dict:
    """``for_model`` arguments from a ``load_model`` model's effective ``flash_config`` (the
    ``kv_*`` keys: flash.json, the model's ``flash_config``, the open's ``flash_context``); empty
    for a plain transformers model."""
    info = getattr(getattr(model, "flash", None), "info", None)
    config = getattr(info, "flash_config", None) or {}
    return {arg: config[key] for key, arg in CONFIG_KEYS.items() if key in config}


def _validate(*, gpu_tokens, sink_tokens, page_tokens, top_k_pages, host_bytes, spill_dir,
              dense_layers, score, window_pages, error_recovery_mode, prefill_chunk) -> None:
    from deepseek_flash.errors import ConfigError

    def bad(key, value, allowed):
        raise ConfigError(f"{key}: {value!r} is not allowed; use {allowed}", key=key,
                          value=value, allowed=allowed)

    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    if not is_int(gpu_tokens) or gpu_tokens < 0:
        bad("gpu_tokens", gpu_tokens, "an integer >= 0")
    if not is_int(sink_tokens) or sink_tokens < 0:
        bad("sink_tokens", sink_tokens, "an integer >= 0")
    if page_tokens != "auto" and page_tokens not in PAGE_TOKENS_CHOICES:
        bad("page_tokens", page_tokens, f"'auto' or one of {list(PAGE_TOKENS_CHOICES)}")
    if top_k_pages is not None:
        ok = (is_int(top_k_pages) and top_k_pages >= 1) or (
            isinstance(top_k_pages, float) and 0.0 < top_k_pages <= 1.0)
        if not ok:
            bad("top_k_pages", top_k_pages, "null (lossless), an integer >= 1 (pages) or a "
                "fraction in (0, 1] of the pages")
    if host_bytes is not None:
        if not is_int(host_bytes) or host_bytes < 0:
            bad("host_bytes", host_bytes, "null (unbounded) or an integer >= 0")
        if spill_dir is None:
            bad("host_bytes", host_bytes, "null, or a spill_dir for the pages past it")
    if not is_int(dense_layers) or dense_layers < 0:
        bad("dense_layers", dense_layers, "an integer >= 0")
    if score not in SCORES:
        bad("score", score, f"one of {list(SCORES)}")
    if not is_int(window_pages) or window_pages < 1:
        bad("window_pages", window_pages, "an integer >= 1")
    if error_recovery_mode not in ("strict", "graceful"):
        bad("error_recovery_mode", error_recovery_mode, "'strict' or 'graceful'")
    if not is_int(prefill_chunk) or prefill_chunk < 1:
        bad("prefill_chunk", prefill_chunk, "an integer >= 1")
