"""The checks of tests/kv/test_kv_fused.py that run kv/fused.py's kernels through Triton's
interpreter: Triton reads ``TRITON_INTERPRET`` when it is imported, so they run in a process of
their own (``python fused_checks.py`` prints each check's outcome as JSON)."""
import contextlib
import json
import os
import sys
import traceback

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import deepseek_flash.kv.fused as fused  # noqa: E402
import deepseek_flash.kv.fused_kernels as fused_kernels  # noqa: E402
import deepseek_flash.kv.graphs as graphs  # noqa: E402
from deepseek_flash.kv import TieredCache  # noqa: E402

from kvmodels import greedy, tiny_model  # noqa: E402


@contextlib.contextmanager
def patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _cache(model, use_fused, **kw):
    cache = TieredCache.for_model(model, gpu_tokens=64, sink_tokens=4, page_tokens=16,
                                  top_k_pages=0.25, dense_layers=1, window_pages=16, **kw)
    cache.fused = use_fused
    return cache


def _prompt(batch, n=560):
    return torch.randint(1, 256, (batch, n), generator=torch.Generator().manual_seed(3))


def _tables(layer):
    """The page cache's tables, the pages in its occupied slots (the others hold whatever the
    allocation held) and its step counter."""
    pc = layer.page_cache
    b = pc.page_of_slot.shape[0]
    held = pc.slots.view(b, pc.capacity, -1)[pc.page_of_slot >= 0]
    return [pc.slot_of_page, pc.page_of_slot, pc.last_used, held, pc.step]


def equals_the_torch_path(batch, steps):
    model = tiny_model(layers=2)
    ids = _prompt(batch)
    runs = []
    for use_fused in (False, True):
        cache = _cache(model, use_fused)
        runs.append((*greedy(model, ids, None, cache, steps), cache))
    (t1, l1, torch_path), (t2, l2, fused_path) = runs
    why = _differs(t1, l1, t2, l2, torch_path, fused_path)
    assert fused_path.layers[1]._fused is not None and torch_path.layers[1]._fused is None
    assert fused_path.layers[0]._fused is None  # a dense layer: the torch path
    assert fused_path.layers[1]._fused.split == fused.SPLIT[0]
    assert torch.equal(t1, t2), why
    diff = (l1 - l2).abs().max().item()
    assert diff <= 1e-5, why
    # the same pages chosen every step: the page cache's tables, slots and counts are the same
    for got, want in zip(_tables(fused_path.layers[1]), _tables(torch_path.layers[1])):
        assert torch.equal(got, want), why
    for key in ("page_cache_hits", "page_cache_misses", "page_cache_step_fetched_bytes"):
        assert fused_path.stats()[key] == torch_path.stats()[key], key
    assert fused_path.stats()["page_cache_misses"] > 0
    w1, w2 = torch_path.layers[1], fused_path.layers[1]
    assert torch.equal(w1.recent_k, w2.recent_k) and torch.equal(w1.recent_v, w2.recent_v)
    if steps > 16:
        # a page boundary crossed (30 -> 31 pages, k still 8): the same fused step serves, its
        # kernels reading the page count from the device (no new step built, no new graph)
        assert w2._fused.n == w2.n_pages == w1.n_pages == 31
        assert w2.fused_builds == 1


def _differs(t1, l1, t2, l2, c1, c2) -> str:
    """What differs between two greedy runs (for a failing check's message): the first step whose
    logits differ and by how much, the tokens there, the page-cache counts of both caches."""
    steps = [i for i in range(min(len(l1), len(l2))) if not torch.equal(l1[i], l2[i])]
    first = steps[0] if steps else None
    out = {"steps_differing": steps, "tokens_equal": torch.equal(t1, t2)}
    if first is not None:
        out["first_max_abs"] = (l1[first] - l2[first]).abs().max().item()
        out["first_argmax"] = (l1[first].argmax(-1).tolist(), l2[first].argmax(-1).tolist())
    for key in ("page_cache_hits", "page_cache_misses"):
        out[key] = (c1.stats()[key], c2.stats()[key])
    return json.dumps(out)


class _Graph:
    def __init__(self, owner):
        self.owner = owner

    def capture_begin(self, pool=None, capture_error_mode="global"):
        pass

    def capture_end(self):
        pass

    def replay(self):
        self.owner._run()


class _Stream:
    def wait_stream(self, other):
        pass


def _graphed_runs(addresses, new_graph=_Graph, steps=4):
    """The same greedy steps with the fused step eager and captured (the graph emulated); the
    step's tensors seen at ``addresses()`` (kv/fused.py ``_addresses``)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(graphs, "applies", lambda device: True))
        stack.enter_context(patched(graphs, "new_graph", new_graph))
        stack.enter_context(patched(torch.cuda, "Stream", lambda *a, **k: _Stream()))
        stack.enter_context(patched(torch.cuda, "current_stream", lambda *a, **k: _Stream()))
        stack.enter_context(patched(torch.cuda, "stream", lambda s: contextlib.nullcontext()))
        stack.enter_context(patched(torch.cuda, "graph_pool_handle", lambda: None))
        stack.enter_context(patched(fused, "_addresses", lambda q, k, v: addresses()))
        model = tiny_model(layers=2)
        ids = _prompt(1)
        runs = []
        for captured in (False, True):
            cache = _cache(model, True)
            cache.select_graphs = captured
            runs.append((*greedy(model, ids, None, cache, steps), cache))
    (t1, l1, eager), (t2, l2, graphed) = runs
    assert torch.equal(t1, t2) and torch.equal(l1, l2), _differs(t1, l1, t2, l2, eager, graphed)
    assert graphed.layers[1]._fused.graph is not None and eager.layers[1]._fused.graph is None
    got, want = _tables(graphed.layers[1]), _tables(eager.layers[1])
    for i in (0, 1, 3):  # where each page is, the pages in the slots
        assert torch.equal(got[i], want[i])
    for key in ("page_cache_hits", "page_cache_misses", "page_cache_step_fetched_bytes"):
        assert graphed.stats()[key] == eager.stats()[key], key
    return graphed.layers[1]._fused, got[4].item() - want[4].item()


def graph_replays_the_eager_launches():
    # new addresses every step: the buffers' graph alone
    seen = iter(range(1 << 30))
    step, extra = _graphed_runs(lambda: (next(seen),) * 3)
    assert step.direct is None and step.seen_at is not None
    # the capture step ran the step again (its counts put back): the step counter is on by
    # those runs (one on CUDA; two here, where the emulated capture runs the step as well)
    assert extra == 2


def direct_graph_replays_the_eager_launches():
    # the step's tensors at the same addresses every step: after two steps at them, the graph
    # over the tensors themselves (no copy into the buffers) serves, the same values
    replays = []

    class Counted(_Graph):
        def replay(self):
            replays.append(type(self.owner).__name__)
            super().replay()

    # decode steps 1-4 (then a page boundary): the fused step built and its buffers' graph
    # captured, the same addresses seen, the graph over them captured, replayed
    step, extra = _graphed_runs(lambda: (16, 32, 48), Counted, steps=5)
    assert step.direct is not None and step.direct_at == (16, 32, 48) and step.live is None
    # the step counter: two more runs in the emulated capture of the buffers' graph, one in that
    # of the direct graph (a capture on CUDA runs nothing)
    assert extra == 3
    assert replays == ["FusedStep", "FusedStep", "FusedStep", "_Direct"], replays


def direct_graph_refused_keeps_the_buffers_graph():
    class Refused(_Graph):
        def __init__(self, owner):
            if type(owner).__name__ == "_Direct":
                raise RuntimeError("capture refused")
            super().__init__(owner)

    step, extra = _graphed_runs(lambda: (16, 32, 48), Refused, steps=5)
    assert step.direct is None and step.direct_failed and extra == 2


def failing_step_leaves_the_torch_path():
    def refuse(*args, **kwargs):
        raise RuntimeError("no kernel for this device")

    model = tiny_model(layers=2)
    ids = _prompt(1)
    want = greedy(model, ids, None, _cache(model, False, page_cache=0), 4)
    with patched(fused.FusedStep, "run", refuse):
        cache = _cache(model, True)
        got = greedy(model, ids, None, cache, 4)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert cache.layers[1]._fused_failed and cache.layers[1].page_cache.refused


@triton.jit
def _ranks(x_ptr, out_ptr, n, NP: tl.constexpr):
    p = tl.arange(0, NP)
    srt = fused_kernels._ranked(tl.load(x_ptr + p), p, p < n, NP)
    tl.store(out_ptr + srt % NP, p.to(tl.int64))


@triton.jit
def _victim_order(st_ptr, held_ptr, out_ptr, C, CP: tl.constexpr):
    c = tl.arange(0, CP)
    stamp = tl.load(st_ptr + c, mask=c < C, other=0)
    held = tl.load(held_ptr + c, mask=c < C, other=0) != 0
    tl.store(out_ptr + c, fused_kernels._victims(stamp, held, c, C, CP) % CP, mask=c < C)


def sorted_rankings_equal_the_comparisons():
    # kv/fused_kernels.py's rankings by one sort (``_ranked``, ``_victims``) against their
    # definition by comparisons, on scores full of ties (and -0.0 beside 0.0, -inf) and on slot
    # stamps with ties, empty and held slots, sizes up to 1,024
    g = torch.Generator().manual_seed(11)
    for np_ in (16, 256, 1024):
        for levels in (2, 7, 1000):
            n = int(torch.randint(1, np_ + 1, (), generator=g))
            x = torch.randint(0, levels, (np_,), generator=g).float() - levels // 2
            x[torch.rand(np_, generator=g) < 0.1] = float("-inf")
            x[x == 0] = torch.where(torch.rand(int((x == 0).sum()), generator=g) < 0.5, -0.0, 0.0)
            got = torch.empty(np_, dtype=torch.int64)
            _ranks[(1,)](x, got, n, NP=np_)
            p = torch.arange(np_)
            v = x[:n]  # rank: valid pages with a higher score, or an equal one and a lower page
            want = ((v[None, :] > v[:, None]) | ((v[None, :] == v[:, None])
                                                 & (p[None, :n] < p[:n, None]))).sum(1)
            assert torch.equal(got[:n], want), (np_, levels)
            cap = int(torch.randint(1, np_ + 1, (), generator=g))
            stamp = torch.randint(-1, levels, (np_,), generator=g)
            held = (torch.rand(np_, generator=g) < 0.3).long()
            out = torch.full((np_,), -1, dtype=torch.int64)
            _victim_order[(1,)](stamp, held, out, cap, CP=np_)
            # empty first, then the least recently chosen, the lower slot first; held slots last
            order = torch.where(held[:cap] != 0, 1 << 41, stamp[:cap])
            want = torch.sort(order, stable=True).indices
            assert torch.equal(out[:cap], want), (np_, levels, cap)


def split(check):
    """``check`` with the choice as three kernels (kv/fused.py ``SPLIT``)."""
    def run():
        with patched(fused, "SPLIT", [True]):
            check()
    return run


CHECKS = {
    "batch1": lambda: equals_the_torch_path(1, 20),
    "batch2": lambda: equals_the_torch_path(2, 4),
    "split1": split(lambda: equals_the_torch_path(1, 20)),
    "split2": split(lambda: equals_the_torch_path(2, 4)),
    "graph": graph_replays_the_eager_launches,
    "direct": direct_graph_replays_the_eager_launches,
    "direct_refused": direct_graph_refused_keeps_the_buffers_graph,
    "failure": failing_step_leaves_the_torch_path,
    "sorts": sorted_rankings_equal_the_comparisons,
}

if __name__ == "__main__":
    torch.set_num_threads(1)
    out = {}
    for name, check in CHECKS.items():
        try:
            check()
            out[name] = "ok"
        except Exception:
            out[name] = traceback.format_exc()
    print(json.dumps(out))
