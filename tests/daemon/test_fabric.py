"""The GPU fabric's bookkeeping, on CPU: telemetry with a fake NVML, the prepare thread, the h2d
byte counter under concurrent loads (torch CPU tensors stand in for device memory)."""
import contextlib
import sys
import threading
import time
import types

import torch

from deepseek_flash.daemon import fabric as fabric_module
from deepseek_flash.daemon.fabric import DevicePlacement, Fabric, GpuArena
from deepseek_flash.daemon.ranges import RangeAllocator
from deepseek_flash.errors import BudgetTooSmall, DeviceError


def cpu_arena(device: int, size: int = 2 << 20) -> GpuArena:
    """A GPU arena whose segments are CPU tensors, ceiling ``size`` (one segment's worth)."""
    return GpuArena(device, size, types.SimpleNamespace(synchronize=lambda: None),
                    alloc=lambda n: torch.zeros(n, dtype=torch.uint8), release=lambda: None,
                    mem_info=lambda: (size, size), min_segment=size)


class FakeNvml(types.ModuleType):
    """pynvml with two devices: memory and PCIe counters, nothing else."""

    NVML_PCIE_UTIL_RX_BYTES, NVML_PCIE_UTIL_TX_BYTES = 1, 0
    NVMLError = type("NVMLError", (Exception,), {})

    def __init__(self):
        super().__init__("pynvml")

    def nvmlInit(self):
        pass

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetMemoryInfo(self, h):
        return types.SimpleNamespace(used=1000 + h, total=8000)

    def nvmlDeviceGetPcieThroughput(self, h, counter):
        return 10 * (h + 1) + counter


def test_telemetry_merges_nvml_into_each_device(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())
    fabric = Fabric(host_arena=None, unified_memory_ratio=0.5)
    fabric.arenas[0] = cpu_arena(0)
    fabric.arenas[0].alloc(8192)
    assert fabric.telemetry() == {
        "cuda:0": {"arena_bytes": 2 << 20, "arena_used_bytes": 8192, "arena_ceiling_bytes": 2 << 20,
                   "arena_segments": 1, "models": "", "placements": 0, "placed_bytes": 0,
                   "slot_rings": 0, "slot_bytes": 0, "bytes_h2d": 0, "h2d_bytes_per_s": 0,
                   "link_capacity_bytes_per_s": 0,
                   "gpu_memory_used_bytes": 1000, "gpu_memory_total_bytes": 8000,
                   "pcie_rx_kbps": 11, "pcie_tx_kbps": 10},
        "cuda:1": {"gpu_memory_used_bytes": 1001, "gpu_memory_total_bytes": 8000,
                   "pcie_rx_kbps": 21, "pcie_tx_kbps": 20}}


def test_telemetry_shows_each_device_its_models_rings_and_link(monkeypatch):
    """Two devices: each lists what is placed in its own arena, its slot rings, the bytes the
    loads copied to it and their rate between two reads."""
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(fabric_module, "link_bytes_per_s", lambda device: 63e9 + device)
    fabric = Fabric(host_arena=bytearray(1 << 16), unified_memory_ratio=0.5)
    fabric._available = True
    monkeypatch.setattr(fabric, "pin_host", lambda wait=True: False)
    for device in (0, 1):
        fabric.arenas[device] = cpu_arena(device)
    blocks = [types.SimpleNamespace(id=i, length=4096, layer=i - 1, role="attn") for i in range(3)]
    for key, device in ((("a", 0, 1), 0), (("b", 1, 2), 1), (("a", 1, 3), 1)):
        placement = DevicePlacement.__new__(DevicePlacement)
        placement.model, placement.device, placement.arena = key[0], device, fabric.arenas[device]
        placement.offsets = dict(zip(range(3), fabric.arenas[device].alloc_many([4096] * 3)))
        placement.bytes = 3 * 4096
        placement.stages = [[0], [1], [2]]
        placement.events = [types.SimpleNamespace(record=lambda stream: None)] * 3
        fabric.placements[key] = placement
    fabric.alloc_slots((7, "a", 1), 1, 2, 8192)
    first = fabric.telemetry(now=100.0)
    assert first["cuda:0"]["models"] == "a" and first["cuda:1"]["models"] == "a,b"
    assert (first["cuda:0"]["placed_bytes"], first["cuda:1"]["placed_bytes"]) == (12288, 24576)
    assert (first["cuda:1"]["slot_rings"], first["cuda:1"]["slot_bytes"]) == (1, 16384)
    assert first["cuda:0"]["slot_rings"] == 0
    assert first["cuda:1"]["link_capacity_bytes_per_s"] == 63e9 + 1
    # Device 1's load copies two gates in the next two seconds; device 0 copies nothing.
    placement = fabric.placements[("b", 1, 2)]
    for gate in (0, 1):
        fabric.copy_gate(placement, gate, {0: 0, 1: 4096}, {0: 4096, 1: 4096})
    second = fabric.telemetry(now=102.0)
    assert second["cuda:1"]["bytes_h2d"] == 8192 and second["cuda:1"]["h2d_bytes_per_s"] == 4096
    assert second["cuda:0"]["bytes_h2d"] == 0 and second["cuda:0"]["h2d_bytes_per_s"] == 0
    assert fabric.bytes_h2d == 8192
    fabric.free_slots((7, "a", 1), 1)
    assert fabric.telemetry(now=103.0)["cuda:1"]["slot_rings"] == 0


def test_prepare_survives_a_device_that_does_not_fit_and_close_joins_it(monkeypatch):
    monkeypatch.setattr(fabric_module, "nvidia_driver_present", lambda: True)
    fabric = Fabric(host_arena=None, unified_memory_ratio=0.5, devices=[0, 1, 2])
    fabric._available = True
    tried = []

    def arena(device):
        tried.append(device)
        if device == 0:
            raise BudgetTooSmall("cuda:0: no room for the arena", device=0)
        if device == 1:
            raise DeviceError("cuda:1 does not exist", device=1)
        time.sleep(0.3)
        fabric.arenas[device] = cpu_arena(device)
        return fabric.arenas[device]

    monkeypatch.setattr(fabric, "arena", arena)
    monkeypatch.setattr(fabric, "pin_host", lambda wait=True: False)   # no host arena here
    thread = fabric.prepare()
    time.sleep(0.05)
    fabric.close()
    # close() waited for the preparation, which went on past the two devices that failed.
    assert not thread.is_alive()
    assert tried == [0, 1, 2]
    assert fabric.arenas == {}        # what the preparation made, close freed


def test_close_stops_preparing_further_devices(monkeypatch):
    monkeypatch.setattr(fabric_module, "nvidia_driver_present", lambda: True)
    fabric = Fabric(host_arena=None, unified_memory_ratio=0.5, devices=[0, 1])
    fabric._available = True
    tried = []
    started = threading.Event()

    def arena(device):
        tried.append(device)
        started.set()
        time.sleep(0.2)
        return cpu_arena(device)

    monkeypatch.setattr(fabric, "arena", arena)
    monkeypatch.setattr(fabric, "pin_host", lambda wait=True: False)   # no host arena here
    thread = fabric.prepare()
    assert started.wait(5)
    fabric.close()
    thread.join(5)
    assert tried == [0]


class YieldingInt(int):
    """An int whose addition lets another thread run in the middle of ``x += n`` (as a
    free-threaded interpreter or a longer critical section would)."""

    def __add__(self, other):
        value = int(self) + other
        time.sleep(0)
        return YieldingInt(value)


def test_bytes_h2d_counts_every_copy_of_concurrent_loads(monkeypatch):
    # copy_gate on CPU: the copy stream is a no-op context, events record nothing.
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    host = bytearray(1 << 16)
    fabric = Fabric(host_arena=host, unified_memory_ratio=0.5)
    fabric.bytes_h2d = YieldingInt(0)
    monkeypatch.setattr(fabric, "pin_host", lambda wait=True: False)   # copies from pageable memory
    arena = cpu_arena(0)
    assert arena.alloc(64 * 64) == 0          # maps the segment the offsets below fall in
    placement = DevicePlacement.__new__(DevicePlacement)
    placement.arena = arena
    placement.offsets = {b: b * 64 for b in range(64)}
    placement.stages = [[b] for b in range(64)]
    placement.events = [types.SimpleNamespace(record=lambda stream: None) for _ in range(64)]
    host_offsets = {b: b * 64 for b in range(64)}
    lengths = {b: 7 for b in range(64)}
    rounds, threads = 20, 4

    def load():
        for _ in range(rounds):
            for gate in range(64):
                fabric.copy_gate(placement, gate, host_offsets, lengths)
    workers = [threading.Thread(target=load) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert fabric.bytes_h2d == threads * rounds * 64 * 7


def test_range_allocator_books_stay_exact_under_concurrent_use(monkeypatch):
    # The loader (placements) and the attachments (slot rings) change one arena's allocator from
    # different threads; a thread switch inside free() must not corrupt the free list.
    from deepseek_flash.daemon import ranges

    real = ranges.bisect.bisect_left

    def yielding_bisect_left(*args):
        index = real(*args)
        time.sleep(0)
        return index
    monkeypatch.setattr(ranges, "bisect", types.SimpleNamespace(bisect_left=yielding_bisect_left))
    alloc = RangeAllocator(1 << 26, 4096)       # room for everything the four threads hold
    errors = []
    start = threading.Barrier(4)

    def churn(seed):
        start.wait()
        try:
            mine = []
            for i in range(2000):
                if mine and (i + seed) % 3 == 0:
                    alloc.free(mine.pop())
                else:
                    mine.append(alloc.alloc(4096 * (1 + (i + seed) % 4)))
            for off in mine:
                alloc.free(off)
        except Exception as exc:   # noqa: BLE001 -- collected and asserted below
            errors.append(exc)
    workers = [threading.Thread(target=churn, args=(s,)) for s in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert errors == []
    assert alloc.used == 0 and alloc.free_bytes() == alloc.size and alloc.largest_free() == alloc.size


def test_copy_gate_copies_each_block_from_the_host_arena_or_its_buffer_beyond_it(monkeypatch):
    """A stage partly read beyond the host arena while CUDA started (``startup_reads``): those
    blocks come from their own page-aligned buffers, the rest from the host arena's offsets;
    the device gets each block's exact bytes and ``bytes_h2d`` counts both."""
    import mmap
    import random

    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    rng = random.Random(3)
    host = bytearray(rng.randbytes(1 << 16))
    fabric = Fabric(host_arena=host, unified_memory_ratio=0.5)
    monkeypatch.setattr(fabric, "pin_host", lambda wait=True: False)
    arena = cpu_arena(0)
    assert arena.alloc(1 << 16) == 0
    placement = DevicePlacement.__new__(DevicePlacement)
    placement.arena = arena
    placement.offsets = {0: 0, 1: 8192, 2: 20480}
    placement.stages = [[0, 1, 2]]
    placement.events = [types.SimpleNamespace(record=lambda stream: None)]
    outside = {1: mmap.mmap(-1, 12288), 2: mmap.mmap(-1, 4096)}
    want = {1: rng.randbytes(10000), 2: rng.randbytes(4096)}
    for bid, data in want.items():
        outside[bid][:len(data)] = data
    want[0] = bytes(host[4096:4096 + 5000])
    lengths = {0: 5000, 1: 10000, 2: 4096}
    fabric.copy_gate(placement, 0, {0: 4096}, lengths, sources=outside)
    device = arena[0:1 << 16].numpy().tobytes()
    for bid, data in want.items():
        off = placement.offsets[bid]
        assert device[off:off + lengths[bid]] == data, bid
    assert fabric.bytes_h2d == 5000 + 10000 + 4096
    for buf in outside.values():
        buf.close()                    # nothing holds the buffers after the copy


def test_prepare_faults_the_host_arena_in_beside_cuda_start_and_keeps_its_bytes(monkeypatch, caplog):
    """Where a driver is present, prepare() faults the host arena's pages in on a thread of its
    own (the first load's reads then land in present pages); bytes already written stay as they
    are (a read-ahead may land meanwhile) and close() waits for the thread."""
    import logging

    from deepseek_flash import _core

    monkeypatch.setattr(fabric_module, "nvidia_driver_present", lambda: True)
    host = _core.HostArena(8 << 20, "populate-test")
    memoryview(host)[4096:4100] = b"keep"
    fabric = Fabric(host_arena=host, unified_memory_ratio=0.5, devices=[])
    fabric._available = False                   # no CUDA here: only the host side runs
    with caplog.at_level(logging.INFO, logger="deepseek_flash.fabric"):
        fabric.prepare()
        fabric.close()
    assert fabric._populate_thread is None
    assert bytes(memoryview(host)[4096:4100]) == b"keep"
    assert any(f"host arena of {8 << 20} bytes faulted in" in r.getMessage() for r in caplog.records)


def test_prepare_calls_on_cuda_once_the_arenas_are_made_then_pins(monkeypatch, caplog):
    """``prepare(on_cuda=...)``: called on the prepare thread after every device's arena, before
    the host arena is page-locked; an error in it is logged and the pinning still runs."""
    import logging

    monkeypatch.setattr(fabric_module, "nvidia_driver_present", lambda: True)
    for failing in (False, True):
        fabric = Fabric(host_arena=None, unified_memory_ratio=0.5, devices=[0, 1])
        fabric._available = True
        events = []

        def arena(device):
            events.append(f"arena {device}")
            fabric.arenas[device] = cpu_arena(device)
            return fabric.arenas[device]

        def on_cuda():
            events.append("on_cuda")
            if failing:
                raise RuntimeError("learning failed")

        monkeypatch.setattr(fabric, "arena", arena)
        monkeypatch.setattr(fabric, "pin_host", lambda wait=True: events.append("pin") or False)
        with caplog.at_level(logging.INFO, logger="deepseek_flash.fabric"):
            fabric.prepare(on_cuda=on_cuda).join(10)
        assert events == ["arena 0", "arena 1", "on_cuda", "pin"]
        assert "CUDA started (torch imported, context and arenas made) in" in caplog.text
        assert ("after CUDA's start" in caplog.text) is failing
        fabric.close()
