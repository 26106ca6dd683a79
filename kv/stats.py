"""What a ``TieredCache`` reports (``cache.stats()``; docs/kv.md's stats table): bytes per tier,
what a ``DynamicCache`` would hold for the same tokens, and the counters of fetches and of the
NVMe tier."""
from __future__ import annotations

COUNTERS = ("pages_fetched", "pages_read_spilled", "pages_lost", "spill_errors", "chunks_spilled",
            "arena_fallbacks", "page_cache_hits", "page_cache_misses")
"""The cache's event counters (``cache.counters``), all starting at 0."""


def new_counters() -> dict[str, int]:
    return {name: 0 for name in COUNTERS}


def collect(cache) -> dict:
    """The stats of ``cache`` (a ``TieredCache``) now."""
    layers = cache.layers
    tokens = layers[0].length if layers else 0
    batch = layers[0].batch if layers and layers[0].is_initialized else 0
    token_bytes = cache.layout.token_bytes if cache.layout else 0
    counters = dict(cache.counters)
    page_cache_bytes = last_misses = 0
    for layer in layers:  # the live page caches' device counters (kv/pagecache.py)
        pc = getattr(layer, "page_cache", None)
        if pc is not None:
            hits, misses, last = pc.counts()
            last_misses += last
            counters["page_cache_hits"] += hits
            counters["page_cache_misses"] += misses
            counters["pages_fetched"] += misses  # what crossed to the device: the misses
            page_cache_bytes += pc.nbytes()
    page_bytes = cache.layout.page_bytes if cache.layout else 0
    return {
        "tokens": tokens,
        "batch": batch,
        "page_tokens": cache.page_tokens,
        "page_bytes": cache.layout.page_bytes if cache.layout else 0,
        "pages": sum(layer.n_pages for layer in layers) * batch,
        # pages of the dense layers kept on the device as well (kv/mirror.py): never copied
        "mirrored_pages": sum(layer.mirror.tokens for layer in layers
                              if getattr(layer, "mirror", None) is not None)
        // (cache.page_tokens or 1) * batch,
        "gpu_bytes": sum(layer.gpu_bytes() for layer in layers),
        "host_bytes": cache.host_bytes(),
        "spilled_bytes": sum(layer.spilled_bytes() for layer in layers),
        "full_bytes": tokens * batch * token_bytes * len(layers),
        **counters,
        # top-K's page caches on the device (in gpu_bytes) and the bytes their misses fetched
        "page_cache_bytes": page_cache_bytes,
        "page_cache_fetched_bytes": counters["page_cache_misses"] * page_bytes,
        # what the misses of each layer's last step through its page cache moved, all layers
        "page_cache_step_fetched_bytes": last_misses * page_bytes,
        **_prune_stats(cache),
    }


def _prune_stats(cache) -> dict:
    """Importance pruning's keys (kv/prune): tokens per level per layer, level moves, recalls
    (pages, the bytes they moved to the device and the copy or gather operations that moved
    them), the bytes level 3 saves on the host, and the scorer's statistics on the device (not KV:
not in ``gpu_bytes``). Present with pruning off too (levels 1 and 2 are
    then the device and host tiers; no moves)."""
    layers = cache.layers
    prunes = [layer.prune for layer in layers if getattr(layer, "prune", None) is not None]
    out = {"level_tokens": [layer.level_tokens() for layer in layers],
           "demotions": 0, "promotions": 0, "recalls": 0, "recall_bytes": 0, "recall_copies": 0,
           "level3_bytes_saved": 0,
           "scorer_gpu_bytes": sum(p.scorer_gpu_bytes() for p in prunes)}
    for p in prunes:
        for key in ("demotions", "promotions", "recalls", "recall_bytes", "recall_copies"):
            out[key] += p.counters[key]
        out["level3_bytes_saved"] += p.compressed_saved()
    return out
