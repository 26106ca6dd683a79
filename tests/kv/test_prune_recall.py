"""What a pruned cache's recall moves per decode step (tiny random models): one copy or gather per
level and layer, exactly the bytes of the recalled pages -- never one operation per page, never
more bytes than the pages attended. Guards the H200 regression where pruning decoded at 0.18x the
tiered cache alone (docs/benchmarks.md, kv_prune Show)."""
import pytest
import torch

from deepseek_flash.kv import TieredCache
from deepseek_flash.kv.prune.compress import compressed_bytes
from deepseek_flash.kv.prune.rows import HostRows
from deepseek_flash.kv.prune.state import split_k
from deepseek_flash.kv.select import resolve_top_k

from kvmodels import tiny_model

PAGE = 16
PAGE_BYTES = 2 * 2 * PAGE * 16 * 4      # K and V, 2 kv heads x 16 channels, fp32
INT4_BYTES = compressed_bytes(2, PAGE, 16)


@pytest.fixture(scope="module")
def model3():
    return tiny_model("llama", layers=3, seed=2)


class Fixed:
    def __init__(self, value):
        self.value = value

    def __call__(self, inp):
        return torch.full_like(inp.mass, self.value)


def ids_of(n, batch=1, seed=0):
    return torch.randint(1, 250, (batch, n), generator=torch.Generator().manual_seed(seed))


def _expected(cache, batch):
    """Copies and bytes the next decode step's recall must take, from the levels now."""
    copies = nbytes = pages = 0
    for layer in cache.layers:
        n2, n3 = len(layer.prune.l2), len(layer.prune.l3)
        k = None if layer.dense else resolve_top_k(cache.top_k_pages, n2 + n3)
        k2, k3 = (n2, n3) if k is None else split_k(k, [n2, n3, 0])[:2]
        copies += (k2 > 0) + (k3 > 0)
        nbytes += batch * (k2 * PAGE_BYTES + k3 * INT4_BYTES)
        pages += batch * (k2 + k3)
    return copies, nbytes, pages


@pytest.mark.parametrize("top_k", [None, 0.25])
def test_each_step_moves_exactly_the_recalled_pages_in_one_operation_per_level(model3, top_k):
    batch = 2
    # threshold 1.0: every page is demoted at the prefill's evaluation (level 2), compressed two
    # steps later (level 3); new pages join level 1 and go down after them: both levels in use
    cache = TieredCache.for_model(model3, prune_threshold=1.0, page_tokens=PAGE, prune_every=2,
                                  top_k_pages=top_k, dense_layers=1)
    ids = ids_of(300, batch=batch, seed=7)
    seen_both = False
    with torch.no_grad():
        model3(ids[:, :260], cache=cache)  # 4 sinks + 64 recent + 12 pages of 16
        for t in range(260, 300):
            want = _expected(cache, batch)
            before = cache.stats()
            model3(ids[:, t:t + 1], cache=cache)
            s = cache.stats()
            got = (s["recall_copies"] - before["recall_copies"],
                   s["recall_bytes"] - before["recall_bytes"], s["recalls"] - before["recalls"])
            assert got == want, (t, got, want)
            assert s["pages_fetched"] - before["pages_fetched"] == want[2]
            # at most one operation per level and layer, however many pages are recalled
            assert got[0] <= 2 * 3
            seen_both |= all(len(x.prune.l2) and len(x.prune.l3) for x in cache.layers)
    assert seen_both
    assert s["recalls"] > 0 and s["recall_bytes"] > 0


def test_top_k_gather_of_level_two_equals_the_tiered_cache_alone(model3):
    """Every page at level 2 (threshold 1.0, no evaluation after the prefill's): top-K recall
    picks the same pages by the same scores as the tiered cache without pruning and gathers them
    per sequence -- the same logits."""
    ids = ids_of(210, batch=2, seed=3)  # 8 pages after the prefill; no new page in 10 steps
    outs = []
    for prune in (None, 1.0):
        cache = TieredCache.for_model(model3, prune_threshold=prune, page_tokens=PAGE,
                                      top_k_pages=3, gpu_tokens=64, prune_every=10_000,
                                      dense_layers=1)
        logits = []
        with torch.no_grad():
            logits.append(model3(ids[:, :200], cache=cache).logits[:, -1])
            for t in range(200, 210):
                logits.append(model3(ids[:, t:t + 1], cache=cache).logits[:, -1])
        if prune is not None:
            assert all(x.prune.level_pages()[0] == 0 for x in cache.layers)
            assert all(len(x.prune.l2) == 8 for x in cache.layers)
            # per step: the dense layer copies its 8 pages, two layers gather 3 per sequence
            assert cache.stats()["recall_copies"] == 10 * (1 + 2 * 1)
            assert cache.stats()["recall_bytes"] == 10 * 2 * (8 + 2 * 3) * PAGE_BYTES
        outs.append(torch.stack(logits))
    assert (outs[0] - outs[1]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("k, sizes, want", [
    (4, [8, 8, 0], [2, 2, 0]),
    (3, [8, 8, 0], [2, 1, 0]),      # a tie goes to the earlier store
    (1, [0, 4, 0], [0, 1, 0]),
    (5, [1, 9, 0], [1, 4, 0]),      # 0.5 / 4.5: remainders tie, the earlier store first
    (5, [1, 19, 0], [0, 5, 0]),     # 0.25 / 4.75
    (10, [2, 3, 1], [2, 3, 1]),     # more than the stores hold: all of them
    (2, [0, 0, 0], [0, 0, 0]),
])
def test_split_k(k, sizes, want):
    got = split_k(k, sizes)
    assert got == want and sum(got) == min(k, sum(sizes))
    assert all(g <= n for g, n in zip(got, sizes))


def test_host_rows_put_remove_gather_and_bounded_capacity():
    rows = HostRows(row_bytes=24, batch=2, device=torch.device("cpu"))
    data = {pg: torch.full((2, 24), pg, dtype=torch.uint8) + torch.arange(2)[:, None] * 100
            for pg in range(10)}
    rows.put([0, 1, 2], torch.cat([data[pg] for pg in (0, 1, 2)]))
    assert rows.capacity == 3 and rows.nbytes() == 3 * 2 * 24
    rows.put([3], data[3])
    assert rows.capacity == 6 and len(rows) == 4
    rows.remove([1])  # the last page (3) moves into page 1's slot
    assert rows.pages == [0, 3, 2] and rows.slot == {0: 0, 3: 1, 2: 2}
    assert torch.equal(rows.rows([2, 0]), torch.cat([data[2], data[0]]))
    assert torch.equal(rows.all(), torch.cat([data[pg] for pg in (0, 3, 2)]))
    # gather: row slot * batch + sequence, indices as given
    idx = torch.tensor([1 * 2 + 1, 0 * 2 + 0, 2 * 2 + 1])
    assert torch.equal(rows.gather(idx), torch.stack([data[3][1], data[0][0], data[2][1]]))
    assert rows.ids().tolist() == [0, 3, 2]
    rows.remove([0, 2])  # a quarter of the capacity or less left: the buffer halves
    assert rows.pages == [3] and rows.capacity == 2
    assert torch.equal(rows.all(), data[3])
    rows.remove([3])
    assert rows.capacity == 0 and rows.nbytes() == 0 and rows.buf is None


def op_counter():
    """A dispatch mode counting the tensor operations run under it by name (``.ops``), views
    apart: they move nothing (and slice or alias by the shapes)."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    return Count()


@pytest.mark.parametrize("top_k", [None, 0.25])
def test_a_decode_step_runs_as_many_tensor_operations_at_any_context(model3, top_k):
    """The tensor operations of one decode step (between evaluations) do not grow with the number
    of demoted pages: no loop over pages anywhere in the step."""
    counts = []
    for pages in (6, 30):
        prompt = 4 + 64 + pages * PAGE
        cache = TieredCache.for_model(model3, prune_threshold=1.0, page_tokens=PAGE,
                                      prune_every=4, top_k_pages=top_k, dense_layers=1)
        ids = ids_of(prompt + 6, seed=11)
        with torch.no_grad():
            model3(ids[:, :prompt], cache=cache)
            for t in range(prompt, prompt + 5):  # the 4th step's evaluation compresses to int4
                model3(ids[:, t:t + 1], cache=cache)
            assert all(len(x.prune.l3) == pages for x in cache.layers)
            with op_counter() as c:
                model3(ids[:, prompt + 5:prompt + 6], cache=cache)
        counts.append(c.ops)
    assert counts[0] == counts[1]


def test_lossless_recall_rows_copied_ahead_are_used_and_change_nothing(model3, monkeypatch):
    """During a decode step each layer copies the next layer's demoted rows ahead (on a GPU: on
    the copy stream, overlapping its own compute); the next layer uses them when its stores did
    not change in between -- the same logits as copying at the step, the same bytes counted."""
    from deepseek_flash.kv.prune.state import LayerPrune

    ids = ids_of(300, batch=2, seed=5)

    def run():
        cache = TieredCache.for_model(model3, prune_threshold=1.0, page_tokens=PAGE,
                                      prune_every=3)
        logits = []
        with torch.no_grad():
            logits.append(model3(ids[:, :260], cache=cache).logits[:, -1])
            for t in range(260, 300):
                logits.append(model3(ids[:, t:t + 1], cache=cache).logits[:, -1])
        return torch.stack(logits), cache.stats()

    taken = []
    real = LayerPrune._take_ahead

    def spy(self):
        got = real(self)
        taken.append(got is not None)
        return got

    monkeypatch.setattr(LayerPrune, "_take_ahead", spy)
    ahead, s_ahead = run()
    # every layer's decode steps but the first layer's first one (nothing was copied ahead yet)
    # and those after an evaluation changed its stores
    assert sum(taken) >= 40 * 3 // 2 and not all(taken)
    monkeypatch.setattr(LayerPrune, "prefetch", lambda self: None)
    plain, s_plain = run()
    assert torch.equal(ahead, plain)
    assert (s_ahead["recall_bytes"], s_ahead["recalls"]) == (s_plain["recall_bytes"],
                                                             s_plain["recalls"])


def test_an_evaluation_runs_as_many_tensor_operations_at_any_context(model3):
    """An evaluation step (every layer's levels moved: pages compressed 2 -> 3 and new pages
    1 -> 2) runs the same tensor operations and host reads of a scalar at 6 and at 30 demoted
    pages per layer: the pages to move are found with one mask each, not one read per page, the
    host rows move in one indexed copy, and the layers' scores come to the host together."""
    counts = []
    for pages in (6, 30):
        prompt = 4 + 64 + pages * PAGE
        cache = TieredCache.for_model(model3, prune_threshold=1.0, page_tokens=PAGE,
                                      prune_every=4, dense_layers=1)
        ids = ids_of(prompt + 4, seed=3)
        with torch.no_grad():
            model3(ids[:, :prompt], cache=cache)  # evaluation: every page 1 -> 2
            for t in range(prompt, prompt + 3):
                model3(ids[:, t:t + 1], cache=cache)
            assert all(len(x.prune.l2) == pages and not len(x.prune.l3) for x in cache.layers)
            with op_counter() as c:  # the 4th step evaluates: every level-2 page -> 3
                model3(ids[:, prompt + 3:prompt + 4], cache=cache)
            assert all(len(x.prune.l3) == pages for x in cache.layers)
        counts.append(c.ops)
    assert counts[0] == counts[1]
    assert counts[0]["aten::_local_scalar_dense"] <= 3 * 6, counts[0]


@pytest.mark.parametrize("moves", ["host", "device", "pool"])
def test_host_rows_remove_keeps_every_page_and_the_slot_order(moves, monkeypatch):
    """Removals of any pages keep every other page's bytes, and the slots follow the rule (freed
    slots from the highest down, each filled by the page then last) -- what lossless recall's
    column order, and so the logits, depend on. ``device``: the pages moved by the kernels'
    path (on a GPU over the page-locked buffer; here its index arithmetic on the CPU), the first
    move read back and checked. ``pool``: the buffers from a ``HostPool`` (as page-locked ones
    are) shared with a second store that churns beside it: every resize takes a recycled range
    (pre-filled with other bytes), and neither store sees the other's."""
    gen = torch.Generator().manual_seed(0)
    pool = other = None
    if moves == "pool":
        from deepseek_flash.hostpool import HostPool, pageable_slab

        def garbage(n):
            t, release = pageable_slab(n)
            return t.fill_(0xEE), release

        pool = HostPool(4096, garbage, sync=lambda: None)
        other = HostRows(row_bytes=8, batch=2, device=torch.device("cpu"), pool=pool)
    rows = HostRows(row_bytes=8, batch=2, device=torch.device("cpu"), pool=pool)
    if moves == "device":
        rows.MOVE_DEVICES = ("cpu",)
        monkeypatch.setattr(HostRows, "verified", set())  # the first move's check runs here
    data = {pg: torch.randint(0, 255, (2, 8), generator=gen, dtype=torch.uint8)
            for pg in range(200)}
    order, nxt = [], 0
    for _ in range(30):
        n_put = int(torch.randint(1, 12, (), generator=gen))
        new = list(range(nxt, nxt + n_put))
        nxt += n_put
        rows.put(new, torch.cat([data[pg] for pg in new]))
        order += new
        if other is not None:  # the other store grows and shrinks through the same pool
            other.put([nxt], torch.full((2, 8), 0x55, dtype=torch.uint8))
            if len(other) > 5:
                other.remove(list(other.pages[:4]))
        k = int(torch.randint(0, len(order) + 1, (), generator=gen))
        gone = [order[i] for i in torch.randperm(len(order), generator=gen)[:k].tolist()]
        rows.remove(gone)
        for slot in sorted((order.index(pg) for pg in gone), reverse=True):  # the rule
            last = order.pop()
            if slot < len(order):
                order[slot] = last
        assert rows.pages == order and rows.slot == {pg: i for i, pg in enumerate(order)}
        if order:
            assert torch.equal(rows.all(), torch.cat([data[pg] for pg in order]))
            assert rows._moves_failed is False
            assert rows.capacity < 4 * len(order)  # a quarter or less in use: it halved
        else:
            assert rows.capacity == 0 and rows.buf is None
    assert rows._moves_checked is (moves == "device")
    if moves == "device":  # checked once per device and pool: a second store skips the check
        assert ("move", "cpu", id(None)) in HostRows.verified
        again = HostRows(row_bytes=8, batch=2, device=torch.device("cpu"))
        again.MOVE_DEVICES = ("cpu",)
        again.put([0, 1], torch.cat([data[0], data[1]]))
        again.remove([0])
        assert again._moves_checked and again.pages == [1]
        assert torch.equal(again.all(), data[1])
    if pool is not None:
        assert torch.equal(other.all(), torch.full((len(other) * 2, 8), 0x55, dtype=torch.uint8))
        assert pool.stats()["syncs"] > 0  # ranges given up by resizes were taken again


def test_an_evaluation_moves_its_pages_in_bounded_groups_with_the_same_bytes(model3, monkeypatch):
    """``evaluate_due`` holds at most ``EVAL_BYTES`` of moving pages and compresses at most
    ``COMPRESS_BYTES`` of them per call (the first decode evaluation at 32K compressed every
    layer's pages at once: ~15 GB of GPU memory on the H200): with budgets of a few pages the
    logits, the levels and every host row are those of one group per evaluation."""
    from deepseek_flash.kv.prune import state

    ids = ids_of(300, batch=2, seed=4)
    real, real_groups = state.compress_pages, state._groups
    runs = []
    for small in (False, True):
        sizes = []
        if small:
            monkeypatch.setattr(state, "EVAL_BYTES", 5 * 2 * PAGE_BYTES)       # 5 pages, 2 seqs
            monkeypatch.setattr(state, "COMPRESS_BYTES", 2 * 2 * PAGE_BYTES)   # 2 pages, 2 seqs
        monkeypatch.setattr(state, "compress_pages",
                            lambda x: sizes.append(x.numel() * x.element_size()) or real(x))
        groups = []
        monkeypatch.setattr(state, "_groups",
                            lambda *a, got=groups: got.append(real_groups(*a)) or got[-1])
        cache = TieredCache.for_model(model3, prune_threshold=1.0, page_tokens=PAGE,
                                      prune_every=2, dense_layers=0)
        with torch.no_grad():
            logits = [model3(ids, cache=cache).logits[:, -1]]
            for t in range(6):
                logits.append(model3(logits[-1].argmax(-1, keepdim=True), cache=cache).logits[:, -1])
        rows = [(layer.prune.l2.pages, layer.prune.l3.pages, layer.prune.l3.all().clone())
                for layer in cache.layers]
        runs.append((torch.stack(logits), rows, cache.stats()["level_tokens"], sizes, groups))
    (l1, r1, lv1, s1, g1), (l2, r2, lv2, s2, g2) = runs
    assert torch.equal(l1, l2) and lv1 == lv2
    for (a2, a3, ab), (b2, b3, bb) in zip(r1, r2):
        assert a2 == b2 and a3 == b3 and torch.equal(ab, bb)
    assert sum(lv[2] for lv in lv2) > 0                  # pages did go to level 3
    assert max(s1) > 2 * 2 * PAGE_BYTES                  # one call held every layer's pages
    assert max(s2) <= 2 * 2 * PAGE_BYTES and len(s2) > len(s1)
    # the prefill's evaluation (every page leaves level 1) in one group, then in several
    assert len(g1[0]) == 1 and len(g2[0]) == 3 and len(g1) == len(g2)
