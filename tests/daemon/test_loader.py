"""Device loads: gates open in forward order with offsets written; the GPU copy serves recovery."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from deepseek_flash.daemon.block_manager import BlockManager
from deepseek_flash.daemon.config import FlashConfig
from deepseek_flash.daemon.attachments import Attachments
from deepseek_flash.daemon.loader import Loader
from deepseek_flash.wire import GATE_READY, control_views
from deepseek_flash.prefetch import ForwardOrder

from deepseek_flash import _core
from deepseek_flash.errors import UnknownClient
from deepseek_flash.store import Store


@pytest.fixture
def controller(tiny_store):
    arena = _core.HostArena(16 << 20)
    engine = _core.IOEngine()
    manager = BlockManager(FlashConfig({"host_cache_bytes": 16 << 20}), arena, engine)
    yield manager, arena
    manager.close()
    engine.close()


def test_cpu_load_opens_every_gate_with_the_host_offsets(controller, tiny_store):
    manager, arena = controller
    cid = manager.connect({"name": "t"})
    info = manager.open_model(cid, str(tiny_store))
    loader = Loader(manager, arena)
    load = loader.attach(cid, info, "cpu", [b.id for b in info.blocks])
    load.finished.result(timeout=30)
    gates, offsets = control_views(arena, load.control_offset, load.num_gates, len(info.blocks))
    assert (gates == GATE_READY).all() and load.num_gates == info.num_layers + 2
    store = Store.open(tiny_store)
    for i, block in enumerate(info.blocks):
        got = bytes(arena.view(int(offsets[i]), block.length))
        assert got == store.read_block(block.id)
    assert manager.stats()["active_leases"] == load.num_gates
    loader.detach(cid)
    assert manager.stats()["active_leases"] == 0


def test_a_finished_load_logs_its_bytes_and_duration(controller, tiny_store, caplog):
    """The line a cold-load bench reads to tell the daemon's disk path from the client's wait."""
    import logging
    import os
    import re

    manager, arena = controller
    cid = manager.connect({"name": "t"})
    info = manager.open_model(cid, str(tiny_store))
    loader = Loader(manager, arena)
    with caplog.at_level(logging.INFO, logger="deepseek_flash.loader"):
        load = loader.attach(cid, info, "cpu", [b.id for b in info.blocks])
        load.finished.result(timeout=30)
    nbytes = sum(b.length for b in info.blocks)
    lines = [r.getMessage() for r in caplog.records if " done: " in r.getMessage()]
    assert len(lines) == 1
    m = re.fullmatch(rf"load of {re.escape(info.name)} onto cpu done: (\d+) bytes in "
                     rf"([0-9.]+) s \(([0-9.]+) GB/s\)", lines[0])
    assert m is not None, lines[0]
    assert int(m.group(1)) == nbytes
    assert float(m.group(2)) == pytest.approx(load.seconds, abs=1e-3) and load.seconds > 0
    loader.detach(cid)
    # bench/paths.py reads this line from the daemon's log, and a process's CPU from /proc.
    bench = _bench_paths()
    done = bench.DONE_LINE.search(f"2026-12-01 10:00:00,000 INFO deepseek_flash.loader: {lines[0]}")
    assert done is not None and int(done.group(1)) == nbytes
    assert float(done.group(2)) == pytest.approx(load.seconds, abs=1e-3)
    assert bench._proc_cpu_s(os.getpid()) > 0 and bench._proc_cpu_s(1 << 30) is None


def test_the_paths_bench_reader_refuses_a_file_below_one_extent(tmp_path):
    # bench/paths.py's engine reader beside the imports: a file shorter than its 32 MiB extent
    # gives no requests; it exits naming the file instead of spinning until it is killed.
    import subprocess
    import sys

    small = tmp_path / "small.bin"
    small.write_bytes(b"\0" * 4096)
    done = subprocess.run([sys.executable, "-c", _bench_paths().ENGINE_READER_SCRIPT, str(small), "4",
                           str(1 << 20), "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip() == f"{small}: 4096 bytes, less than one 32 MiB extent to read"


def _bench_paths():
    from deepseek_flash.testing import bench_module

    return bench_module("paths")


def test_gpu_copy_serves_as_a_recovery_source(controller, tiny_store):
    manager, arena = controller
    cid = manager.connect({"name": "t"})
    info = manager.open_model(cid, str(tiny_store))
    store = Store.open(tiny_store)
    block = info.blocks[3]
    device = torch.zeros(1 << 20, dtype=torch.uint8)      # stands in for the GPU arena
    device[4096:4096 + block.length] = torch.from_numpy(
        np.frombuffer(store.read_block(block.id), dtype=np.uint8).copy())
    order = ForwardOrder(info.blocks, info.num_layers)
    gate = next(g for g, ids in enumerate(order.stages) if block.id in ids)
    gates = np.zeros(len(order.stages), dtype=np.uint32)
    placement = SimpleNamespace(offsets={block.id: 4096}, arena=device,
                                events=[SimpleNamespace(synchronize=lambda: None)] * len(gates))
    load = SimpleNamespace(placement=placement, info=info, order=order, gates=gates)
    loader = Loader(manager, arena)
    loader._loads[("m", 0, 1)] = load
    attachments = Attachments(manager, loader)
    dest = bytearray(block.length)
    assert attachments.copy_source(info.name, block, memoryview(dest)) is False   # gate closed
    gates[gate] = GATE_READY
    assert attachments.copy_source(info.name, block, memoryview(dest)) is True
    assert bytes(dest) == store.read_block(block.id)
    assert attachments.copy_source(info.name, info.blocks[4], memoryview(bytearray(10))) is False


def test_device_tier_registers_its_hooks(controller):
    from deepseek_flash.daemon.attachments import build_device_tier

    manager, arena = controller
    attachments = build_device_tier(manager, arena, manager.config)
    assert attachments.copy_source in manager.state.copy_sources
    assert attachments.detach in manager.state.disconnect_hooks
    attachments.close()


class _FakeEvent:
    def record(self, stream=None):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass


class _FakeFabric:
    """A device arena of ``size`` bytes without CUDA: placement, eviction, copies as no-ops."""

    def __init__(self, size):
        from deepseek_flash.daemon.ranges import RangeAllocator

        self.allocator = RangeAllocator(size, 4096, name="fake device")
        self.placements = {}

    def place(self, key, device, blocks, num_layers=None):
        offsets = dict(zip([b.id for b in blocks], self.allocator.alloc_many(b.length for b in blocks)))
        num_layers = 1 + max(b.layer for b in blocks) if num_layers is None else num_layers
        stages = ForwardOrder(blocks, num_layers).stages
        placement = SimpleNamespace(fabric=self, offsets=offsets, events=[_FakeEvent() for _ in stages],
                                    event_handles=[b"" for _ in stages])
        self.placements[key] = placement
        return placement

    def copy_gate(self, placement, gate, host_offsets, lengths, sources=None):
        pass

    def evict(self, key):
        return sum(self.allocator.free(off) for off in self.placements.pop(key).offsets.values())


def test_idle_gpu_model_stays_until_its_memory_is_needed(controller, tmp_path):
    from deepseek_flash.errors import ArenaFull
    from deepseek_flash.store import pack
    from deepseek_flash.testing import make_tiny_model

    manager, arena = controller
    stores = [pack(make_tiny_model(tmp_path / f"src{i}", "llama", num_layers=2, seed=i),
                   tmp_path / f"m{i}") for i in range(3)]
    size = Store.open(stores[0]).total_bytes
    fabric = _FakeFabric(int(size * 2.5))           # room for two models, not three
    loader = Loader(manager, arena, fabric)
    cids = [manager.connect({"name": f"c{i}"}) for i in range(3)]
    infos = [manager.open_model(c, str(s)) for c, s in zip(cids, stores)]
    a = loader.attach(cids[0], infos[0], 0, [b.id for b in infos[0].blocks])
    b = loader.attach(cids[1], infos[1], 0, [b.id for b in infos[1].blocks])
    a.finished.result(timeout=30)
    b.finished.result(timeout=30)
    # The device walk opened every gate and handed every host lease back once copied.
    assert (a.gates == GATE_READY).all() and (b.gates == GATE_READY).all()
    assert not a.leases and not b.leases
    # Both attached: a third model does not fit and nothing may be evicted.
    with pytest.raises(ArenaFull):
        loader.attach(cids[2], infos[2], 0, [b.id for b in infos[2].blocks])
    # The first client leaves: its model stays resident ...
    loader.detach(cids[0])
    assert any(ld is a for ld in loader.loads()) and loader.evictions == 0
    # ... until the third model needs the memory.
    c = loader.attach(cids[2], infos[2], 0, [b.id for b in infos[2].blocks])
    c.finished.result(timeout=30)
    assert loader.evictions == 1
    assert not any(ld is a for ld in loader.loads()) and any(ld is b for ld in loader.loads())
    # A client attaching to the still-resident model joins it: no new copy.
    again = loader.attach(cids[0], infos[1], 0, [x.id for x in infos[1].blocks])
    assert again is b
    loader.close()


def test_a_shared_gpu_load_reads_on_behalf_of_the_client_that_started_it(controller, tiny_store):
    """The load holds its host leases as the daemon, but the profiler must see the reads as the
    attaching client's (its pid), not the daemon's."""
    manager, arena = controller
    fabric = _FakeFabric(64 << 20)
    loader = Loader(manager, arena, fabric)
    cid = manager.connect({"name": "gpu-client", "pid": 424242})
    info = manager.open_model(cid, str(tiny_store))
    load = loader.attach(cid, info, 0, [b.id for b in info.blocks])
    load.finished.result(timeout=30)
    samples = manager.load_samples()
    assert sorted(s[5] for s in samples) == sorted(b.id for b in info.blocks)
    assert {(s[2], s[3]) for s in samples} == {(cid, 424242)}
    assert [s[5] for s in manager.load_samples(pid=424242)] == [s[5] for s in samples]
    loader.close()


class _SlowFirstFabric(_FakeFabric):
    """A device whose arena takes until ``opened`` is set to create (page-locking and allocating
    a large arena take seconds on a real one)."""

    def __init__(self, size):
        super().__init__(size)
        import threading

        self.opened = threading.Event()
        self.created = False

    def ready(self, device):
        return self.created

    def arena(self, device):
        assert self.opened.wait(30)
        self.created = True
        return SimpleNamespace(ipc_descriptor=lambda: {"device": device})

    def place(self, key, device, blocks, num_layers=None):
        self.arena(device)
        return super().place(key, device, blocks, num_layers)

    def close(self):
        pass


class _TwoDeviceFabric(_FakeFabric):
    """Two fake devices, each with its own allocator; slot rings recorded per (owner, device)."""

    def __init__(self, size):
        from deepseek_flash.daemon.ranges import RangeAllocator

        super().__init__(size)
        self.allocators = {d: RangeAllocator(size, 4096, name=f"fake cuda:{d}") for d in (0, 1)}
        self.devices_placed = {}
        self.slots = {}

    def ready(self, device):
        return True

    def arena(self, device):
        return SimpleNamespace(ipc_descriptor=lambda: {"device": device})

    def place(self, key, device, blocks, num_layers=None):
        self.allocator = self.allocators[device]
        self.devices_placed[key] = device
        return super().place(key, device, blocks, num_layers)

    def alloc_slots(self, owner, device, n_slots, slot_bytes):
        self.slots[(owner, device)] = self.allocators[device].alloc_many([slot_bytes] * n_slots)
        return self.slots[(owner, device)]

    def free_slots(self, owner, device):
        for off in self.slots.pop((owner, device)):
            self.allocators[device].free(off)

    def evict(self, key):
        self.allocator = self.allocators[self.devices_placed.pop(key)]
        return super().evict(key)


@pytest.mark.parametrize("devices", [(0, 1), (0, 0)], ids=["two-devices", "two-slices-of-one"])
def test_parts_of_a_split_model_are_loads_of_their_own(controller, tiny_store, devices):
    """``attach`` with ``blocks``/``part`` (load_model's device_map): each part is planned under
    its own budget and placed on its own device -- only its blocks, the gates still the whole
    model's -- with its own slot ring; two parts on one device are two loads."""
    from deepseek_flash.daemon.planner import resident_minimum

    manager, arena = controller
    fabric = _TwoDeviceFabric(64 << 20)
    attachments = Attachments(manager, Loader(manager, arena, fabric), fabric)
    cid = manager.connect({"name": "split"})
    info = manager.open_model(cid, str(tiny_store))
    half = 1                            # part 1: three layers, two slots -> it streams
    first = [b.id for b in info.blocks if b.layer < half and (b.layer >= 0 or b.role == "embed")]
    second = [b.id for b in info.blocks if b.id not in set(first)]
    need = resident_minimum([b for b in info.blocks if b.id in set(second)])
    out0 = attachments.attach(cid, info.name, devices[0], blocks=first, part=0)
    out1 = attachments.attach(cid, info.name, devices[1], weight_budget=need, blocks=second, part=1)
    loads = {ld.control_offset: ld for ld in attachments.loader.loads()}
    load0, load1 = loads[out0["control_offset"]], loads[out1["control_offset"]]
    assert load0 is not load1 and (load0.device, load1.device) == devices
    for load in (load0, load1):
        load.finished.result(timeout=30)
        assert load.num_gates == info.num_layers + 2 and (load.gates == GATE_READY).all()
    assert set(load0.placement.offsets) == set(first)
    plan1 = out1["plan"]
    assert plan1["streamed_layers"] and set(load1.placement.offsets) == set(plan1["resident"])
    assert set(plan1["resident"]) < set(second) and "slots" in out1 and "slots" not in out0
    assert fabric.devices_placed == {k: d for k, d in zip(
        [k for k, ld in attachments.loader._loads.items() if ld in (load0, load1)], devices)}
    assert list(fabric.slots) == [((cid, info.name, 1), devices[1])]
    parts = manager.open_model(cid, str(tiny_store)).plan["parts"]
    assert parts["1"]["device"] == f"cuda:{devices[1]}" and parts["1"]["streamed_layers"]
    attachments.detach(cid, info.name)
    assert fabric.slots == {}          # the ring went; the device loads stay for the next client
    assert len(attachments.loader.loads()) == 2
    attachments.loader.close()


def test_first_attach_to_a_device_does_not_hold_the_caller(controller, tiny_store):
    """While the first attach to a device creates its arena, the controller keeps serving other
    requests; the attach answers once the arena is there, and later attaches answer at once."""
    manager, arena = controller
    fabric = _SlowFirstFabric(64 << 20)
    attachments = Attachments(manager, Loader(manager, arena, fabric), fabric)
    first = manager.connect({"name": "first"})
    other = manager.connect({"name": "other"})
    pending = attachments.attach(first, str(tiny_store), 0)
    assert not pending.done()
    # Meanwhile another client is served: its CPU attach, and a lease.
    info = manager.open_model(other, str(tiny_store))
    cpu = attachments.attach(other, info.name, "cpu")
    cpu = cpu.result(timeout=30) if hasattr(cpu, "result") else cpu
    assert cpu["device"] == "cpu"
    manager.release(other, manager.acquire(other, info.name, layer=0).id)
    assert not pending.done()
    fabric.opened.set()
    out = pending.result(timeout=30)
    assert out["device"] == 0 and out["gpu_arena"] == {"device": 0}
    # The arena exists now: the next attach answers directly.
    again = attachments.attach(other, info.name, 0)
    assert isinstance(again, dict) and again["control_offset"] == out["control_offset"]
    attachments.close()


def test_a_client_gone_during_its_first_attach_is_not_left_attached(controller, tiny_store,
                                                                    monkeypatch):
    import threading

    from deepseek_flash.daemon import planner

    manager, arena = controller
    fabric = _SlowFirstFabric(64 << 20)
    loader = Loader(manager, arena, fabric)
    attachments = Attachments(manager, loader, fabric)
    manager.on_disconnect(attachments.detach)
    planning, go = threading.Event(), threading.Event()
    plan = planner.plan_residency

    def held_plan(*args, **kwargs):
        planning.set()
        assert go.wait(30)
        return plan(*args, **kwargs)

    monkeypatch.setattr(planner, "plan_residency", held_plan)
    cid = manager.connect({"name": "leaves"})
    pending = attachments.attach(cid, str(tiny_store), 0)
    fabric.opened.set()
    assert planning.wait(30)                 # model open, arena made, not yet attached
    manager.disconnect(cid)                  # its disconnect finds nothing attached yet
    go.set()
    pending.result(timeout=30)
    # The load stays resident for the next client, but nobody holds it.
    assert [ld.clients for ld in loader.loads()] == [set()]
    attachments.close()


def test_devices_outside_the_configuration_are_refused(monkeypatch):
    from deepseek_flash.daemon import fabric as fabric_mod

    from deepseek_flash.errors import DeviceError

    monkeypatch.setattr(fabric_mod, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    f = fabric_mod.Fabric(_core.HostArena(1 << 20), 0.5, devices=[0])
    with pytest.raises(DeviceError) as exc:
        f.arena(1)
    assert exc.value.code == 220 and "cuda:1" in str(exc.value) and exc.value.allowed == [0]
    assert fabric_mod.Fabric(_core.HostArena(1 << 20), 0.5).prepare() is None   # nothing configured


def test_read_ahead_starts_the_first_blocks_in_forward_order(controller, tiny_store):
    """Before the device is ready (CUDA starting in the daemon), a first attach reads the model's
    first blocks into the free host arena, so the load finds them read or in flight."""
    manager, arena = controller
    cid = manager.connect({"name": "t"})
    info = manager.open_model(cid, str(tiny_store))
    attachments = Attachments(manager, Loader(manager, arena))
    # The whole model fits the free arena: nothing is read beyond it.
    assert attachments.read_ahead(cid, info.name, weight_budget=None) is None
    order = [b for stage in ForwardOrder(info.blocks, info.num_layers).stages for b in stage]
    length = {b.id: b.length for b in info.blocks}
    fits, room = 0, arena.size
    for bid in order:
        room -= length[bid]
        if room < 0:
            break
        fits += 1
    assert fits > 0
    assert manager.stats()["prefetch_issued"] == fits
    # The blocks read ahead are the ones the load asks for first.
    lease = manager.acquire(cid, info.name, blocks=order[:fits])
    assert set(lease.blocks) == set(order[:fits])
    manager.release(cid, lease.id)
    assert attachments.read_ahead(cid, "no-such-model", weight_budget=None) is None


def test_a_client_leaving_during_a_cpu_load_does_not_wait_for_it(controller, tiny_store, monkeypatch):
    # The server's event loop runs the disconnect: it must not block until the load's reads end.
    import threading
    import time
    from concurrent.futures import Future

    manager, arena = controller
    cid = manager.connect({"name": "t"})
    info = manager.open_model(cid, str(tiny_store))
    held: list[Future] = []
    real_acquire = manager.acquire_async

    def slow_acquire(*args, **kwargs):
        # The load's stage reads stay in flight until the test lets them finish.
        future: Future = Future()
        held.append((future, real_acquire(*args, **kwargs)))
        return future
    monkeypatch.setattr(manager, "acquire_async", slow_acquire)
    control_before = arena.used
    loader = Loader(manager, arena)
    manager.on_disconnect(loader.detach)
    load = loader.attach(cid, info, "cpu", [b.id for b in info.blocks])
    deadline = time.monotonic() + 10
    while not held and time.monotonic() < deadline:
        time.sleep(0.01)
    leaving = threading.Thread(target=manager.disconnect, args=(cid,))
    start = time.monotonic()
    leaving.start()
    leaving.join(2)
    assert not leaving.is_alive(), "disconnect waited for the CPU load"
    assert time.monotonic() - start < 1.0 and loader.loads() == []
    # The held reads are still pending, so the disconnect did not wait for them. The load may end
    # at once (its next acquire names a client that has gone) but only with that typed error.
    assert held and not any(future.done() for future, _ in held)
    if load.finished.done():
        assert isinstance(load.finished.exception(), UnknownClient)
    for future, real in held:                 # the reads land after the client has gone
        error = real.exception(timeout=30)    # (a read still pending at the disconnect fails, typed)
        if error is None:
            future.set_result(real.result())
        else:
            future.set_exception(error)
    load.finished.exception(timeout=30)
    assert_eventually_true(lambda: manager.stats()["active_leases"] == 0)
    assert_eventually_true(lambda: arena.used <= control_before + sum(
        -(-b.length // 4096) * 4096 for b in info.blocks))   # the control page is freed


def assert_eventually_true(predicate, timeout=10.0):
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_the_window_a_client_opened_with_reaches_its_attach_plan(controller, tiny_store):
    """``flash_context={"prefetch_window": 1}`` on open: the attach (which re-opens the model
    inside the controller) plans a ring of two; another client's default open plans three."""
    from deepseek_flash.daemon.planner import plan_residency, resident_minimum

    manager, arena = controller
    attachments = Attachments(manager, Loader(manager, arena, None), None)
    one, default = manager.connect({"name": "one"}), manager.connect({"name": "default"})
    info = manager.open_model(one, str(tiny_store), {"prefetch_window": 1})
    assert info.flash_config["prefetch_window"] == 1
    assert manager.open_model(default, info.name).flash_config["prefetch_window"] == "auto"
    smallest = resident_minimum(info.blocks)
    budget = smallest + plan_residency(info.blocks, smallest, 1).slot_bytes   # room for a third slot
    plans = {}
    for cid in (one, default):
        out = attachments.attach(cid, info.name, "cpu", weight_budget=budget)
        out = out.result(timeout=30) if hasattr(out, "result") else out
        plans[cid] = out["plan"]
    assert (plans[one]["window"], plans[one]["n_slots"]) == (1, 2)
    assert (plans[default]["window"], plans[default]["n_slots"]) == (3, 3)
    # The handle kept its context through the attach's re-open.
    assert manager.open_model(one, info.name).flash_config["prefetch_window"] == 1
    for cid in (one, default):
        attachments.loader.detach(cid)
    assert manager.stats()["active_leases"] == 0


def test_read_ahead_fills_the_free_host_arena_and_the_load_reads_nothing_twice(wide_store):
    """While CUDA starts, a first attach reads ahead into all of the free host arena (more than
    the half a GPU load keeps in flight; a model larger than the arena); the load then takes
    those blocks as they are -- none is evicted before use and re-read -- and reads only the
    rest, its copies lagging (they finish only when waited for) as they may on the device."""
    from deepseek_flash.daemon.host_state import aligned

    arena = _core.HostArena(3 << 20)                  # ~3 of wide's ~964 KiB layers
    engine = _core.IOEngine()
    manager = BlockManager(FlashConfig({"host_cache_bytes": 3 << 20}), arena, engine)
    fabric = _SlowLaggingFabric(64 << 20)
    attachments = Attachments(manager, Loader(manager, arena, fabric), fabric)
    try:
        cid = manager.connect({"name": "first"})
        info = manager.open_model(cid, str(wide_store))
        stages = [s for s in ForwardOrder(info.blocks, info.num_layers).stages if s]
        order = [b for stage in stages for b in stage]
        size = {b.id: aligned(b.length) for b in info.blocks}
        # Whole stages (the rest is read beyond the arena; a layer split between the two would
        # be read twice, its blocks depending on each other).
        fits, room = 0, arena.size
        for stage in stages:
            room -= sum(size[b] for b in stage)
            if room < 0:
                break
            fits += len(stage)
        assert sum(size[b] for b in order[:fits]) > arena.size // 2 and fits < len(order)
        pending = attachments.attach(cid, info.name, 0)
        assert_eventually_true(lambda: manager.stats()["loading_blocks"] == 0)
        assert manager.stats()["prefetch_issued"] == fits
        fabric.opened.set()
        pending.result(timeout=30)
        load = next(iter(attachments.loader.loads()))
        load.finished.result(timeout=30)
        assert (load.gates == GATE_READY).all()
        stats = manager.stats()
        assert stats["prefetch_used"] == fits
        assert stats["bytes_read_nvme"] == sum(b.length for b in info.blocks)
    finally:
        attachments.loader.close()
        manager.close()
        engine.close()


class _LaggingEvent(_FakeEvent):
    """A copy still on the link until someone waits for it (a walk that outruns its copies)."""

    def __init__(self):
        self.done = False

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


class _LaggingFabric(_FakeFabric):
    def place(self, key, device, blocks, num_layers=None):
        placement = super().place(key, device, blocks, num_layers)
        placement.events = [_LaggingEvent() for _ in placement.events]
        return placement


def test_a_load_whose_copies_lag_waits_for_them_instead_of_overfilling_the_host_arena(wide_store):
    """A GPU load of a model larger than the host arena, whose copies finish only when waited
    for: the walk holds at most the window (half the arena) of stages whose copies are in
    flight, waiting for the oldest, instead of taking stage after stage until a read finds the
    arena full of leased blocks (OutOfMemory: the cold load after start that failed on the H200
    machine at the stage where its read-ahead ended)."""
    arena = _core.HostArena(3 << 20)                  # ~3 of wide's ~964 KiB layers
    engine = _core.IOEngine()
    manager = BlockManager(FlashConfig({"host_cache_bytes": 3 << 20}), arena, engine)
    loader = Loader(manager, arena, _LaggingFabric(64 << 20))
    try:
        cid = manager.connect({"name": "c"})
        info = manager.open_model(cid, str(wide_store))
        assert sum(b.length for b in info.blocks) > arena.size
        load = loader.attach(cid, info, 0, [b.id for b in info.blocks])
        load.finished.result(timeout=30)
        assert (load.gates == GATE_READY).all() and not load.leases
        assert manager.stats()["bytes_read_nvme"] == sum(b.length for b in info.blocks)
    finally:
        loader.close()
        manager.close()
        engine.close()


class _SlowLaggingFabric(_SlowFirstFabric):
    """CUDA still starting at the first attach, and copies that lag behind the walk."""

    def place(self, key, device, blocks, num_layers=None):
        placement = super().place(key, device, blocks, num_layers)
        placement.events = [_LaggingEvent() for _ in placement.events]
        return placement


class _CopyingFabric(_SlowFirstFabric):
    """CUDA still starting at the first attach; the device is a bytearray the copies really fill
    (from the host arena's offsets, or from the buffers read beyond it), so a test can compare
    the device's bytes with the store's."""

    def __init__(self, size, host_arena):
        super().__init__(size)
        self.memory = bytearray(size)
        self.host = memoryview(host_arena)
        self.from_sources = 0

    def copy_gate(self, placement, gate, host_offsets, lengths, sources=None):
        for bid, n in lengths.items():
            dst = placement.offsets[bid]
            if sources is not None and bid in sources:
                self.memory[dst:dst + n] = memoryview(sources[bid])[:n]
                self.from_sources += n
            else:
                self.memory[dst:dst + n] = self.host[host_offsets[bid]:host_offsets[bid] + n]


def _startup_rig(store, arena_bytes=3 << 20):
    arena = _core.HostArena(arena_bytes)
    engine = _core.IOEngine()
    manager = BlockManager(FlashConfig({"host_cache_bytes": arena_bytes}), arena, engine)
    fabric = _CopyingFabric(64 << 20, arena)
    attachments = Attachments(manager, Loader(manager, arena, fabric), fabric)
    cid = manager.connect({"name": "first"})
    info = manager.open_model(cid, str(store))
    order = [b for stage in ForwardOrder(info.blocks, info.num_layers).stages for b in stage]
    return SimpleNamespace(arena=arena, engine=engine, manager=manager, fabric=fabric,
                           attachments=attachments, cid=cid, info=info, order=order)


def _close_rig(rig):
    rig.attachments.loader.close()
    rig.manager.close()
    rig.engine.close()


def _device_bytes_are_the_store(rig, load, store):
    placement = next(iter(rig.fabric.placements.values()))
    for block in rig.info.blocks:
        off = placement.offsets[block.id]
        assert bytes(rig.fabric.memory[off:off + block.length]) == store.read_block(block.id), block.id


def _load_once_the_device_is_ready(rig, store, startup, pending, left_to_the_load):
    """The startup reads finish before the device is ready (everything read but the blocks
    ``left_to_the_load``); then the device opens and the load completes: the device's bytes are
    the store's, nothing is read twice, and the buffers read beyond the arena are all copied and
    given back."""
    for fut in list(startup.done.values()):
        fut.result(timeout=30)
    assert_eventually_true(lambda: rig.manager.stats()["loading_blocks"] == 0)
    total = sum(b.length for b in rig.info.blocks)
    left_bytes = sum(rig.info.blocks[b].length for b in left_to_the_load)
    assert rig.manager.stats()["bytes_read_nvme"] == total - left_bytes   # device not ready
    rig.fabric.opened.set()
    pending.result(timeout=30)
    load = next(iter(rig.attachments.loader.loads()))
    load.finished.result(timeout=30)
    assert (load.gates == GATE_READY).all() and not load.leases
    _device_bytes_are_the_store(rig, load, store)
    assert rig.manager.stats()["bytes_read_nvme"] == total        # nothing read twice
    assert rig.fabric.from_sources == startup.taken == startup.bytes
    assert startup.buffers == {} and rig.attachments._startup == {}


def test_reads_go_on_beyond_the_host_arena_while_cuda_starts_and_land_on_the_device_exactly(wide_store):
    """A model larger than the free host arena, CUDA still starting: the blocks after the arena's
    read-ahead are read on into memory of their own, so the whole model is read before the device
    is ready; the load then copies them from there -- the device's bytes are the store's, no
    block is read twice, and the memory of those reads is given back once copied."""
    store = Store.open(wide_store)
    rig = _startup_rig(wide_store)
    try:
        pending = rig.attachments.attach(rig.cid, rig.info.name, 0)
        startup = rig.attachments._startup[rig.info.name]
        beyond = [b for b in rig.order if b in startup.blocks]
        assert beyond == rig.order[len(rig.order) - len(beyond):] and 0 < len(beyond) < len(rig.order)
        _load_once_the_device_is_ready(rig, store, startup, pending, left_to_the_load=())
    finally:
        _close_rig(rig)


def test_the_last_stage_is_left_to_the_load_which_reads_it_into_the_host_arena(wide_store):
    """Much more to read beyond the arena than the arena holds: the model's last stage is not
    read beyond it but by the load, into the page-locked host arena once the device is ready (its
    copy, the one left after the disk's last read, then runs at the link's rate); the device's
    bytes are still the store's and nothing is read twice."""
    store = Store.open(wide_store)
    rig = _startup_rig(wide_store, arena_bytes=1 << 20)
    try:
        stages = [s for s in ForwardOrder(rig.info.blocks, rig.info.num_layers).stages if s]
        pending = rig.attachments.attach(rig.cid, rig.info.name, 0)
        startup = rig.attachments._startup[rig.info.name]
        beyond = [b for b in rig.order if b in startup.blocks]
        last = list(stages[-1])
        # The stages beyond the arena's, but for the last one.
        assert beyond == rig.order[len(rig.order) - len(last) - len(beyond):len(rig.order) - len(last)]
        assert len(beyond) > len(stages[-2]) and not set(last) & set(startup.blocks)
        # Copied from the buffers beyond the arena: those stages only, not the last one.
        _load_once_the_device_is_ready(rig, store, startup, pending, left_to_the_load=last)
    finally:
        _close_rig(rig)


def test_tail_stages_counts_the_last_stages_left_to_the_load():
    from deepseek_flash.daemon.startup_reads import TAIL_ARENA_SHARE, tail_stages

    def stages(*sizes):
        return [[SimpleNamespace(length=n)] for n in sizes]

    assert TAIL_ARENA_SHARE == 0.25
    # The last stages within a quarter of the arena (100), at least the last one.
    assert tail_stages(stages(300, 300, 60, 30), 400) == 2
    assert tail_stages(stages(300, 300, 60, 50), 400) == 1       # 110 > 100: only the last
    assert tail_stages(stages(500, 300, 250), 400) == 1          # larger than the share: still one
    # Unless what stays beyond the arena is no more than the arena: then nothing is left out.
    assert tail_stages(stages(300, 100, 30), 400) == 0
    assert tail_stages(stages(401, 30), 400) == 1
    assert tail_stages(stages(30), 400) == 0 and tail_stages([], 400) == 0


def test_a_failed_read_beyond_the_arena_is_read_again_through_the_host_tier(wide_store):
    """One block read beyond the arena fails: the load reads that stage again, whole, through
    the host tier (typed errors and recovery as any read) and the device still gets the exact
    bytes."""
    from deepseek_flash.errors import FlashIOError

    store = Store.open(wide_store)
    rig = _startup_rig(wide_store)
    read_outside = rig.manager.read_outside
    failed = []

    wrapped = []

    def failing_first(model, reads, priority=0):
        if wrapped:                                  # only the first block read beyond the arena
            return read_outside(model, reads, priority)
        info, dest, callback = reads[0]
        wrapped.append(info)

        def fail(error):
            failed.append(info)
            callback(FlashIOError(f"block {info.id}: injected", errno=5, path=info.file,
                                  offset=info.offset, block_id=info.id))
        return read_outside(model, [(info, dest, fail)] + list(reads[1:]), priority)

    rig.manager.read_outside = failing_first
    try:
        pending = rig.attachments.attach(rig.cid, rig.info.name, 0)
        startup = rig.attachments._startup[rig.info.name]
        rig.fabric.opened.set()
        pending.result(timeout=30)
        load = next(iter(rig.attachments.loader.loads()))
        load.finished.result(timeout=30)
        assert (load.gates == GATE_READY).all() and len(failed) == 1
        _device_bytes_are_the_store(rig, load, store)
        total = sum(b.length for b in rig.info.blocks)
        # Its stage (the failed block's layer) is read again, whole, through the host tier; the
        # reads beyond the arena counted once each as their bytes came.
        layer = [b.length for b in rig.info.blocks if b.layer == failed[0].layer]
        assert len(layer) == 4
        assert rig.manager.stats()["bytes_read_nvme"] == total + sum(layer)
        assert startup.buffers == {}
    finally:
        _close_rig(rig)


def test_nothing_is_read_beyond_the_arena_for_a_streamed_plan_or_without_memory(wide_store,
                                                                                monkeypatch):
    """Only a load of the whole model (no weight budget) reads beyond the arena, whole stages
    after the arena's whole stages, and only as much as half the available memory holds."""
    from deepseek_flash.daemon import startup_reads
    from deepseek_flash.daemon.host_state import aligned

    store = Store.open(wide_store)
    for budget, memory, expect in ((1 << 30, 1 << 40, False), (None, 0, False), (None, "next", True)):
        rig = _startup_rig(wide_store)
        try:
            stages = [s for s in ForwardOrder(rig.info.blocks, rig.info.num_layers).stages if s]
            size = {b.id: aligned(b.length) for b in rig.info.blocks}
            blocks_fit, stages_fit, room = 0, 0, rig.arena.size
            for bid in rig.order:                      # a streamed plan: any block that fits
                room -= size[bid]
                if room < 0:
                    break
                blocks_fit += 1
            room = rig.arena.size
            for stage in stages:                       # the whole model: whole stages
                room -= sum(size[b] for b in stage)
                if room < 0:
                    break
                stages_fit += 1
            following = stages[stages_fit]
            need = sum(rig.info.blocks[b].length for b in following)
            # Its memory: each block at a 4 KiB boundary.
            avail = 2 * sum(size[b] for b in following) + 1 if memory == "next" else memory
            monkeypatch.setattr(startup_reads, "available_memory", lambda avail=avail: avail)
            startup = rig.attachments.read_ahead(rig.cid, rig.info.name, weight_budget=budget)
            issued = blocks_fit if budget is not None else sum(len(s) for s in stages[:stages_fit])
            assert rig.manager.stats()["prefetch_issued"] == issued
            if not expect:
                assert startup is None
                continue
            assert list(startup.blocks) == list(following) and startup.bytes == need
            for bid in following:
                startup.done[bid].result(timeout=30)
                view = memoryview(startup.buffers[bid])[:rig.info.blocks[bid].length]
                assert bytes(view) == store.read_block(bid)
                del view
            startup.close()
            assert startup.buffers == {}
        finally:
            _close_rig(rig)


def test_reads_beyond_the_arena_are_dropped_when_the_attach_fails(wide_store):
    """CUDA fails to start: the attach's typed error reaches the client and the memory read
    beyond the arena is given back (nothing left for a later attach to find)."""
    from deepseek_flash.errors import DeviceError

    rig = _startup_rig(wide_store)

    def broken(device):
        raise DeviceError("cuda:0 requested but CUDA is not available in the daemon", device=device)

    rig.fabric.arena = broken
    try:
        pending = rig.attachments.attach(rig.cid, rig.info.name, 0)
        with pytest.raises(DeviceError):
            pending.result(timeout=30)
        assert rig.attachments._startup == {}
        assert_eventually_true(lambda: rig.manager.stats()["loading_blocks"] == 0)
    finally:
        _close_rig(rig)
