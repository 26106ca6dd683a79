"""Top-K's page cache (kv/pagecache.py): the pages chosen in the last steps stay in device slots
and only the newly chosen ones are fetched; what is attended is the same bytes as without it."""
import math

import pytest
import torch

import deepseek_flash.kv.pagecache as pagecache
from deepseek_flash.errors import ConfigError
from deepseek_flash.kv import TieredCache, cache_kwargs

from kvmodels import greedy, padded_prompt, tiny_model

H, D, P = 2, 8, 16


def _layer_cache(**kw):
    cache = TieredCache(1, kv_heads=H, head_dim=D, gpu_tokens=P, sink_tokens=2, page_tokens=P,
                        dense_layers=0, top_k_pages=2, **kw)
    return cache, cache.layers[0]


def _step(layer, q, k, v):
    layer.update(k, v)
    return layer.attend(None, q, None, D ** -0.5)


# the pages each step's query points at (page j's keys are large on channel j)
STEPS = [(0, 1), (1, 2), (0, 1), (3, 4), (0, 1)]
# capacity 3 (1.5 x k = 2, slots not rounded up): hits / misses per step, slots least recently
# chosen first (empty ones before), ties to the lower slot:
#   (0,1): 2 misses -> slots 0, 1          (1,2): 1 hit, page 2 -> empty slot 2
#   (0,1): 2 hits                           (3,4): 2 misses -> slot 2 (chosen at step 1), slot 0
#   (0,1): page 1 hits, page 0 -> slot 0 (step 3, before slot 2 of the same step)
HITS = [0, 1, 2, 0, 1]
FINAL_SLOTS = {0: 0, 1: 1, 3: 2}


def test_page_cache_keeps_recent_choices_and_fetches_only_new_pages(monkeypatch):
    monkeypatch.setattr(pagecache, "GROW_SLOTS", 1)
    torch.manual_seed(0)
    b, n_tokens = 2, 2 + 8 * P + P  # sinks, 8 pages, recent window
    keys = torch.randn(b, H, n_tokens, D) * 0.1
    values = torch.randn(b, H, n_tokens, D)
    for page in range(8):
        keys[:, :, 2 + page * P:2 + (page + 1) * P, page] = 3.0
    runs = {}
    for multiple in (0, 1.5):
        cache, layer = _layer_cache(page_cache=multiple)
        _step(layer, torch.zeros(b, 2 * H, n_tokens, D), keys, values)  # prefill: every page
        assert layer.n_pages == 8
        outs, fetched = [], []
        gen = torch.Generator().manual_seed(1)
        for pages in STEPS:
            q = torch.zeros(b, 2 * H, 1, D)
            q[..., list(pages)] = 4.0
            before = cache.stats()
            outs.append(_step(layer, q, torch.randn(b, H, 1, D, generator=gen) * 0.1,
                              torch.randn(b, H, 1, D, generator=gen)))
            after = cache.stats()
            fetched.append(after["pages_fetched"] - before["pages_fetched"])
            if multiple:
                hits = HITS[len(outs) - 1]
                assert after["page_cache_hits"] - before["page_cache_hits"] == b * hits
                assert after["page_cache_step_fetched_bytes"] == b * (2 - hits) * after["page_bytes"]
        runs[multiple] = (outs, fetched, cache, layer)
    (plain, plain_fetched, plain_cache, _), (cached, cached_fetched, cache, layer) = runs[0], runs[1.5]
    for a, c in zip(plain, cached):
        assert torch.equal(a, c)  # the same pages' bytes attended
    assert plain_fetched == [b * 2] * 5
    assert cached_fetched == [b * (2 - h) for h in HITS]
    s = cache.stats()
    assert s["page_cache_hits"] == b * sum(HITS) == 8
    assert s["page_cache_misses"] == b * (10 - sum(HITS)) == 12
    assert s["page_cache_fetched_bytes"] == 12 * s["page_bytes"] == 12 * 2 * H * P * D * 4
    pc = layer.page_cache
    assert pc.capacity == 3
    want = torch.full((8,), -1)
    for page, slot in FINAL_SLOTS.items():
        want[page] = slot
    assert torch.equal(pc.slot_of_page[:, :8], want.expand(b, 8))
    assert torch.equal(pc.page_of_slot, torch.tensor([[0, 1, 3]] * b))
    # slots: 3 pages x batch 2; tables: slot_of_page [2, 65], page_of_slot [2, 3], last_used [2, 4]
    tables = 8 * b * (65 + 3 + 4)
    assert s["page_cache_bytes"] == pc.nbytes() == b * 3 * s["page_bytes"] + tables
    assert s["gpu_bytes"] == plain_cache.stats()["gpu_bytes"] + s["page_cache_bytes"]
    assert plain_cache.stats()["page_cache_bytes"] == 0
    assert plain_cache.stats()["page_cache_hits"] == 0


def test_auto_page_cache_holds_every_page_so_each_crosses_once(monkeypatch):
    # "auto" (an option): slots for every page of the layer (an eighth more to grow), so a
    # chosen page is fetched the first time it is chosen and never again: over STEPS the misses
    # are the distinct pages chosen (0..4), where 1.5 x k (the default) fetched 12; the same bytes
    # attended
    monkeypatch.setattr(pagecache, "GROW_SLOTS", 1)
    torch.manual_seed(0)
    b, n_tokens = 2, 2 + 8 * P + P
    keys = torch.randn(b, H, n_tokens, D) * 0.1
    values = torch.randn(b, H, n_tokens, D)
    for page in range(8):
        keys[:, :, 2 + page * P:2 + (page + 1) * P, page] = 3.0
    outs = {}
    for setting in (0, "auto"):
        cache, layer = _layer_cache(page_cache=setting)
        _step(layer, torch.zeros(b, 2 * H, n_tokens, D), keys, values)
        gen = torch.Generator().manual_seed(1)
        fetched, got = [], []
        for pages in STEPS:
            q = torch.zeros(b, 2 * H, 1, D)
            q[..., list(pages)] = 4.0
            before = cache.stats()["pages_fetched"]
            got.append(_step(layer, q, torch.randn(b, H, 1, D, generator=gen) * 0.1,
                             torch.randn(b, H, 1, D, generator=gen)))
            fetched.append(cache.stats()["pages_fetched"] - before)
        outs[setting] = (got, fetched, cache, layer)
    (plain, _, _, _), (auto, fetched, cache, layer) = outs[0], outs["auto"]
    assert cache.page_cache == pagecache.AUTO and pagecache.PAGE_CACHE_DEFAULT == 1.5
    for a, c in zip(plain, auto):
        assert torch.equal(a, c)
    # new pages per step: (0,1) (2) () (3,4) () -- per sequence
    assert fetched == [b * 2, b * 1, 0, b * 2, 0]
    s = cache.stats()
    assert s["page_cache_misses"] == b * 5 and s["page_cache_hits"] == b * 10 - b * 5
    pc = layer.page_cache
    assert pc.capacity == pagecache.capacity_for(2, "auto", 8) == 8 + 1  # 8 pages + max(1, 8 // 8)
    assert torch.equal(pc.slot_of_page[:, :8],
                       torch.tensor([0, 1, 2, 3, 4, -1, -1, -1]).expand(b, 8))


def test_capacity_for_auto_and_multiples():
    g = pagecache.GROW_SLOTS
    assert pagecache.capacity_for(128, "auto", 512) == 512 + 64  # an eighth more, on 16 slots
    assert pagecache.capacity_for(128, "auto", 100) == -(-(100 + g) // g) * g
    assert pagecache.capacity_for(128, 1.5, 512) == 192  # the multiple ignores the page count
    assert pagecache.capacity_for(130, "auto", 120) == 144  # at least k (a top-K of every page)
    assert pagecache.wanted(128, "auto", 512) == 512 and pagecache.wanted(128, 1.5, 512) == 192


@pytest.mark.parametrize("batch", [1, 2])
def test_generate_with_the_page_cache_equals_without(batch):
    model = tiny_model(layers=3)
    ids, mask = padded_prompt(batch)
    runs, caches = [], []
    for multiple in (0, 1.25):
        cache = TieredCache.for_model(model, gpu_tokens=64, sink_tokens=4, page_tokens=32,
                                      top_k_pages=0.25, dense_layers=1, page_cache=multiple)
        runs.append(greedy(model, ids, mask, cache, 70))  # 70 steps: 2 page boundaries
        caches.append(cache)
    (t1, l1), (t2, l2) = runs
    assert torch.equal(t1, t2) and torch.equal(l1, l2)
    plain, cached = (c.stats() for c in caches)
    # every top-K page attended was either fetched or found in the slots
    assert cached["page_cache_hits"] + cached["page_cache_misses"] == (
        plain["pages_fetched"] - cached["pages_fetched"] + cached["page_cache_misses"])
    assert cached["page_cache_hits"] > 4 * cached["page_cache_misses"]  # the choice is stable
    # grown with k (a fraction of a growing page count): 1.25 x k, rounded up to 16 slots
    for layer in caches[1].layers[1:]:
        k = -(-layer.n_pages // 4)
        assert layer.page_cache.capacity >= math.ceil(1.25 * k)
        assert layer.page_cache.capacity % pagecache.GROW_SLOTS == 0
    assert caches[1].layers[0].page_cache is None  # a dense layer attends every page
    # lossless from then on: the slots are given back, their counts kept
    caches[1].top_k_pages = None
    full_mask = torch.cat((mask, torch.ones(batch, 70, dtype=mask.dtype)), 1)
    with torch.no_grad():
        model(t2[:, -1:], attention_mask=full_mask, **cache_kwargs(model, caches[1]))
    after = caches[1].stats()
    assert after["page_cache_bytes"] == 0 and after["page_cache_hits"] == cached["page_cache_hits"]


def test_a_new_host_chunk_gives_the_page_cache_a_new_view_even_at_a_reused_id(monkeypatch):
    # a host chunk opened during decoding rebuilds the layer's host view; the page cache's view
    # (host pages and slots) follows it even where the new view came at the freed one's id
    # (simulated: every object's id the same), so pages of the new chunk are read from it
    monkeypatch.setattr(pagecache, "id", lambda obj: 0, raising=False)
    model = tiny_model(layers=2)
    ids = torch.randint(1, 256, (1, 300), generator=torch.Generator().manual_seed(3))
    runs, caches = [], []
    for multiple in (0, 1.5):
        cache = TieredCache.for_model(model, gpu_tokens=64, sink_tokens=4, page_tokens=16,
                                      top_k_pages=0.25, dense_layers=1, chunk_pages=2,
                                      page_cache=multiple)
        cache.fused = False  # the torch path (the CPU)
        runs.append(greedy(model, ids, None, cache, 80))  # 80 steps: 5 pages, 2-3 new chunks
        caches.append(cache)
    (t1, l1), (t2, l2) = runs
    layer = caches[1].layers[1]
    assert len(layer.chunks) > 8  # chunks were opened during the decode
    assert layer.page_cache._span.pages == sum(c.capacity for c in layer.chunks)
    assert torch.equal(t1, t2) and torch.equal(l1, l2)


def test_page_cache_setting_is_validated():
    for bad in (0.5, -1, True, "1.25", float("nan"), "Auto", "all"):
        with pytest.raises(ConfigError) as e:
            TieredCache(1, kv_heads=H, head_dim=D, top_k_pages=2, page_cache=bad)
        assert e.value.key == "page_cache" and "'auto'" in str(e.value)
    for ok, kept in ((None, 0.0), (0, 0.0), (1, 1.0), (2.5, 2.5), ("auto", "auto")):
        assert TieredCache(1, kv_heads=H, head_dim=D, top_k_pages=2, page_cache=ok).page_cache == kept


def test_spilled_pages_or_a_refused_view_leave_the_layer_without_slots(tmp_path, monkeypatch,
                                                                      caplog):
    # with a spilled chunk (no single view of the host pages) or a view of host pages and slots
    # refused, a layer fetches its chosen pages as without the cache: same tokens, slots freed
    import deepseek_flash.kv.span as span

    model = tiny_model(layers=3)
    ids = torch.randint(1, 256, (1, 600), generator=torch.Generator().manual_seed(3))
    opts = dict(gpu_tokens=32, page_tokens=16, top_k_pages=0.25, dense_layers=1)
    want, _ = greedy(model, ids, None, TieredCache.for_model(model, page_cache=0, **opts), 6)
    spilled = TieredCache.for_model(model, host_bytes=64 << 10, spill_dir=tmp_path, **opts)
    got, _ = greedy(model, ids, None, spilled, 6)
    assert torch.equal(got, want)
    s = spilled.stats()
    assert s["chunks_spilled"] > 0 and s["page_cache_bytes"] == 0
    assert all(layer.page_cache is None or layer.page_cache.refused
               for layer in spilled.layers[1:])

    real = span.HostSpan

    def no_slots(*args, extra=None, **kw):
        if extra is not None:
            raise RuntimeError("refused for the test")
        return real(*args, **kw)

    monkeypatch.setattr(span, "HostSpan", no_slots)
    refused = TieredCache.for_model(model, **opts)
    with caplog.at_level("WARNING", logger="deepseek_flash.kv.cache"):
        got, _ = greedy(model, ids, None, refused, 6)
    assert torch.equal(got, want)
    assert caplog.text.count("page cache's slots") == 2  # once per top-K layer
    s = refused.stats()
    assert s["page_cache_bytes"] == 0 and s["page_cache_hits"] == s["page_cache_misses"] == 0


@pytest.mark.parametrize("setting, unbounded", [(4.0, 32), ("auto", 48)])
def test_the_device_budget_bounds_the_slots_and_turns_off_a_cache_that_cannot_hold_k(
        monkeypatch, caplog, setting, unbounded):
    # kv/pagecache.py, device_budget: every top-K layer's share of DEVICE_SHARE of the device
    # memory free when the first slots are made bounds its slots below page_cache x k; a share
    # smaller than k slots leaves the page cache off (logged once); the tokens never change
    model = tiny_model(layers=3)
    ids, mask = padded_prompt(1)
    budgets = []
    runs, caches = [], []
    for slots in (None, 20, 5):  # per layer: no budget (the CPU), 20 slots, fewer than k
        def budget(device, slots=slots):
            budgets.append(device.type)
            return None if slots is None else slots * 2 * pagecache.slot_bytes(layer_of[0])
        monkeypatch.setattr(pagecache, "device_budget", budget)
        import deepseek_flash.kv.cache as kvcache
        monkeypatch.setattr(kvcache, "device_budget", budget)
        cache = TieredCache.for_model(model, gpu_tokens=64, sink_tokens=4, page_tokens=32,
                                      top_k_pages=0.25, dense_layers=1, page_cache=setting)
        layer_of = [cache.layers[1]]
        with caplog.at_level("INFO", logger="deepseek_flash.kv.cache"):
            runs.append(greedy(model, ids, mask, cache, 40))
        caches.append(cache)
    assert budgets == ["cpu"] * 3  # asked once per cache
    (t0, l0), (t1, l1), (t2, l2) = runs
    assert torch.equal(t0, t1) and torch.equal(l0, l1) and torch.equal(t0, t2) and torch.equal(l0, l2)
    free, capped, off = caches
    for layer in free.layers[1:]:  # 4 x k (k = 7 of 27 pages) or every page and an eighth
        k = -(-layer.n_pages // 4)  # more (at least 16), rounded up to 16
        assert k == 7 and layer.page_cache.limit is None
        assert layer.page_cache.capacity == unbounded
    for layer in capped.layers[1:]:  # 20 slots allowed: 16, the multiple of 16 below (>= k)
        assert layer.page_cache.limit == 20 and layer.page_cache.capacity == 16
    assert all(layer.page_cache.refused for layer in off.layers[1:])
    assert off.stats()["page_cache_bytes"] == 0 and off.stats()["page_cache_hits"] == 0
    assert caplog.text.count("does not fit the device budget") == 1
