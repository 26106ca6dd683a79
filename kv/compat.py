"""What the tiered cache needs from ``transformers``, and the one call-site difference between the
versions it supports: the keyword that hands a cache to a model.

transformers renamed the models' ``past_key_values`` argument to ``cache`` (5.17 takes only
``past_key_values``; 5.24 takes ``cache`` and still accepts ``past_key_values`` with a deprecation
warning). A cache passed under a keyword the model's ``forward`` does not take is not refused by
transformers: it flows on, unused, as a keyword argument, and the model builds a cache of its own.
The tiered attention function sees it there and raises ``KVCacheBypassed`` (kv/attention.py);
``cache_kwargs(model, cache)`` gives the keyword the installed version takes.
"""
from __future__ import annotations

import inspect

MIN_TRANSFORMERS = (5, 10)
"""Oldest transformers the tiered cache is known to run on (tests/kv passes on 5.10.4, 5.17.0 and
5.24.0, its cache tests also on 5.14.1 and 5.16.1; 5.0 to 5.5 fail in mask building, 4.x lacks
parts of the layered caches). ``TieredCache.for_model`` refuses an older one with ``KVUnsupported``."""


def transformers_version_text() -> str:
    import transformers

    return transformers.__version__


def transformers_version() -> tuple[int, ...]:
    parts = []
    for piece in transformers_version_text().split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def require_transformers() -> None:
    """Raise ``KVUnsupported`` naming the installed transformers when it is older than
    ``MIN_TRANSFORMERS``."""
    if transformers_version() < MIN_TRANSFORMERS:
        from deepseek_flash.errors import KVUnsupported

        raise KVUnsupported(
            f"transformers {transformers_version_text()} is older than the tiered KV cache needs "
            f"({'.'.join(map(str, MIN_TRANSFORMERS))} or newer)")


def _params(fn) -> dict:
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}


def cache_keyword(model) -> str:
    """``"cache"`` or ``"past_key_values"``: the keyword ``model`` (a causal LM, or its decoder)
    takes its cache under, looked up on its ``forward``, then its decoder's."""
    for owner in (model, getattr(model, "model", None)):
        if owner is None:
            continue
        params = _params(type(owner).forward)
        if "cache" in params:
            return "cache"
        if "past_key_values" in params:
            return "past_key_values"
    # a wrapper that hides its signature: the installed transformers' Llama decoder tells
    from transformers import LlamaModel

    return "cache" if "cache" in _params(LlamaModel.forward) else "past_key_values"


def cache_kwargs(model, cache) -> dict:
    """``{keyword: cache}`` for ``model(...)`` and ``model.generate(...)`` on the installed
    transformers: ``model.generate(ids, **cache_kwargs(model, cache))``."""
    return {cache_keyword(model): cache}
