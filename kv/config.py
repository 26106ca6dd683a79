"""The tiered cache's settings: the configuration keys that set ``for_model``'s arguments
(flash.json, a store's ``flash_config``, an open's ``flash_context``), their defaults, and the
validation every argument goes through (``ConfigError`` naming key, value and what is allowed)."""
from __future__ import annotations

from .layout import PAGE_TOKENS_CHOICES
from .select import SCORES

CONFIG_KEYS = {"kv_gpu_tokens": "gpu_tokens", "kv_sink_tokens": "sink_tokens",
               "kv_page_tokens": "page_tokens", "kv_top_k_pages": "top_k_pages",
               "kv_host_bytes": "host_bytes", "kv_spill_dir": "spill_dir",
               "kv_prune_threshold": "prune_threshold", "kv_page_cache": "page_cache"}
"""The configuration keys (daemon/config.py) and the ``for_model`` arguments they set."""

DEFAULTS = dict(gpu_tokens=512, sink_tokens=4, page_tokens="auto", top_k_pages=None,
                host_bytes=None, spill_dir=None, prune_threshold=None, page_cache=1.5)


def explicit_args(given: dict) -> dict:
    """The arguments whose value differs from ``for_model``'s default (given by the caller)."""
    return {k: v for k, v in given.items() if v != DEFAULTS[k] or type(v) is not type(DEFAULTS[k])}


def flash_kv_settings(model) -> dict:
    """``for_model`` arguments from a ``load_model`` model's effective ``flash_config`` (the
    ``kv_*`` keys: flash.json, the model's ``flash_config``, the open's ``flash_context``); empty
    for a plain transformers model."""
    info = getattr(getattr(model, "flash", None), "info", None)
    config = getattr(info, "flash_config", None) or {}
    return {arg: config[key] for key, arg in CONFIG_KEYS.items() if key in config}


def validate(*, gpu_tokens, sink_tokens, page_tokens, top_k_pages, host_bytes, spill_dir,
              dense_layers, score, window_pages, error_recovery_mode, prefill_chunk,
              page_cache=1.5) -> None:
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
    if page_cache is not None and page_cache != "auto" and (
            isinstance(page_cache, bool) or not isinstance(page_cache, (int, float))
            or not (page_cache == 0 or page_cache >= 1.0)
            or page_cache != page_cache or page_cache == float("inf")):
        bad("page_cache", page_cache, "'auto' (every page, within the device budget), null or 0 "
            "(off), or a multiple >= 1.0 of the top-K page count")
