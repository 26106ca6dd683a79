"""The device arena grows and shrinks with what is loaded; its ceiling is unified_memory_ratio.

Runs on the CPU: the arena's allocator is injected (host tensors stand in for device segments),
so the accounting, the release of empty segments and the errors are exact here; the GPU parity
tests (``-m gpu``) run the same code over torch's CUDA allocator and IPC.
"""
import pytest
import torch

from deepseek_flash.cuda import DeviceMemory
from deepseek_flash.daemon.gpu_arena import SEGMENT_ALIGNMENT, GpuArena
from deepseek_flash.errors import BudgetTooSmall

MiB = 1 << 20


class FakeDevice:
    """A device of ``total`` bytes of which ``others`` are held by other processes."""

    def __init__(self, total, others=0):
        self.total, self.others, self.mapped, self.calls = total, others, 0, []

    def alloc(self, size):
        self.calls.append(size)
        if self.others + self.mapped + size > self.total:
            raise MemoryError(f"out of memory allocating {size}")
        self.mapped += size
        t = torch.zeros(size, dtype=torch.uint8)
        t._fake_size = size
        return t

    def release(self):
        pass

    def mem_info(self):
        return self.total - self.others - self.mapped, self.total


def arena(device, ceiling, min_segment=8 * MiB):
    a = GpuArena(0, ceiling, ratio=0.8, alloc=device.alloc, release=lambda: None,
                 mem_info=device.mem_info, min_segment=min_segment)

    # What the fake device holds is what the arena maps.
    def release():
        device.mapped = a.size
    a._release = release
    return a


def test_nothing_is_mapped_until_something_is_loaded_and_empty_segments_go_back():
    dev = FakeDevice(1024 * MiB)
    a = arena(dev, 800 * MiB)
    assert a.size == 0 and a.used == 0 and dev.calls == []
    # A model's placement: all its blocks in one new segment, rounded to 2 MiB.
    offs = a.alloc_many([30 * MiB, 10 * MiB + 1, 4096], what="model 'm'")
    assert dev.calls == [42 * MiB] and a.size == 42 * MiB and len(a.memory) == 1
    assert offs == [0, 30 * MiB, 30 * MiB + 10 * MiB + 4096]
    # A slot ring that no longer fits the first segment: a second segment at a new base.
    slots = a.alloc_many([6 * MiB] * 2, what="a streaming slot ring")
    assert dev.calls[-1] == 12 * MiB and slots == [42 * MiB, 48 * MiB] and a.size == 54 * MiB
    # Bytes written through one view are read back through the arena's slicing.
    a[offs[1]:offs[1] + 5].copy_(torch.arange(5, dtype=torch.uint8))
    assert a.memory[offs[1]:offs[1] + 5].tolist() == [0, 1, 2, 3, 4]
    # Freeing the model's blocks releases its segment; the slots' segment stays.
    for off in offs:
        a.free(off)
    assert a.size == 12 * MiB and a.memory.bases() == [42 * MiB] and dev.mapped == 12 * MiB
    for off in slots:
        a.free(off)
    assert a.size == 0 and a.used == 0 and dev.mapped == 0 and a.segments_released == 2
    # Bases are never reused: a client's old mapping can never alias a new segment.
    assert a.alloc(MiB) == 54 * MiB


def test_small_requests_share_a_minimum_segment():
    dev = FakeDevice(1024 * MiB)
    a = arena(dev, 800 * MiB, min_segment=16 * MiB)
    first = a.alloc(4096)
    second = a.alloc(MiB)
    assert dev.calls == [16 * MiB] and second == first + 4096


def test_a_range_never_crosses_segments_and_views_refuse_to():
    dev = FakeDevice(1024 * MiB)
    a = arena(dev, 800 * MiB, min_segment=2 * MiB)
    a.alloc(2 * MiB)
    off = a.alloc(2 * MiB)
    assert off == 2 * MiB and len(a.memory) == 2
    with pytest.raises(IndexError, match="crosses the end of the segment"):
        a[MiB:3 * MiB]


def test_the_ceiling_is_a_clear_error_naming_the_key():
    dev = FakeDevice(1024 * MiB)
    a = arena(dev, 100 * MiB)
    a.alloc(60 * MiB)
    with pytest.raises(BudgetTooSmall) as exc:
        a.alloc_many([30 * MiB, 20 * MiB], what="model 'big'")
    err = exc.value
    assert err.code == 402 and err.key == "unified_memory_ratio" and err.requested == 50 * MiB
    msg = str(err)
    assert "model 'big' needs 52428800 more bytes" in msg and "ceiling of 104857600" in msg
    assert "unified_memory_ratio" in msg and f"{dev.total - dev.mapped} bytes are free" in msg
    # All or none: nothing of the failed request stays allocated.
    assert a.used == 60 * MiB and a.size == 60 * MiB


def test_a_gpu_held_by_another_process_still_serves_what_fits():
    """80 % of the card is the ceiling, not an up-front allocation: with another process holding
    most of the device, a small model loads; one that does not fit names the free memory."""
    dev = FakeDevice(1000 * MiB, others=700 * MiB)
    a = arena(dev, 800 * MiB, min_segment=64 * MiB)
    offs = a.alloc_many([100 * MiB, 50 * MiB], what="model 'small'")
    assert a.size == 150 * MiB and offs == [0, 100 * MiB]
    with pytest.raises(BudgetTooSmall) as exc:
        a.alloc(200 * MiB)
    msg = str(exc.value)
    assert f"only {150 * MiB} of {1000 * MiB} bytes are free on the device" in msg
    assert "other processes hold the rest" in msg and exc.value.free == 150 * MiB
    # A small request whose minimum segment does not fit maps just what it needs.
    dev.others = 840 * MiB
    assert a.alloc(4 * MiB) == 150 * MiB and dev.calls[-2:] == [64 * MiB, 4 * MiB]


def test_device_memory_opens_each_segment_once_and_drops_released_ones(monkeypatch):
    import deepseek_flash.cuda as cuda

    opened = []

    def fake_open(device, seg):
        opened.append(seg["base"])
        return torch.full((seg["size"],), seg["base"] // SEGMENT_ALIGNMENT, dtype=torch.uint8)

    monkeypatch.setattr(cuda, "_open_segment", fake_open)
    seg = lambda base, size, h: {"base": base, "size": size, "handle": h}   # noqa: E731
    mem = DeviceMemory().update({"device": 0, "segments": [seg(0, 4 * MiB, b"a"),
                                                           seg(4 * MiB, 2 * MiB, b"b")]})
    assert opened == [0, 4 * MiB] and mem[4 * MiB + 10:4 * MiB + 12].tolist() == [2, 2]
    # The next attach lists a new segment and no longer the first: one open, one dropped.
    mem.update({"device": 0, "segments": [seg(4 * MiB, 2 * MiB, b"b"), seg(8 * MiB, 2 * MiB, b"c")]})
    assert opened == [0, 4 * MiB, 8 * MiB] and mem.bases() == [4 * MiB, 8 * MiB]
    with pytest.raises(IndexError, match="in no segment"):
        DeviceMemory()[0:1]


def test_the_host_arena_is_page_locked_once_and_late_callers_wait(monkeypatch):
    """The preparation thread pins the host arena at start; a load's first copy that comes while
    it runs waits for it instead of registering again."""
    import threading
    import time
    from types import SimpleNamespace

    import deepseek_flash.daemon.fabric as fabric_mod

    calls = []

    def slow_register(address, size):
        calls.append((address, size))
        time.sleep(0.2)
        return True

    monkeypatch.setattr(fabric_mod, "register_host_memory", slow_register)
    fabric = fabric_mod.Fabric(SimpleNamespace(address=4096, size=1 << 20), 0.8)
    results = []
    threads = [threading.Thread(target=lambda: results.append(fabric.pin_host())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [(4096, 1 << 20)] and results == [True, True, True] and fabric.host_pinned


def test_a_loads_copies_never_wait_for_the_page_locking(monkeypatch):
    """``pin_host(wait=False)`` (what copy_gate asks) answers at once: False while the pinning
    runs on its own thread (copies then run pageable), True once it is done; close joins it."""
    import threading
    import time
    from types import SimpleNamespace

    import deepseek_flash.daemon.fabric as fabric_mod

    release, calls = threading.Event(), []

    def blocked_register(address, size):
        calls.append(size)
        release.wait(10)
        return True

    monkeypatch.setattr(fabric_mod, "register_host_memory", blocked_register)
    monkeypatch.setattr(fabric_mod, "unregister_host_memory", lambda address: calls.append(-1))
    fabric = fabric_mod.Fabric(SimpleNamespace(address=4096, size=1 << 20), 0.8)
    fabric._available = False
    t = time.monotonic()
    assert fabric.pin_host(wait=False) is False and fabric.pin_host(wait=False) is False
    assert time.monotonic() - t < 1.0
    release.set()
    fabric._pin_thread.join(10)
    assert fabric.pin_host(wait=False) is True and calls == [1 << 20]
    fabric.close()
    assert calls == [1 << 20, -1] and not fabric.host_pinned


def test_prepare_starts_nothing_without_an_nvidia_driver(monkeypatch):
    from types import SimpleNamespace

    import deepseek_flash.daemon.fabric as fabric_mod

    monkeypatch.setattr(fabric_mod, "nvidia_driver_present", lambda: False)
    fabric = fabric_mod.Fabric(SimpleNamespace(address=4096, size=1 << 20), 0.8)
    assert fabric.prepare() is None and fabric._available is None
    fabric.close()
