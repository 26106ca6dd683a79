"""Tiered KV cache: sinks and recent tokens on the device, older tokens in BICL pages on the host
and on NVMe, query-aware top-K page selection (docs/kv.md).

    cache = TieredCache.for_model(model, gpu_tokens=512, top_k_pages=None)
    out = model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=64)
    cache.stats()   # gpu_bytes, host_bytes, spilled_bytes, full_bytes, pages_fetched, ...
"""
from .cache import TieredCache, TieredLayer
from .compat import cache_keyword, cache_kwargs
from .layout import PageLayout, auto_page_tokens

__all__ = ["TieredCache", "TieredLayer", "PageLayout", "auto_page_tokens", "cache_keyword",
           "cache_kwargs"]
