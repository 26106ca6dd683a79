"""The graphed top-K decode step's plan (kv/graphs.py's path, where the fused step of
kv/fused.py does not serve): ``StepPlan`` keeps what a step decided for the steps that repeat it,
``attend_planned`` replays such a step, ``attention_input`` makes the buffers its graph fills.
Functions of a ``TieredLayer`` (kv/layer.py), written as its methods (``self``: the layer)."""
from __future__ import annotations

import torch

from . import graphs
from .compute import sdpa
from .graphs import AttentionInput
from .window import RecentWindow


def attend_planned(self, plan, query, k_new, v_new, scaling):
    """``attend`` of a decode step that repeats the last one's path (``StepPlan``): the
    captured graph replayed with the step's query, keys and values, the attention over the
    prefix it assembled, the commit. Nothing decided again. None: the replay failed (the
    layer then takes the full path, eagerly)."""
    cache = self._cache
    window = self.window
    try:
        self._before_step()
        window.sync_pos()
        torch._foreach_copy_(plan.inputs, [query, k_new, v_new])
        try:
            plan.graph.graph.replay()
        except RuntimeError as exc:  # as LayerGraphs.select: eager from now on (logged)
            self.graphs.failed, self.graphs.graph = True, None
            window.pos_value = None
            graphs.log.warning("layer %d: the captured top-K graph failed to replay (%s); "
                               "the choice and gather run eagerly", self.index, exc)
            return None
        window.ahead = plan.t
        window.pos_value = window.length + plan.t
        n = plan.before_window + window.length + plan.t
        out = sdpa(query, plan.keys.narrow(2, 0, n), plan.values.narrow(2, 0, n), None, False,
                   scaling).transpose(1, 2).contiguous()
        if plan.fetched:
            cache.counters["pages_fetched"] += plan.fetched
    except BaseException:
        self.pending = None
        self._plan = None
        cache._poison(f"layer {self.index} failed during attention")
        raise
    self.pending = None
    self._commit(k_new, v_new)
    return out


def attention_input(self, query, k: int):
    """The graph path of a decode step: the ``AttentionInput`` its graph fills (the recent
    window made on first use), or None where the window cannot hold the step's tokens."""
    from .graphs import AttentionInput

    cache = self._cache
    k_new, v_new = self.pending
    t = k_new.shape[2]
    cap = cache.gpu_tokens + cache.page_tokens + cache.select_max_queries
    if self.sinks < cache.sink_tokens or self.recent_tokens + t > cap:
        return None
    if self.window is None or self.window.capacity != cap:
        self.window = RecentWindow(self.recent_k, self.recent_v, cap)
        self._recent_k = self._recent_v = None
    if self._sinks_kv is None or self._sinks_kv.shape[3] != self.sinks:
        self._sinks_kv = torch.stack((self.sink_k, self.sink_v))  # final: made once
    kv = cache._select_out.attention(k_new, self.sinks + k * cache.page_tokens + cap)
    return AttentionInput(kv, self._sinks_kv, self.window, query, k_new, v_new)


class StepPlan:
    """What a graphed top-K decode step of one layer decided (kv/layer.py, ``_past``), kept for
    the steps that follow while it holds: the same settings, page count, host view, page cache,
    captured graph, recent window and query shape. Pages written (every ``page_tokens`` steps),
    a chunk added or spilled, a setting changed or a graph recaptured end it; the next step then
    takes the full path and makes a new one. The steps it serves skip every decision: an eager
    decode step is bound by the host, and these are ~20 checks per layer and step."""

    __slots__ = ("settings", "host_span", "page_cache", "pc_span", "pc_slots", "graph", "window",
                 "minmax", "shape", "dtype", "inputs", "keys", "values", "before_window", "t",
                 "fetched")

    def __init__(self, layer, cache, query, attention, k, page_cache):
        self.settings = (cache.top_k_pages, cache.page_cache, cache.select_graphs, cache.score,
                         cache.window_pages)
        self.host_span = layer.pages._span
        self.page_cache = page_cache
        self.pc_span = page_cache._span if page_cache is not None else None
        self.pc_slots = page_cache.slots if page_cache is not None else None
        self.graph = layer.graphs.graph
        self.window = layer.window
        self.minmax = layer.summaries.minmax
        self.shape, self.dtype = query.shape, query.dtype
        self.inputs = [attention.q_in, attention.k_in, attention.v_in]
        self.keys, self.values = attention.keys, attention.values
        self.before_window = attention.sinks + k * cache.page_tokens
        self.t = attention.steps.shape[0]
        self.fetched = layer.batch * k if page_cache is None else 0

    def holds(self, layer, cache, query) -> bool:
        pc = self.page_cache
        return (query.shape == self.shape and query.dtype == self.dtype
                and layer.graphs.graph is self.graph and self.graph is not None
                and layer.window is self.window and layer.pages._span is self.host_span
                and self.host_span is not None and layer.summaries.minmax is self.minmax
                and layer.page_cache is pc
                and (pc is None or (pc._span is self.pc_span and pc.slots is self.pc_slots
                                    and not pc.refused))
                and self.settings == (cache.top_k_pages, cache.page_cache, cache.select_graphs,
                                      cache.score, cache.window_pages))
