"""Which layer's pages a decode step copies ahead (on CUDA, a copy stream; the choice itself is
the cache's and is checked here on the CPU): lossless, one layer ahead; top-K, the dense layers
of the next step as soon as they have committed this one."""
import torch

from deepseek_flash.kv import TieredCache, cache_kwargs

from kvmodels import tiny_model


def _cache(top_k):
    model = tiny_model("llama", layers=5)
    cache = TieredCache.for_model(model, gpu_tokens=64, page_tokens=32, top_k_pages=top_k,
                                  dense_layers=2)
    ids = torch.randint(1, 256, (1, 400), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        model(ids, **cache_kwargs(model, cache))
    return cache


def _order(cache, every_page, prefetched=()):
    cache._prefetched = {i: None for i in prefetched}
    got = []
    for layer in cache.layers:
        cache._prefetched.pop(layer.index, None)  # the layer takes what was copied for it
        nxt = cache.next_to_prefetch(layer, every_page)
        got.append(None if nxt is None else nxt.index)
        if nxt is not None:
            cache._prefetched[nxt.index] = None
    left = sorted(cache._prefetched)
    cache._prefetched = {}
    return got, left


def test_lossless_copies_one_layer_ahead_and_wraps_to_the_next_step():
    cache = _cache(None)
    every = [layer.reads_every_page() for layer in cache.layers]
    assert every == [True] * 5
    assert _order(cache, every, prefetched=(0,)) == ([1, 2, 3, 4, 0], [0])


def test_mirrored_dense_layers_copy_nothing_and_the_others_stay_two_ahead_at_most():
    # lossless with the two dense layers on the device as well (kv/mirror.py): they copy
    # nothing, and the copies they start do not run further than COPIES_AHEAD layers ahead
    cache = _cache(None)
    every = [False, False, True, True, True]
    assert _order(cache, every, prefetched=(2,)) == ([3, None, 4, 2, 3], [2, 3])
    assert _order(cache, every, prefetched=(2, 3)) == ([None, None, 4, 2, 3], [2, 3])


def test_top_k_copies_its_dense_layers_for_the_next_step_while_the_others_compute():
    cache = _cache(0.25)
    every = [layer.reads_every_page() for layer in cache.layers]
    assert every == [True, True, False, False, False]
    # layer 0 finds layer 1 copied already (by layer 2 of the last step); layer 1 starts layer 0
    # of the next step (committed by then), layer 2 starts layer 1; then nothing is left
    assert _order(cache, every, prefetched=(0, 1)) == ([None, 0, 1, None, None], [0, 1])
    # the first step after the prefill, nothing copied ahead yet: layer 0 starts layer 1 of
    # this step, then the same as every step after
    assert _order(cache, every) == ([1, 0, 1, None, None], [0, 1])


def test_no_pages_no_copy():
    model = tiny_model("llama", layers=3)
    cache = TieredCache.for_model(model, gpu_tokens=64, page_tokens=32)
    ids = torch.randint(1, 256, (1, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        model(ids, **cache_kwargs(model, cache))
    assert cache.layers[1].n_pages == 0
    assert cache.next_to_prefetch(cache.layers[0], [True] * 3) is None


def test_a_graphed_step_starts_the_copies_ahead_only_where_a_layer_copies_every_page(monkeypatch):
    # TieredLayer._before_step (CUDA's page-locked pages; here pinned is set by hand): the copies
    # ahead are asked for only while some layer reads every page or copies are held; a copy
    # made for this layer is dropped (it attends top-K after all)
    cache = _cache(0.25)
    layer = cache.layers[3]
    calls = []
    monkeypatch.setattr(cache, "pinned", True)
    monkeypatch.setattr(cache, "_prefetch_next", lambda lyr: calls.append(("next", lyr.index)))
    monkeypatch.setattr(cache, "_drop_prefetched", lambda lyr: calls.append(("drop", lyr.index)))
    cache._every_page, cache._copies_any, cache._prefetched = [False] * 5, False, {}
    layer._before_step()
    assert calls == []
    cache._copies_any = True
    layer._before_step()
    assert calls == [("next", 3)]
    calls.clear()
    cache._copies_any, cache._prefetched = False, {3: None}
    layer._before_step()
    assert calls == [("drop", 3), ("next", 3)]
    calls.clear()
    cache._prefetched = {0: None}
    layer._before_step()
    assert calls == [("next", 3)]
    # and the cache keeps the flag with the list it summarises (copies already held at the
    # most: nothing more is started)
    from deepseek_flash.kv.cache import COPIES_AHEAD

    cache._every_page, cache._prefetched = [], {i: None for i in range(COPIES_AHEAD)}
    del cache.__dict__["_prefetch_next"]
    cache._prefetch_next(layer)
    assert len(cache._every_page) == 5 and cache._copies_any == (True in cache._every_page)
