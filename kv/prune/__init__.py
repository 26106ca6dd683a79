"""KV importance pruning on top of the tiered cache (docs/kv.md, "Importance pruning"): a scorer
gives each cached token a score in 0..1; pages below ``prune_threshold`` are demoted from the
device (level 1) to the host (level 2) and then to an int4 form on the host (level 3), and come
back when the query-aware top-K recalls them or their score rises again.

    cache = TieredCache.for_model(model, prune_threshold=0.15, prune_scorer="attention")
"""
from .baselines import EvictingCache
from .compress import CompressedPages, compress_pages, decompress_pages, round_trip_bound
from .offsets import OffsetMatcher
from .policy import (COMPENSATION_POWER, COMPENSATION_TOKENS, DEFAULT_OFFSET, DEFAULT_THRESHOLD,
                     adjust_scores, compensation, next_levels, page_scores)
from .scorers import MLPScorer, ScoreInput, attention_scorer, resolve_scorer

__all__ = ["EvictingCache", "CompressedPages", "compress_pages", "decompress_pages",
           "round_trip_bound", "OffsetMatcher", "COMPENSATION_POWER", "COMPENSATION_TOKENS",
           "DEFAULT_OFFSET", "DEFAULT_THRESHOLD", "adjust_scores", "compensation", "next_levels",
           "page_scores", "MLPScorer", "ScoreInput", "attention_scorer", "resolve_scorer"]
