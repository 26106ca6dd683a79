"""KV pruning on a CUDA device (run on the GPU machine: ``pytest -m gpu tests/kv``): the level-2
and level-3 rows in page-locked host buffers, top-K recall by one gather that the GPU runs over
them, lossless recall copied a layer ahead on the copy stream -- the same logits as recalling
through the host (indices to the host, rows copied, no copy ahead), and, with every page at level
2, the same as the tiered cache's own lossless mode."""
import pytest
import torch

from deepseek_flash.kv import TieredCache
from deepseek_flash.kv.prune.rows import HostRows
from deepseek_flash.kv.prune.state import LayerPrune

from kvmodels import greedy, tiny_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _prompt(batch, n=1500):
    ids = torch.randint(1, 256, (batch, n), generator=torch.Generator().manual_seed(5))
    return ids.cuda(), torch.ones_like(ids).cuda()


@pytest.mark.parametrize("top_k", [None, 0.25])
def test_pruned_recall_on_cuda_equals_recall_through_the_host(top_k, monkeypatch):
    model = tiny_model(layers=3).cuda()
    ids, mask = _prompt(2)
    runs = []
    real = HostRows._device_rows
    for direct in (True, False):
        viewed = []
        if direct:
            monkeypatch.setattr(HostRows, "_device_rows",
                                lambda self: viewed.append(real(self)) or viewed[-1])
        else:
            monkeypatch.setattr(HostRows, "_device_rows", lambda self: None)
            monkeypatch.setattr(LayerPrune, "prefetch", lambda self: None)
        # threshold 1.0, an evaluation every 4 steps: levels 2 and 3 both in use
        cache = TieredCache.for_model(model, prune_threshold=1.0, page_tokens=32,
                                      prune_every=4, top_k_pages=top_k, dense_layers=1)
        runs.append(greedy(model, ids, mask, cache, 24))
        s = cache.stats()
        assert s["recall_copies"] > 0 and s["level_tokens"][1][2] > 0
        if direct:  # the gathers (top-K recall, an evaluation's reads) ran on the device
            assert viewed and all(v is not None and v.is_cuda for v in viewed)
        cache.close()
    (t1, l1), (t2, l2) = runs
    assert torch.equal(t1, t2)
    assert (l1 - l2).abs().max().item() <= 1e-6


def test_level_two_lossless_on_cuda_matches_the_tiered_cache():
    model = tiny_model(layers=3).cuda()
    ids, mask = _prompt(1)
    plain = TieredCache.for_model(model, gpu_tokens=64, page_tokens=32)
    want_tokens, want_logits = greedy(model, ids, mask, plain, 16)
    # every page demoted once after the prefill and never evaluated again: all at level 2
    cache = TieredCache.for_model(model, prune_threshold=1.0, page_tokens=32,
                                  prune_every=10_000)
    tokens, logits = greedy(model, ids, mask, cache, 16)
    assert torch.equal(tokens, want_tokens)
    assert (logits - want_logits).abs().max().item() <= 1e-4
    s = cache.stats()
    assert all(lv[2] == 0 for lv in s["level_tokens"]) and s["recall_bytes"] > 0
    cache.close()


def test_page_moves_in_the_page_locked_rows_run_on_the_gpu_and_keep_every_byte():
    """An evaluation's compaction of a level's host rows runs as one GPU kernel over the
    page-locked buffer (no host memcpy): after any removals every page keeps its bytes and slot
    order, and the first move was read back and matched (no fallback to the host)."""
    gen = torch.Generator().manual_seed(1)
    rows = HostRows(row_bytes=4096 * 3, batch=2, device=torch.device("cuda"))
    data = {pg: torch.randint(0, 255, (2, 4096 * 3), generator=gen, dtype=torch.uint8)
            for pg in range(120)}
    order, nxt = [], 0
    for _ in range(12):
        new = list(range(nxt, nxt + 10))
        nxt += 10
        rows.put(new, torch.cat([data[pg] for pg in new]).cuda())
        order += new
        gone = [order[i] for i in torch.randperm(len(order), generator=gen)[:len(order) // 2]]
        rows.remove(gone)
        for slot in sorted((order.index(pg) for pg in gone), reverse=True):
            last = order.pop()
            if slot < len(order):
                order[slot] = last
        assert rows.pages == order
        assert torch.equal(rows.all().cpu(), torch.cat([data[pg] for pg in order]))
    assert rows._moves_checked and not rows._moves_failed


def test_the_pool_page_locks_once_and_a_second_pruned_cache_reuses_it():
    """Level 2 and 3 rows and the tiered cache's chunks come from this process's page-locked
    pool (deepseek_flash/hostpool.py): its slabs are page-locked (kernels read them at their host
    address), and a second cache of the same shape page-locks nothing new, with the same logits."""
    from deepseek_flash.hostpool import pinned_slab, process_pool

    slab, _ = pinned_slab(1 << 20)
    assert slab.is_pinned()
    del slab
    model = tiny_model(layers=3).cuda()
    ids, mask = _prompt(2)
    pool = process_pool()
    runs = []
    for _ in range(2):
        cache = TieredCache.for_model(model, prune_threshold=1.0, page_tokens=32,
                                      prune_every=4, dense_layers=1)
        runs.append(greedy(model, ids, mask, cache, 12))
        rows = cache.layers[1].prune.l2
        assert rows.pool is pool and rows.buf.is_pinned()
        cache.close()
        del cache, rows
        import gc
        gc.collect()
        if len(runs) == 1:
            slabs = pool.stats()["slab_allocs"]
    assert pool.stats()["slab_allocs"] == slabs
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
