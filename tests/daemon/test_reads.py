"""The read pipeline: reads go to the IO engine in chunks, most urgent first, so an acquire with a
higher ``priority`` is read before the rest of a cold load that was asked for earlier."""
import threading
import time

import pytest

from deepseek_flash._core import HostArena, IOEngine
from deepseek_flash.daemon.block_manager import BlockManager
from deepseek_flash.daemon.config import FlashConfig
from deepseek_flash.store import Store


class GatedEngine:
    """The real IOEngine behind a gate: ``submit`` records what was handed over, ``wait`` returns
    only once the test has opened that batch -- so the order of submissions can be read at every
    moment, without timing."""

    queue_depth = 1
    request_size = 4096

    def __init__(self):
        self.real = IOEngine()
        self.cond = threading.Condition()
        self.submitted: list[list[int]] = []      # file offsets of each batch, in submission order
        self.requests = {}
        self.opened = 0

    def submit(self, requests):
        with self.cond:
            batch = len(self.submitted)
            self.submitted.append([r.offset for r in requests])
            self.requests[batch] = requests
            self.cond.notify_all()
            return batch

    def wait(self, batch, timeout=None):
        with self.cond:
            assert self.cond.wait_for(lambda: self.opened > batch, timeout=30), f"batch {batch} never opened"
            requests = self.requests.pop(batch)
        return self.real.wait(self.real.submit(requests))

    def open(self, n=1):
        with self.cond:
            self.opened += n
            self.cond.notify_all()

    def batches_submitted(self, n):
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.submitted) >= n, timeout=30)
            return [list(b) for b in self.submitted]


@pytest.fixture
def gated(tiny_store):
    engine = GatedEngine()
    config = FlashConfig.from_dict({"prefetch_window": 0, "eviction_threshold": 1.0,
                                    "store_roots": [str(tiny_store.parent)]})
    manager = BlockManager(config, HostArena(8 << 20), engine)
    yield manager, engine, Store.open(tiny_store)
    engine.open(1 << 20)
    manager.close()


def layer_blocks(store, *layers):
    return [b for b in store.blocks if b.layer in layers]


def test_a_priority_acquire_is_read_before_the_rest_of_an_earlier_load(gated):
    manager, engine, store = gated
    manager.reads.chunk_bytes = 1          # one block per chunk
    manager.reads.inflight_bytes = 1       # one chunk in the engine at a time
    manager.open_model(0, "tiny")
    cold = layer_blocks(store, 0, 1, 2)
    urgent = layer_blocks(store, 3)
    slow = manager.acquire_async(0, "tiny", blocks=[b.id for b in cold])
    fast = manager.acquire_async(0, "tiny", blocks=[b.id for b in urgent], priority=5)
    # Only the cold load's first block went to the engine; everything else waits in the pipeline.
    assert engine.batches_submitted(1) == [[cold[0].offset]]
    # Then, one at a time as each read completes: the urgent blocks, in file order, and only then
    # the rest of the cold load.
    engine.open(1 + len(urgent))
    lease = fast.result(timeout=30)
    order = engine.batches_submitted(2 + len(urgent))
    assert order[1:1 + len(urgent)] == [[b.offset] for b in urgent]
    assert order[1 + len(urgent)] == [cold[1].offset]
    assert not slow.done()
    assert set(lease.blocks) == {b.id for b in urgent}
    for b in urgent:
        assert bytes(manager.arena.view(lease.blocks[b.id], b.length)) == store.read_block(b.id)
    engine.open(len(cold))
    slow_lease = slow.result(timeout=30)
    assert sorted(sum(engine.submitted, [])) == sorted(b.offset for b in cold + urgent)
    assert [o for batch in engine.submitted[1 + len(urgent):] for o in batch] == [b.offset for b in cold[1:]]
    for b in cold:
        assert bytes(manager.arena.view(slow_lease.blocks[b.id], b.length)) == store.read_block(b.id)
    assert manager.reads.inflight == 0


def test_equal_priority_keeps_arrival_order_and_small_reads_stay_one_batch(gated):
    manager, engine, store = gated
    manager.open_model(0, "tiny")
    first = manager.acquire_async(0, "tiny", blocks=[b.id for b in layer_blocks(store, 2)])
    second = manager.acquire_async(0, "tiny", blocks=[b.id for b in layer_blocks(store, 0)])
    engine.open(2)
    first.result(timeout=30), second.result(timeout=30)
    # Default chunking (8 MiB) and in-flight bound (several chunks): each acquire one engine batch,
    # both handed over at once, in arrival order.
    assert engine.submitted == [[b.offset for b in layer_blocks(store, 2)],
                                [b.offset for b in layer_blocks(store, 0)]]


def test_a_load_reads_with_the_priority_of_the_attach_that_started_it(gated):
    from deepseek_flash.daemon.loader import Loader

    manager, engine, store = gated
    manager.reads.chunk_bytes = 1
    manager.reads.inflight_bytes = 1
    cid = manager.connect({"name": "t"})
    info = manager.open_model(cid, "tiny")
    cold = layer_blocks(store, 0, 1, 2)
    slow = manager.acquire_async(cid, "tiny", blocks=[b.id for b in cold])
    assert engine.batches_submitted(1) == [[cold[0].offset]]
    loader = Loader(manager, manager.arena)
    urgent = layer_blocks(store, 3)
    load = loader.attach(cid, info, "cpu", [b.id for b in urgent], priority=5)
    assert load.priority == 5
    # The load's thread queues its stage; wait until it waits in the pipeline, then let reads run.
    deadline = time.monotonic() + 30
    while len(manager.reads._waiting) < len(cold):     # the cold load's rest + the load's first
        assert time.monotonic() < deadline, "the load's reads never queued"
        time.sleep(0.01)
    engine.open(1 + len(urgent))
    load.finished.result(timeout=30)
    assert engine.batches_submitted(1 + len(urgent))[1:1 + len(urgent)] == [[b.offset] for b in urgent]
    assert not slow.done()
    engine.open(len(cold))
    slow.result(timeout=30)
    loader.detach(cid)


@pytest.mark.parametrize("priority", [0, 5])
def test_an_urgent_acquire_moves_its_blocks_ahead_of_what_was_queued_before_them(gated, priority):
    # A cold load is waiting; a prefetch hint (priority 0) then queues layer 3 behind it. An acquire
    # of layer 3 at a higher priority takes those waiting reads ahead of the cold load's rest; at
    # the same priority they keep their place.
    manager, engine, store = gated
    manager.reads.chunk_bytes = 1
    manager.reads.inflight_bytes = 1
    manager.open_model(0, "tiny")
    cold = layer_blocks(store, 0, 1, 2)
    urgent = layer_blocks(store, 3)
    slow = manager.acquire_async(0, "tiny", blocks=[b.id for b in cold])
    assert manager.prefetch("tiny", layers=[3]) == len(urgent)
    fast = manager.acquire_async(0, "tiny", blocks=[b.id for b in urgent], priority=priority)
    assert engine.batches_submitted(1) == [[cold[0].offset]]
    if priority:
        engine.open(2)
        lease = fast.result(timeout=30)
        # The promoted reads form one chunk, in file order, right after the read in flight.
        assert engine.batches_submitted(3)[1:] == [[b.offset for b in urgent], [cold[1].offset]]
        assert not slow.done()
        for b in urgent:
            assert bytes(manager.arena.view(lease.blocks[b.id], b.length)) == store.read_block(b.id)
    engine.open(len(cold) + len(urgent))
    fast.result(timeout=30), slow.result(timeout=30)
    flat = [o for batch in engine.submitted for o in batch]
    if not priority:
        assert flat == [b.offset for b in cold + urgent]
    assert sorted(flat) == sorted(b.offset for b in cold + urgent)
    assert manager.reads.inflight == 0 and manager.reads._waiting == []
