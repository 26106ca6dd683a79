"""What a ``TieredCache`` reports (``cache.stats()``; docs/kv.md's stats table): bytes per tier,
what a ``DynamicCache`` would hold for the same tokens, and the counters of fetches and of the
NVMe tier."""
from __future__ import annotations

COUNTERS = ("pages_fetched", "pages_read_spilled", "pages_lost", "spill_errors", "chunks_spilled",
            "arena_fallbacks")
"""The cache's event counters (``cache.counters``), all starting at 0."""


def new_counters() -> dict[str, int]:
    return {name: 0 for name in COUNTERS}


def collect(cache) -> dict:
    """The stats of ``cache`` (a ``TieredCache``) now."""
    layers = cache.layers
    tokens = layers[0].length if layers else 0
    batch = layers[0].batch if layers and layers[0].is_initialized else 0
    token_bytes = cache.layout.token_bytes if cache.layout else 0
    return {
        "tokens": tokens,
        "batch": batch,
        "page_tokens": cache.page_tokens,
        "page_bytes": cache.layout.page_bytes if cache.layout else 0,
        "pages": sum(layer.n_pages for layer in layers) * batch,
        "gpu_bytes": sum(layer.gpu_bytes() for layer in layers),
        "host_bytes": cache.host_bytes(),
        "spilled_bytes": sum(layer.spilled_bytes() for layer in layers),
        "full_bytes": tokens * batch * token_bytes * len(layers),
        **cache.counters,
    }
