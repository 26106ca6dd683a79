"""Top-K page selection in a decode step: the right pages of each sequence are fetched and
attended together with sinks, recent and new tokens; fewer pages move."""
import pytest
import torch

from deepseek_flash.kv import TieredCache

from kvmodels import greedy, reference, tiny_model

H, D, P = 2, 8, 16


def _layer_cache(**kw):
    cache = TieredCache(1, kv_heads=H, head_dim=D, gpu_tokens=P, sink_tokens=2, page_tokens=P,
                        dense_layers=0, **kw)
    return cache, cache.layers[0]


def _step(layer, q, k, v):
    layer.update(k, v)
    return layer.attend(None, q, None, D ** -0.5)


def test_topk_attends_the_spiked_page_of_each_sequence():
    torch.manual_seed(0)
    b, n_tokens = 2, 2 + 8 * P + P  # sinks, 8 pages, recent
    keys = torch.randn(b, H, n_tokens, D) * 0.1
    values = torch.randn(b, H, n_tokens, D)
    q = torch.zeros(b, 2 * H, 1, D)
    q[..., 0] = 4.0
    spike = {0: 3, 1: 5}  # page with keys aligned to q in each sequence
    for row, page in spike.items():
        keys[row, :, 2 + page * P:2 + (page + 1) * P, 0] = 3.0
    cache, layer = _layer_cache(top_k_pages=1, page_cache=0)  # every chosen page fetched
    _step(layer, torch.zeros(b, 2 * H, n_tokens, D), keys, values)  # prefill: dense
    assert layer.n_pages == 8 and layer.recent_k.shape[2] == P
    k_new, v_new = torch.randn(b, H, 1, D), torch.randn(b, H, 1, D)
    fetched = cache.counters["pages_fetched"]
    out = _step(layer, q, k_new, v_new)
    assert cache.counters["pages_fetched"] - fetched == b * 1
    for row, page in spike.items():
        cols = list(range(2)) + list(range(2 + page * P, 2 + (page + 1) * P)) + \
            list(range(2 + 8 * P, n_tokens))
        k_all = torch.cat((keys[row:row + 1, :, cols], k_new[row:row + 1]), 2)
        v_all = torch.cat((values[row:row + 1, :, cols], v_new[row:row + 1]), 2)
        want = torch.nn.functional.scaled_dot_product_attention(
            q[row:row + 1], k_all, v_all, scale=D ** -0.5, enable_gqa=True).transpose(1, 2)
        assert torch.allclose(out[row:row + 1], want, atol=1e-6)


def test_topk_covering_every_page_is_lossless():
    torch.manual_seed(1)
    b, n_tokens = 1, 2 + 5 * P + P
    keys, values = torch.randn(b, H, n_tokens, D), torch.randn(b, H, n_tokens, D)
    outs = []
    for k in (None, 5):
        cache, layer = _layer_cache(top_k_pages=k)
        _step(layer, torch.randn(b, 2 * H, n_tokens, D), keys, values)
        torch.manual_seed(2)
        outs.append(_step(layer, torch.randn(b, 2 * H, 1, D), torch.randn(b, H, 1, D),
                          torch.randn(b, H, 1, D)))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("score", ["hybrid", "quest", "windowed", "mass"])
def test_generate_with_topk_fetches_a_quarter(score):
    model = tiny_model("llama", seed=11, layers=3)
    ids = torch.randint(1, 256, (1, 700))
    lossless = TieredCache.for_model(model, gpu_tokens=32, page_tokens=16)
    greedy(model, ids, None, lossless, 4)
    topk = TieredCache.for_model(model, gpu_tokens=32, page_tokens=16, top_k_pages=0.25,
                                 score=score, dense_layers=1, page_cache=0)
    tokens, _ = greedy(model, ids, None, topk, 4)
    assert tokens.shape == (1, 704)
    a, b = lossless.stats(), topk.stats()
    assert a["gpu_bytes"] == b["gpu_bytes"] and a["pages"] == b["pages"]
    pages = (700 - 4 - 32) // 16  # 41 pages per layer, written when the prefill commits
    # 3 decode steps read pages (the prefill found none yet); the recent window stays < 48
    assert a["pages_fetched"] == 3 * 3 * pages
    # the dense layer reads all, the other two ceil(0.25 * 41) = 11 each
    assert b["pages_fetched"] == 3 * pages + 2 * 3 * 11


def test_default_score_is_hybrid():
    cache = TieredCache.for_model(tiny_model("llama", seed=11, layers=1), top_k_pages=0.25)
    assert cache.score == "hybrid"


@pytest.mark.parametrize("batch", [1, 3])
def test_one_gather_fetch_is_the_bytes_of_the_chosen_pages(batch, monkeypatch):
    # pages in 4 host chunks; the single index_select over a view of all chunks (kv/span.py)
    # returns exactly the chosen pages' keys and values, with no host sync, and so does the
    # run-by-run copy it replaces
    torch.manual_seed(3)
    n_tokens = 2 + 11 * P + P
    keys, values = torch.randn(batch, H, n_tokens, D), torch.randn(batch, H, n_tokens, D)
    chosen = torch.stack([torch.randperm(11, generator=torch.Generator().manual_seed(r))[:5]
                          .sort().values for r in range(batch)])
    want_k = torch.stack([torch.cat([keys[r, :, 2 + p * P:2 + (p + 1) * P] for p in chosen[r]], 1)
                          for r in range(batch)])
    want_v = torch.stack([torch.cat([values[r, :, 2 + p * P:2 + (p + 1) * P] for p in chosen[r]], 1)
                          for r in range(batch)])
    for one_gather in (True, False):
        cache = TieredCache(1, kv_heads=H, head_dim=D, gpu_tokens=P, sink_tokens=2, page_tokens=P,
                            dense_layers=0, top_k_pages=5, chunk_pages=3)
        layer = cache.layers[0]
        _step(layer, torch.zeros(batch, 2 * H, n_tokens, D), keys, values)
        assert layer.n_pages == 11 and len(layer.pages.chunks) == 4
        if one_gather:
            def no_sync(*a, **k):
                raise AssertionError("host sync in the one-gather fetch")
            monkeypatch.setattr(torch.Tensor, "tolist", no_sync)
        else:
            layer.pages._span_failed = True
        k, v = layer.pages.fetch_selected(chosen)
        monkeypatch.undo()
        assert (layer.pages._span is not None) == one_gather
        assert torch.equal(k, want_k) and torch.equal(v, want_v)
        assert cache.counters["pages_fetched"] == batch * 5


def _seven_pages_on_the_host(seed):
    """One top-K layer (2 sinks, P tokens on the GPU) after a prefill of seven pages' worth."""
    torch.manual_seed(seed)
    n_tokens = 2 + 6 * P + P
    keys, values = torch.randn(1, H, n_tokens, D), torch.randn(1, H, n_tokens, D)
    cache = TieredCache(1, kv_heads=H, head_dim=D, gpu_tokens=P, sink_tokens=2, page_tokens=P,
                        dense_layers=0, top_k_pages=2)
    layer = cache.layers[0]
    _step(layer, torch.zeros(1, 2 * H, n_tokens, D), keys, values)
    return cache, layer, keys, values


def test_a_view_that_reads_other_bytes_falls_back_to_copies(monkeypatch, caplog):
    # the view's self-check (first page through the view == the page copied) fails: the layer
    # says so once and fetches run by run, with the right bytes
    import deepseek_flash.kv.span as span

    cache, layer, keys, values = _seven_pages_on_the_host(seed=5)
    real = span.raw_view
    monkeypatch.setattr(span, "raw_view", lambda a, n, dev: real(a, n, dev).clone().zero_())
    with caplog.at_level("WARNING", logger="deepseek_flash.kv.cache"):
        k, _ = layer.pages.fetch_selected(torch.tensor([[1, 4]]))
    assert layer.pages._span is None and layer.pages._span_failed
    assert "differs from the page copied" in caplog.text
    want = torch.cat([keys[:, :, 2 + p * P:2 + (p + 1) * P] for p in (1, 4)], 2)
    assert torch.equal(k, want)


def test_a_gather_refused_by_torch_falls_back_to_copies(monkeypatch):
    import deepseek_flash.kv.span as span

    cache, layer, keys, values = _seven_pages_on_the_host(seed=6)
    assert layer.pages.span() is not None  # built (and self-checked) before gather is refused

    def refuse(self, chosen):
        raise RuntimeError("unsupported operation")
    monkeypatch.setattr(span.HostSpan, "gather", refuse)
    _, v = layer.pages.fetch_selected(torch.tensor([[0, 5]]))
    assert layer.pages._span_failed and cache.counters["pages_fetched"] == 2
    assert torch.equal(v, torch.cat([values[:, :, 2:2 + P], values[:, :, 2 + 5 * P:2 + 6 * P]], 2))
