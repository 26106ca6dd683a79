"""deepseek_flash/hostpool.py: ranges of slabs allocated once, reused after the last tensor viewing
them is gone (and the device is done), never handed out twice while live."""
import gc

import pytest
import torch

from deepseek_flash.hostpool import ALIGN, HostPool, pageable_slab, pinned_slab

KIB = 1024


class Source:
    """Pageable slabs, counted; released slabs recorded."""

    def __init__(self):
        self.sizes, self.released = [], []

    def __call__(self, nbytes):
        tensor, _ = pageable_slab(nbytes)
        tensor.fill_(0xAB)  # what a recycled range holds before its new owner writes it
        self.sizes.append(nbytes)
        return tensor, lambda: self.released.append(nbytes)


def make(chunk=256 * KIB):
    syncs = []
    src = Source()
    pool = HostPool(chunk, src, sync=lambda: syncs.append(1))
    return pool, src, syncs


def span(t):
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def test_a_dropped_range_is_reused_after_one_sync_and_no_new_slab():
    pool, src, syncs = make()
    a = pool.take(100 * KIB)
    ptr = a.data_ptr()
    assert a.numel() == 100 * KIB and a.dtype == torch.uint8 and ptr % ALIGN == 0
    a.fill_(7)
    del a
    gc.collect()
    b = pool.take(100 * KIB)
    # the free tail served it first: no sync; the dropped range waits
    assert syncs == [] and b.data_ptr() != ptr
    c = pool.take(56 * KIB)  # the rest of the slab: 256 - 100 - 100 rounds to 56
    assert syncs == []
    d = pool.take(100 * KIB)  # only the dropped range fits: the device is waited for once
    assert syncs == [1] and d.data_ptr() == ptr
    assert src.sizes == [256 * KIB] and pool.stats()["slab_allocs"] == 1
    assert torch.equal(d, torch.full((100 * KIB,), 7, dtype=torch.uint8))  # not cleared
    del b, c, d


def test_growth_in_chunks_and_a_large_request_gets_its_own_slab():
    pool, src, _ = make(chunk=256 * KIB)
    held = [pool.take(200 * KIB), pool.take(200 * KIB)]
    assert src.sizes == [256 * KIB, 256 * KIB]
    held.append(pool.take(1000 * KIB + 1))
    assert src.sizes[-1] == 1000 * KIB + ALIGN  # rounded to 4 KiB, larger than a chunk
    assert pool.reserved_bytes() == 512 * KIB + 1000 * KIB + ALIGN
    assert pool.used_bytes() == 400 * KIB + 1000 * KIB + ALIGN
    held.append(pool.take(40 * KIB))  # fits the first slab's tail: no growth
    assert len(src.sizes) == 3


def test_no_range_is_handed_out_twice_while_a_tensor_views_it():
    pool, _, _ = make(chunk=64 * KIB)
    gen = torch.Generator().manual_seed(0)
    live = {}
    for i in range(300):
        if live and torch.rand((), generator=gen) < 0.45:
            key = list(live)[int(torch.randint(len(live), (), generator=gen))]
            del live[key]
            if i % 50 == 0:
                gc.collect()
            continue
        n = int(torch.randint(1, 40 * KIB, (), generator=gen))
        t = pool.take(n)
        t.fill_(i % 251)
        # a view of it alone keeps the range: drop the tensor, keep a slice
        live[i] = t[: max(1, n // 2)] if i % 3 == 0 else t
    spans = sorted(span(t) for t in live.values())
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start
    for i, t in live.items():
        assert torch.equal(t, torch.full_like(t, i % 251))


def test_a_slice_keeps_its_range_after_the_tensor_is_dropped():
    pool, _, _ = make(chunk=64 * KIB)
    a = pool.take(64 * KIB)
    a.fill_(3)
    part = a[4 * KIB:8 * KIB].view(torch.int32)
    ptr = a.data_ptr()
    del a
    gc.collect()
    b = pool.take(64 * KIB)  # the slab's only range is still viewed: a new slab
    assert b.data_ptr() != ptr and pool.stats()["slab_allocs"] == 2
    b.fill_(9)
    assert torch.equal(part, torch.full((KIB,), 0x03030303, dtype=torch.int32))


def test_tensor_shapes_and_dtypes_and_exact_bytes_after_reuse():
    pool, _, _ = make()
    a = pool.tensor((3, 5, 7), torch.bfloat16)
    assert a.shape == (3, 5, 7) and a.dtype == torch.bfloat16 and a.is_contiguous()
    del a
    gc.collect()
    pool.take(pool.chunk_bytes - ALIGN)  # the rest of the slab
    want = torch.randn(64, 33, generator=torch.Generator().manual_seed(1))
    b = pool.tensor((64, 33), torch.float32)  # reuses a's range (and grows past it)
    b.copy_(want)
    other = pool.take(8 * KIB)
    other.fill_(0xFF)
    assert torch.equal(b, want)


def test_trim_gives_back_idle_slabs_only():
    pool, src, syncs = make(chunk=64 * KIB)
    keep = pool.take(10 * KIB)
    gone = pool.take(64 * KIB)
    del gone
    gc.collect()
    assert pool.trim() == 64 * KIB
    assert src.released == [64 * KIB] and syncs == [1]
    assert pool.stats()["slabs"] == 1 and pool.reserved_bytes() == 64 * KIB
    keep.fill_(1)


def test_the_default_slab_is_pageable_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: tests/kv/test_prune_gpu.py covers the page-locked slab")
    tensor, release = pinned_slab(64 * KIB)
    assert release is None and tensor.numel() == 64 * KIB and tensor.data_ptr() % ALIGN == 0
    tensor.fill_(5)
    assert int(tensor.sum()) == 5 * 64 * KIB


def test_the_kv_caches_page_locked_chunks_come_from_the_pool():
    """kv/hostmem.py: a CUDA cache's own host chunks (and, through ``pool()``, pruning's rows) are
    ranges of the pool: a chunk given up is what the next cache's chunk takes."""
    from deepseek_flash.kv.hostmem import OwnMemory

    pool, src, _ = make(chunk=4 * KIB)  # one chunk (4 KiB) fills a slab
    memory = OwnMemory(True, pool)
    assert memory.pool() is pool and OwnMemory(False).pool() is None
    chunk = memory.alloc((4, 2, 8, 16), torch.bfloat16)
    assert chunk.shape == (4, 2, 8, 16) and chunk.dtype == torch.bfloat16
    ptr = chunk.data_ptr()
    del chunk
    again = OwnMemory(True, pool).alloc((4, 2, 8, 16), torch.bfloat16)
    assert again.data_ptr() == ptr and len(src.sizes) == 1


def test_an_arena_cache_takes_its_row_buffers_from_arena_regions():
    """kv/hostmem.py ``ArenaMemory.pool()``: with a controller's host arena (page-locked by the
    client), pruning's row buffers are ranges of arena regions taken 64 MiB at a time and given
    back with the cache; an arena without room falls back to this process's memory."""
    from deepseek_flash.errors import OutOfMemory
    from deepseek_flash.kv.hostmem import POOL_REGION_BYTES, ArenaMemory

    class Client:
        generation = 1

        def __init__(self, size):
            self.arena = torch.zeros(size, dtype=torch.uint8)
            self.next, self.calls = 0, []

        def host_tensor(self, pinned):
            return self.arena

        def call(self, op, args):
            self.calls.append((op, args))
            if op == "kv_alloc":
                if self.next + args["bytes"] > self.arena.numel():
                    raise OutOfMemory("arena full")
                offset, self.next = self.next, self.next + args["bytes"]
                return {"offset": offset}
            return {}

    client = Client(POOL_REGION_BYTES + 4 * KIB)
    memory = ArenaMemory(client, "m", True, {"arena_fallbacks": 0})
    pool = memory.pool()
    assert memory.pool() is pool and ArenaMemory(client, "m", False, {}).pool() is None
    a = pool.take(3 * KIB)
    b = pool.tensor((4, 8), torch.float32)
    lo = client.arena.data_ptr()
    for t in (a, b):  # inside the arena's one region
        assert lo <= t.data_ptr() < lo + POOL_REGION_BYTES
    b.fill_(2.5)
    assert torch.equal(client.arena[4 * KIB:4 * KIB + 128].view(torch.float32),
                       torch.full((32,), 2.5))
    big = pool.take(POOL_REGION_BYTES)  # no room left in the arena: this process's memory
    assert not lo <= big.data_ptr() < lo + client.arena.numel()
    assert memory.counters["arena_fallbacks"] == 1
    memory.close()
    assert ("kv_free", {"offset": 0}) in client.calls
