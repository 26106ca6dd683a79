"""A cache's stats to the controller its model came from (``report_kv``; docs/kv.md, "Stats in the
daemon").

A model from ``load_model`` carries its client (``model.flash.client``): a socket to the daemon or
the embedded controller. A ``TieredCache`` built for such a model reports ``REPORTED`` from
``cache.stats()`` at the start of a step at most every ``interval`` seconds, and a last time,
``closed``, from ``close()`` or when the cache is collected. The controller sums the live caches'
bytes into ``kv_gpu_bytes``, ``kv_host_bytes``, ``kv_spilled_bytes``, their tokens per pruning
level into ``kv_level1_tokens`` .. ``kv_level3_tokens``, and their page fetches, level moves and
recalls (closed ones included) into ``kv_pages_fetched``, ``kv_demotions``, ``kv_promotions``,
``kv_recalls`` of its ``stats``, and per model into the model's ``kv.*`` fields of the status tree
(with ``kv.level_tokens.layer<i>``, the tokens per level of each layer). A report that cannot be sent (controller restarting) is dropped; the
next one carries the figures again (they are cumulative), and the generation never waits on it.
"""
from __future__ import annotations

import itertools
import logging
import time
import weakref

from deepseek_flash.errors import FlashError

log = logging.getLogger("deepseek_flash.kv.cache")

REPORTED = ("tokens", "gpu_bytes", "host_bytes", "spilled_bytes", "full_bytes", "pages_fetched",
            "demotions", "promotions", "recalls", "level3_bytes_saved")
PRUNE_COUNTERS = ("demotions", "promotions", "recalls")
"""Pruning's cumulative counters (kv/prune/state.py, per layer): in the closed report too."""
_ids = itertools.count(1)


def client_of(model):
    """``(client, model name)`` of a ``load_model`` model, else None."""
    flash = getattr(model, "flash", None)
    client = getattr(flash, "client", None)
    name = getattr(getattr(flash, "info", None), "name", None)
    if client is None or not isinstance(name, str) or not hasattr(client, "call"):
        return None
    return client, name


def _send(client, model: str, stats: dict) -> None:
    try:
        client.call("report_kv", {"model": model, "stats": stats})
    except (FlashError, OSError) as exc:
        log.debug("kv report not sent: %s", exc)


def _send_closed(client, model: str, cache_id: int, counters: dict, prune: list) -> None:
    _send(client, model, {"cache": cache_id, "closed": True,
                          "pages_fetched": int(counters.get("pages_fetched", 0)),
                          **{k: sum(int(c[k]) for c in prune) for k in PRUNE_COUNTERS}})


def level_fields(stats: dict) -> dict:
    """``level_tokens`` of ``stats`` (per layer, per sequence) as the report carries them: per
    layer ``[level 1, level 2, level 3]`` tokens of all the batch's sequences, and their sums over
    the layers, ``level1_tokens``, ``level2_tokens``, ``level3_tokens``."""
    batch = max(1, int(stats.get("batch") or 0))
    per_layer = [[int(n) * batch for n in lv] for lv in stats["level_tokens"]]
    return {"level_tokens": per_layer,
            **{f"level{i + 1}_tokens": sum(lv[i] for lv in per_layer) for i in range(3)}}


class Reporter:
    """Reports one cache to one controller (see the module's text)."""

    def __init__(self, cache, client, model: str, interval: float = 1.0):
        self.client, self.model, self.interval = client, model, interval
        self.cache_id = next(_ids)
        self._last = None
        # a cache collected without close() still says so; holds the counters, never the cache
        prune = [layer.prune.counters for layer in cache.layers
                 if getattr(layer, "prune", None) is not None]
        self._final = weakref.finalize(cache, _send_closed, client, model, self.cache_id,
                                       cache.counters, prune)
        self._final.atexit = False

    def tick(self, cache) -> None:
        now = time.monotonic()
        if self._last is None or now - self._last >= self.interval:
            self._last = now
            self.send(cache)

    def send(self, cache) -> None:
        stats = cache.stats()
        _send(self.client, self.model,
              {"cache": self.cache_id, **{k: int(stats[k]) for k in REPORTED},
               **level_fields(stats)})

    def close(self) -> None:
        self._final()  # sends the closed report once (a finalizer runs at most once)
