"""The tiered cache on a CUDA device (run on the GPU machine: ``pytest -m gpu tests/kv``):
lossless mode gives DynamicCache's tokens with the pages in page-locked host memory, fetched on
the copy stream by one ``_foreach_copy_`` per layer; top-K's one-gather fetch (kernels reading
page-locked host memory) gives exactly what copying the same pages run by run gives, and so does
the same choice and gather replayed as a captured CUDA graph (kv/graphs.py)."""
import pytest
import torch

from deepseek_flash.kv import TieredCache

from kvmodels import greedy, reference, tiny_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _prompt(batch, n=1500):
    ids = torch.randint(1, 256, (batch, n), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, :37] = 0
    return ids.cuda(), mask.cuda()


@pytest.mark.parametrize("batch", [1, 2])
def test_lossless_on_cuda_matches_dynamic_cache(batch):
    import deepseek_flash.kv.pages as pages

    model = tiny_model(layers=3).cuda()
    ids, mask = _prompt(batch)
    want_tokens, want_logits = reference(model, ids, mask, 32)
    cache = TieredCache.for_model(model, gpu_tokens=64, sink_tokens=4, page_tokens=32)
    tokens, logits = greedy(model, ids, mask, cache, 32)
    assert torch.equal(tokens, want_tokens)
    assert (logits - want_logits).abs().max().item() <= 1e-4
    assert cache.pinned and len(cache.layers[0].chunks) > 1  # several chunks, one call
    assert pages._FOREACH == [True]  # torch took the host->device _foreach_copy_
    s = cache.stats()
    assert s["pages_fetched"] > 0
    # the two dense layers' pages are on the device as well (kv/mirror.py, the CUDA default):
    # only the third layer's are copied
    assert s["mirrored_pages"] == 2 * s["pages"] // 3
    assert [layer.mirror is not None for layer in cache.layers] == [True, True, False]
    cache.close()


def test_topk_one_gather_on_cuda_equals_copied_pages():
    model = tiny_model(layers=3).cuda()
    ids, mask = _prompt(1)
    runs = []
    for one_gather in (True, False):
        cache = TieredCache.for_model(model, gpu_tokens=64, sink_tokens=4, page_tokens=32,
                                      top_k_pages=0.25, dense_layers=1)
        cache.select_graphs = False
        cache.fused = False  # the torch path's gather (kv/fused.py: test_topk_fused_step_on_cuda)
        if not one_gather:
            for layer in cache.layers:
                layer.pages._span_failed = True  # copy the chosen pages run by run
        runs.append(greedy(model, ids, mask, cache, 16))
        gathered = [layer.pages._span is not None for layer in cache.layers]
        assert gathered == ([False, True, True] if one_gather else [False, False, False])
        cache.close()
    (t1, l1), (t2, l2) = runs
    assert torch.equal(t1, t2) and torch.equal(l1, l2)


@pytest.mark.parametrize("batch,dtype", [(2, torch.float32), (1, torch.bfloat16)])
def test_topk_captured_graphs_equal_the_eager_steps(caplog, batch, dtype):
    # the choice and gather of each top-K layer replayed as a CUDA graph, which also assembles
    # the attention's keys and values (sinks, pages, the recent window in its fixed buffer): the
    # same tokens and logits as the eager steps' concatenations, across page boundaries
    # (recaptures); batch 2 with padding (a mask), and batch 1 in bf16 (the flash kernel over a
    # prefix of the assembled buffers)
    import logging

    model = tiny_model(layers=3).cuda().to(dtype)
    ids, mask = _prompt(batch)
    runs = []
    for graphs in (False, True):
        cache = TieredCache.for_model(model, gpu_tokens=64, sink_tokens=4, page_tokens=32,
                                      top_k_pages=0.25, dense_layers=1)
        cache.select_graphs = graphs
        cache.fused = False  # the torch path's graphs (the fused step: below)
        with caplog.at_level(logging.WARNING, logger="deepseek_flash.kv.cache"):
            runs.append(greedy(model, ids, mask, cache, 80))  # 80 steps: 2 page boundaries
        captured = [layer.graphs.graph is not None for layer in cache.layers]
        assert captured == ([False, True, True] if graphs else [False, False, False])
        assert not any(layer.graphs.failed for layer in cache.layers)
        assert [layer.win_k is not None for layer in cache.layers] == [False, graphs, graphs]
        cache.close()
    assert "not captured" not in caplog.text and "failed to replay" not in caplog.text
    (t1, l1), (t2, l2) = runs
    assert torch.equal(t1, t2) and torch.equal(l1, l2)


def test_topk_page_cache_on_cuda_equals_every_page_fetched(caplog):
    # the page cache's one gather reads hits from device slots and misses from page-locked host
    # memory through one view (kv/span.py, extra=): the same tokens and logits as fetching every
    # chosen page, captured graphs on, batch 2, across page boundaries (slots grown, recaptured);
    # a multiple of k, and every page ("auto", an option: within the device budget, which this
    # small model fits)
    import logging

    model = tiny_model(layers=3).cuda()
    ids, mask = _prompt(2)
    runs, stats = [], []
    for multiple in (0, 1.25, "auto"):
        cache = TieredCache.for_model(model, gpu_tokens=64, sink_tokens=4, page_tokens=32,
                                      top_k_pages=0.25, dense_layers=1, page_cache=multiple)
        cache.fused = False  # the torch path's one gather over host pages and slots
        with caplog.at_level(logging.WARNING, logger="deepseek_flash.kv.cache"):
            runs.append(greedy(model, ids, mask, cache, 80))
        assert [layer.graphs.graph is not None for layer in cache.layers] == [False, True, True]
        if multiple:
            assert all(layer.page_cache._span is not None for layer in cache.layers[1:])
            assert all(layer.page_cache.slots.is_cuda for layer in cache.layers[1:])
        if multiple == "auto":  # a slot for every page: each crossed once at most
            assert all(layer.page_cache.capacity >= layer.n_pages for layer in cache.layers[1:])
        stats.append(cache.stats())
        cache.close()
    assert "not captured" not in caplog.text and "failed to replay" not in caplog.text
    (t1, l1), (t2, l2), (t3, l3) = runs
    assert torch.equal(t1, t2) and torch.equal(l1, l2)
    assert torch.equal(t1, t3) and torch.equal(l1, l3)
    plain, cached, every = stats
    assert plain["page_cache_hits"] == 0 and cached["page_cache_hits"] > 0
    for s in (cached, every):
        topk_pages = s["page_cache_hits"] + s["page_cache_misses"]
        assert s["pages_fetched"] == plain["pages_fetched"] - topk_pages + s["page_cache_misses"]
    # every page kept: no page fetched twice, so no more misses than with 1.25 x k slots
    assert every["page_cache_misses"] <= cached["page_cache_misses"]


def test_topk_dense_layers_copied_ahead_equal_their_pages_copied_when_due():
    # a top-K step copies its dense layers' pages for the next step on the copy stream while
    # its top-K layers compute (kv/cache.py, next_to_prefetch): the same tokens and logits as
    # copying them when each dense layer is due, and the copies made ahead are the ones used
    model = tiny_model(layers=4).cuda()
    ids, mask = _prompt(1)
    runs, used = [], []
    for ahead in (True, False):
        cache = TieredCache.for_model(model, gpu_tokens=64, sink_tokens=4, page_tokens=32,
                                      top_k_pages=0.25, dense_layers=2, dense_on_device=False)
        took = []

        def take(layer, take=cache._take_prefetched):
            got = take(layer)
            took.append((layer.index, got is not None))
            return got

        cache._take_prefetched = take
        if not ahead:
            cache._prefetch_next = lambda layer: None
        runs.append(greedy(model, ids, mask, cache, 40))
        used.append(took)
        cache.close()
    (t1, l1), (t2, l2) = runs
    assert torch.equal(t1, t2) and torch.equal(l1, l2)
    # 39 decode steps after the prefill, the two dense layers each: every copy made ahead used
    # but the first step's layer 0 (nothing was ahead of it yet)
    assert len(used[0]) == len(used[1]) == 2 * 39
    assert [i for i, hit in used[0] if not hit] == [0] and not any(h for _, h in used[1])


def _fused_tables(layer):
    pc = layer.page_cache
    b = pc.page_of_slot.shape[0]
    return [pc.slot_of_page, pc.page_of_slot, pc.slots.view(b, pc.capacity, -1)[pc.page_of_slot >= 0]]


@pytest.mark.parametrize("batch,dtype", [(2, torch.float32), (1, torch.bfloat16)])
def test_topk_fused_step_on_cuda(caplog, batch, dtype):
    # kv/fused.py's five Triton kernels (their misses read from page-locked host memory through
    # the unified address space) as a CUDA graph: the same tokens and logits as their eager
    # launches, across page boundaries; in float32 the same chosen pages, tables and slots as
    # the torch path and its logits within rounding of torch's attention
    import logging

    import deepseek_flash.kv.fused as fused

    if not fused.available(torch.device("cuda")):
        pytest.fail("Triton is not importable on this CUDA machine")
    model = tiny_model(layers=3).cuda().to(dtype)
    ids = torch.randint(1, 256, (batch, 1500), generator=torch.Generator().manual_seed(5)).cuda()
    runs, caches = [], []
    for use_fused, graphs in ((False, True), (True, False), (True, True)):
        cache = TieredCache.for_model(model, gpu_tokens=64, sink_tokens=4, page_tokens=32,
                                      top_k_pages=0.25, dense_layers=1, window_pages=16)
        cache.fused, cache.select_graphs = use_fused, graphs
        with caplog.at_level(logging.WARNING, logger="deepseek_flash.kv.cache"):
            runs.append(greedy(model, ids, None, cache, 70))  # 70 steps: 2 page boundaries
        used = [layer._fused is not None for layer in cache.layers]
        assert used == [False, use_fused, use_fused], caplog.text
        if use_fused:
            assert all((layer._fused.graph is not None) == graphs for layer in cache.layers[1:])
            # captured: the steps' tensors come at the addresses of the step before (the
            # caching allocator), so a graph reading them in place serves (no copy)
            assert all((layer._fused.direct is not None) == graphs
                       for layer in cache.layers[1:]), [layer._fused.seen_at
                                                        for layer in cache.layers[1:]]
        caches.append(cache)
    assert "fused top-K step failed" not in caplog.text, caplog.text
    (t0, l0), (t1, l1), (t2, l2) = runs
    assert torch.equal(t1, t2) and torch.equal(l1, l2)  # the graph replays its launches
    torch_path, eager, graphed = caches
    for key in ("page_cache_hits", "page_cache_misses"):
        assert eager.stats()[key] == graphed.stats()[key] > 0
    # the choice as three kernels (fused.SPLIT): the same pages, tables, tokens and logits
    fused.SPLIT[0] = True
    try:
        cache = TieredCache.for_model(model, gpu_tokens=64, sink_tokens=4, page_tokens=32,
                                      top_k_pages=0.25, dense_layers=1, window_pages=16)
        cache.fused, cache.select_graphs = True, False
        t3, l3 = greedy(model, ids, None, cache, 70)
    finally:
        fused.SPLIT[0] = False
    assert all(layer._fused is not None and layer._fused.split
               for layer in cache.layers[1:]), caplog.text
    assert torch.equal(t1, t3) and torch.equal(l1, l3)
    for layer, want in zip(cache.layers[1:], eager.layers[1:]):
        for got, expected in zip(_fused_tables(layer), _fused_tables(want)):
            assert torch.equal(got, expected)
    cache.close()
    if dtype == torch.float32:
        assert torch.equal(t0, t1)
        assert (l0 - l1).abs().max().item() <= 1e-4
        for layer, want in zip(eager.layers[1:], torch_path.layers[1:]):
            for got, expected in zip(_fused_tables(layer), _fused_tables(want)):
                assert torch.equal(got, expected)
    else:  # bf16: the first decode step within bf16 rounding of the flash kernel's attention
        assert (l0[1] - l1[1]).abs().max().item() <= 0.05 * l0[1].abs().max().item()
    for cache in caches:
        cache.close()
