"""The captured top-K choice and gather (kv/graphs.py) on the CPU, with the CUDA graph emulated:
capture runs the steps once, a replay reruns them into the same output tensors. What this
checks is the plumbing -- the query copied in, the shared output buffer, the gather into it,
the recapture key (pages, k, view, buffers) -- against the eager path, token for token; the
real graphs are checked on CUDA by tests/kv/test_kv_gpu.py."""
import contextlib

import pytest
import torch

import deepseek_flash.kv.graphs as graphs
from deepseek_flash.kv import TieredCache, cache_kwargs

from kvmodels import greedy, padded_prompt, tiny_model


class _Stream:
    def wait_stream(self, other):
        pass


class _Graph:
    """Replays by rerunning the owner's steps into the tensors the capture returned."""

    def __init__(self, owner):
        self.owner = owner
        self.captures = 0

    def capture_begin(self, pool=None, capture_error_mode="global"):
        self.captures += 1

    def capture_end(self):
        pass

    def replay(self):
        self.owner.chosen.copy_(self.owner._run())


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(graphs, "applies", lambda device: True)
    monkeypatch.setattr(graphs, "new_graph", _Graph)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: _Stream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)


@pytest.mark.parametrize("batch", [1, 2])
def test_captured_choice_and_gather_equal_the_eager_steps(emulated, batch):
    model = tiny_model(layers=3)
    ids, mask = padded_prompt(batch)
    runs, caches = [], []
    for captured in (False, True):
        cache = TieredCache.for_model(model, gpu_tokens=64, sink_tokens=4, page_tokens=32,
                                      top_k_pages=0.25, dense_layers=1)
        cache.select_graphs = captured
        runs.append(greedy(model, ids, mask, cache, 70))  # 70 steps: 2 page boundaries
        caches.append(cache)
    (t1, l1), (t2, l2) = runs
    assert torch.equal(t1, t2) and torch.equal(l1, l2)
    eager, graphed = caches
    assert [layer.graphs.graph is None for layer in eager.layers] == [True, True, True]
    assert [layer.graphs.graph is not None for layer in graphed.layers] == [False, True, True]
    assert eager.stats()["pages_fetched"] == graphed.stats()["pages_fetched"]
    # the page cache (default) inside the graphs: the same hits and misses (a capture step runs
    # the step twice; its counters are put back)
    for key in ("page_cache_hits", "page_cache_misses", "page_cache_bytes"):
        assert eager.stats()[key] == graphed.stats()[key] and graphed.stats()[key] > 0
    assert (eager.stats()["page_cache_step_fetched_bytes"]
            == graphed.stats()["page_cache_step_fetched_bytes"])
    # the last graph of each top-K layer was captured for the pages held now
    for layer in graphed.layers[1:]:
        g = layer.graphs.graph
        assert g.key[0] == layer.summaries.n and g.graph.captures == 1
    # captured again only when the pages, k or the host view change (a page boundary every 32
    # steps, a new host chunk), not every step: the output buffers keep their addresses
    for layer in graphed.layers[1:]:
        assert 1 <= layer.graphs.captures <= 6
    shapes = {layer.graphs.graph.out_rows.shape for layer in graphed.layers[1:]}
    buffers = graphed._select_out.buffers
    rows = [key for key in buffers if key[0] != "attention"]
    assert len(rows) == len(shapes)  # one buffer per row shape
    # and one pair for the attention's keys and values (sinks, pages, the whole recent window):
    # the graphs assembled them, no step concatenated anything
    (attention,) = [key for key in buffers if key[0] == "attention"]
    k = graphed.layers[1].graphs.graph.k
    assert attention[3] == 4 + k * 32 + 64 + 32 + 16
    for layer in graphed.layers[1:]:
        assert layer.win_k.shape[2] == 64 + 32 + 16
        assert layer.recent_k.data_ptr() == layer.win_k.data_ptr()
        assert layer.graphs.graph.attention is not None
    assert eager.layers[1].win_k is None
    graphed.close()
    assert all(layer.graphs.graph is None for layer in graphed.layers)


def test_a_refused_capture_leaves_the_layer_eager_for_good(emulated, monkeypatch, caplog):
    class Refused(_Graph):
        def capture_begin(self, pool=None, capture_error_mode="global"):
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "new_graph", Refused)
    model = tiny_model(layers=3)
    ids = torch.randint(1, 256, (1, 900), generator=torch.Generator().manual_seed(8))
    cache = TieredCache.for_model(model, gpu_tokens=64, page_tokens=32, top_k_pages=0.25,
                                  dense_layers=1)
    want = TieredCache.for_model(model, gpu_tokens=64, page_tokens=32, top_k_pages=0.25,
                                 dense_layers=1)
    want.select_graphs = False
    with caplog.at_level("WARNING", logger="deepseek_flash.kv.cache"):
        got_tokens, _ = greedy(model, ids, None, cache, 8)
    want_tokens, _ = greedy(model, ids, None, want, 8)
    assert torch.equal(got_tokens, want_tokens)
    assert [layer.graphs.failed for layer in cache.layers] == [False, True, True]
    assert caplog.text.count("not captured as a CUDA graph") == 2  # once per layer


def test_the_recent_window_across_prompt_chunks_and_modes_equals_the_eager_steps(emulated):
    # the graphs' recent window (kv/window.py) through what can follow decode steps: more prompt
    # than the window holds (back to plain tensors, then a new window), lossless steps (the
    # window written eagerly) and top-K again (its device position set anew) -- the same logits
    # as the eager steps throughout
    model = tiny_model(layers=3)
    ids = torch.randint(1, 256, (1, 700), generator=torch.Generator().manual_seed(9))
    more = torch.randint(1, 256, (1, 150), generator=torch.Generator().manual_seed(10))
    runs, caches = [], []
    for captured in (False, True):
        cache = TieredCache.for_model(model, gpu_tokens=64, page_tokens=32, top_k_pages=0.25,
                                      dense_layers=1)
        cache.select_graphs = captured
        logits, windows = [], []
        with torch.no_grad():
            out = model(ids, **cache_kwargs(model, cache)).logits[:, -1:]
            for step in range(60):
                if step == 20:  # a prompt chunk larger than the window
                    out = model(more, **cache_kwargs(model, cache)).logits[:, -1:]
                cache.top_k_pages = None if 35 <= step < 45 else 0.25  # lossless for a while
                out = model(out.argmax(-1), **cache_kwargs(model, cache)).logits[:, -1:]
                logits.append(out)
                windows.append(cache.layers[1].window is not None)
        runs.append(torch.cat(logits))
        caches.append((cache, windows))
    assert torch.equal(runs[0], runs[1])
    (eager, eager_windows), (graphed, windows) = caches
    assert not any(eager_windows)
    # a window from the first graphed step; gone after the long chunk, made again at the next
    # top-K step; kept (written eagerly) through the lossless steps
    assert windows[:20] == [True] * 20 and all(windows[20:])
    assert graphed.stats()["gpu_bytes"] > eager.stats()["gpu_bytes"]  # the window's capacity
    # the steps between two page boundaries repeat the last one's path (kv/layer.py, StepPlan)
    assert all(layer._plan is not None for layer in graphed.layers[1:])
    assert all(layer._plan is None for layer in eager.layers)
    graphed.top_k_pages = 0.5  # a setting changed: the plan no longer holds
    layer = graphed.layers[1]
    assert not layer._plan.holds(layer, graphed, torch.empty(layer._plan.shape))


def test_a_replay_that_fails_between_page_boundaries_leaves_the_layer_eager(emulated, monkeypatch,
                                                                            caplog):
    # a replay refused in the middle of the steps a StepPlan serves: that step and the rest run
    # eagerly, the same tokens as eager steps throughout (logged once per layer)
    class Failing(_Graph):
        replays = 0

        def replay(self):
            Failing.replays += 1
            if Failing.replays > 12:
                raise RuntimeError("CUDA error: operation failed")
            super().replay()

    monkeypatch.setattr(graphs, "new_graph", Failing)
    model = tiny_model(layers=3)
    ids = torch.randint(1, 256, (1, 900), generator=torch.Generator().manual_seed(8))
    runs = []
    for captured in (True, False):
        cache = TieredCache.for_model(model, gpu_tokens=64, page_tokens=32, top_k_pages=0.25,
                                      dense_layers=1)
        cache.select_graphs = captured
        with caplog.at_level("WARNING", logger="deepseek_flash.kv.cache"):
            runs.append(greedy(model, ids, None, cache, 20))
        if captured:
            assert [layer.graphs.failed for layer in cache.layers] == [False, True, True]
            assert all(layer._plan is None for layer in cache.layers)
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert caplog.text.count("failed to replay") == 2
