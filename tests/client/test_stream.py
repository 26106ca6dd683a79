"""Streamed execution on the CPU: the slot ring gives logits and greedy tokens identical to the
fully resident model, for every budget from all-resident down to the minimum, windows 0..4."""
from __future__ import annotations

from collections import deque

import numpy as np
import pytest
import torch
from deepseek_flash.client.skeleton import bind_parameters, build_skeleton
from deepseek_flash.client.stream import StreamRuntime
from deepseek_flash.daemon.planner import plan_residency, resident_minimum
from deepseek_flash.wire import SLOT_ALIGNMENT

from deepseek_flash.store import Store, pack
from deepseek_flash.store.views import block_tensors
from deepseek_flash.testing import assert_same_outputs, load_reference, make_tiny_model


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def packed(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"stream-{request.param}")
    src = make_tiny_model(root / "src", "llama", dtype=request.param, num_layers=5, seed=3)
    pack(src, root / "store")
    store = Store.open(root / "store")
    host = torch.from_numpy(np.fromfile(store.data_path(store.blocks[0]), dtype=np.uint8))
    ref = load_reference(src)
    return store, host, ref


def aligned(n):
    return -(-n // SLOT_ALIGNMENT) * SLOT_ALIGNMENT


def budgets(store, unit="layer"):
    slot = max(sum(aligned(b.length) for b in store.blocks if b.layer == i and b.role.startswith("mlp"))
               for i in range(store.num_layers))
    minimum = resident_minimum(store.blocks, unit)
    total = sum(aligned(b.length) for b in store.blocks)
    return {"all": total, "one-resident-layer": minimum + 2 * slot, "minimum": minimum}


def streamed_model(store, host, budget, window, unit="layer"):
    by_id = {b.id: b for b in store.blocks}
    plan = plan_residency(store.blocks, budget, window, unit=unit)
    model = build_skeleton(store.config)
    tensors = {}
    for bid in plan.resident:
        b = by_id[bid]
        tensors.update(block_tensors(b, host[b.offset:b.offset + b.length]))
    bind_parameters(model, tensors, complete=not plan.streaming)
    runtime = None
    if plan.streaming:
        slots = [torch.empty(plan.slot_bytes, dtype=torch.uint8) for _ in range(plan.n_slots)]
        runtime = StreamRuntime(model, plan, by_id, host, {b.id: b.offset for b in store.blocks},
                                slots, "cpu", plan.window if window == "auto" else window)
    return model, plan, runtime


@pytest.mark.parametrize("unit", ["layer", "projection"])
@pytest.mark.parametrize("budget_name", ["all", "one-resident-layer", "minimum"])
@pytest.mark.parametrize("window", [0, 1, 2, 3, 4])
def test_streamed_logits_and_tokens_equal_resident(packed, budget_name, window, unit):
    store, host, ref = packed
    model, plan, runtime = streamed_model(store, host, budgets(store, unit)[budget_name], window, unit)
    assert plan.streaming == (budget_name != "all")
    torch.manual_seed(window)
    for batch in (1, 3):
        assert_same_outputs(model, ref, torch.randint(0, 256, (batch, 7)), new_tokens=5)
    if runtime is not None:
        stats = runtime.stats()
        passes = stats["passes"]
        assert passes == 2 * (1 + 5)   # two batches, a forward plus five decode steps each
        units = len(plan.streamed_layers) * (3 if unit == "projection" else 1)
        assert stats["streamed_units"] == units
        assert stats["prefetch_hits"] + stats["prefetch_miss_count"] == passes * units
        assert stats["bytes_streamed"] >= passes * sum(
            store.block(b).length for layer in plan.streamed_layers for b in plan.stream_blocks[layer])
        if window >= 1:
            # Every copy after the first pass was issued a layer ahead: all hits.
            assert stats["prefetch_miss_count"] <= plan.n_slots


class _RecordingOps:
    """The CPU schedule's copies, with events that are objects and a log of the order in which
    copies were issued, waited on and compute events recorded (what the CUDA ops would enqueue)."""

    copy_stream = None

    def __init__(self, slots):
        self.slots = slots
        self.log = []

    def event(self, timing=False):
        return object()

    def copy(self, dst, src, wait_for):
        slot = next(i for i, s in enumerate(self.slots) if s.data_ptr() <= dst.data_ptr()
                    < s.data_ptr() + s.numel())
        self.log.append(("copy", slot, wait_for))
        dst.copy_(src)

    def record_copy(self, event):
        self.log.append(("copy_done", event))

    def wait_copy(self, event):
        pass

    def record_compute(self, event):
        self.log.append(("compute_done", event))

    def synchronize(self):
        pass


@pytest.mark.parametrize("unit", ["layer", "projection"])
def test_the_default_window_refills_every_slot_between_passes(packed, unit):
    """``"auto"``: the window is the whole ring. When a pass ends -- the host then samples the
    token and runs the resident layers before the next streamed one, issuing nothing -- the
    next pass's first ``n`` units are already issued, one into each slot; unit ``seq`` goes to
    slot ``seq % n`` in every pass; and every copy into a slot that held a unit waits for the
    compute event recorded after that unit ran."""
    store, host, ref = packed
    model, plan, runtime = streamed_model(store, host, budgets(store, unit)["one-resident-layer"],
                                          "auto", unit)
    n, m = plan.n_slots, runtime.m
    assert m == len(plan.streamed_layers) * (3 if unit == "projection" else 1)
    assert plan.window == n == runtime.controller.window and m > n
    ops = runtime.ops = _RecordingOps(runtime.slots)
    runtime.copy_done = [ops.event() for _ in range(n)]
    runtime.compute_done = [ops.event() for _ in range(n)]
    ids = torch.randint(0, 256, (1, 6))
    with torch.no_grad():
        for _ in range(3):
            model(ids)
            assert runtime._issued == runtime._next + n - 1     # n copies ahead of the next pass
    recorded, used, group = set(), [False] * n, []
    layers_copied, slots = 0, []
    for entry in ops.log:
        if entry[0] == "compute_done":
            recorded.add(entry[1])
        elif entry[0] == "copy":
            group.append(entry)
        else:   # copy_done: one layer's copies issued
            slot = group[0][1]
            assert all(c[1] == slot for c in group) and entry[1] is runtime.copy_done[slot]
            # The first copy waits for the slot's last reader (recorded before it); the rest
            # follow it on the same stream.
            assert group[0][2] is (runtime.compute_done[slot] if used[slot] else None)
            assert not used[slot] or group[0][2] in recorded
            assert all(c[2] is None for c in group[1:])
            used[slot] = True
            layers_copied += 1
            slots.append(slot)
            group = []
    assert layers_copied == 3 * m + n
    assert slots == [(seq % m) % n for seq in range(3 * m + n)]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


@pytest.mark.parametrize("unit", ["layer", "projection"])
def test_aborted_pass_resynchronises(packed, unit):
    store, host, ref = packed
    model, plan, runtime = streamed_model(store, host, budgets(store, unit)["minimum"], 1, unit)
    ids = torch.randint(0, 256, (1, 5))
    layer = model.model.layers[plan.streamed_layers[1]]
    handle = layer.register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"), torch.no_grad():
        model(ids)
    handle.remove()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_projection_slots_equal_resident_for_every_arch(tmp_path, arch):
    """Qwen2 (attention biases) and Mistral under the smallest budget, each projection in a slot
    of its own: logits and tokens identical to the resident model, every unit prefetched."""
    src = make_tiny_model(tmp_path / "src", arch, num_layers=4, seed=5)
    pack(src, tmp_path / "store")
    store = Store.open(tmp_path / "store")
    host = torch.from_numpy(np.fromfile(store.data_path(store.blocks[0]), dtype=np.uint8))
    model, plan, runtime = streamed_model(store, host, resident_minimum(store.blocks, "projection"),
                                          "auto", "projection")
    assert plan.unit == "projection" and plan.streamed_layers == [0, 1, 2, 3] and plan.n_slots == 2
    assert [type(m).__name__ for m in runtime.unit_modules[:3]] == ["Linear"] * 3
    assert runtime.unit_modules[:3] == [getattr(model.model.layers[0].mlp, f"{p}_proj")
                                        for p in ("gate", "up", "down")]
    ref = load_reference(src)
    for batch in (1, 3):
        assert_same_outputs(model, ref, torch.randint(0, 256, (batch, 6)), new_tokens=4)
    stats = runtime.stats()
    assert stats["streamed_units"] == 12 and stats["prefetch_hits"] + stats["prefetch_miss_count"] \
        == stats["passes"] * 12
    assert stats["prefetch_miss_count"] <= plan.n_slots


@pytest.mark.parametrize("speed, width, gbps", [
    (5, 16, 63.015), (4, 16, 31.508), (3, 8, 7.877), (1, 16, 4.0),   # NVML's enum (gen 5, 4, 3, 1)
    (32000, 16, 63.015),                                                # a plain Mbit/s answer
])
def test_pcie_capacity_reads_nvml_link_speed_codes(speed, width, gbps):
    from types import SimpleNamespace

    from deepseek_flash.cuda import pcie_capacity

    nvml = SimpleNamespace(nvmlDeviceGetPcieLinkMaxSpeed=lambda h: speed,
                           nvmlDeviceGetMaxPcieLinkWidth=lambda h: width)
    assert round(pcie_capacity(nvml, None) / 1e9, 3) == gbps


def test_link_sampler_counts_only_traffic_that_is_not_ours():
    from types import SimpleNamespace

    from deepseek_flash.client.link import LinkSampler

    nvml = SimpleNamespace(NVML_PCIE_UTIL_RX_BYTES=0, rx_kbps=0,
                           nvmlDeviceGetPcieThroughput=lambda h, c: nvml.rx_kbps)
    sampler = LinkSampler(0, lambda: 0, nvml=nvml)
    capacity = 64e9
    # 40 GB/s on the link in every reading over one second, 30 GB of our copies completed in it.
    nvml.rx_kbps = 40e9 / 1024
    rates = [sampler.read_rx(None) for _ in range(50)]
    sampler.close_interval(rates, 30_000_000_000, 1.0, capacity)
    assert abs(sampler.load - 10e9 / capacity) < 1e-9
    # All of it ours: no other load, and never negative.
    sampler.close_interval([20e9] * 50, 25_000_000_000, 1.0, capacity)
    assert sampler.load == 0.0
    # One reading for a whole second: not trusted.
    sampler.close_interval([40e9], 0, 1.0, capacity)
    assert sampler.load is None


def test_link_sampler_thread_reads_our_own_copies_as_ours():
    """The sampler's own loop: the link carries exactly what our copies complete (a steady 50
    GB/s) -- the load it reports is ~0, so the window has nothing to yield to."""
    import time
    from types import SimpleNamespace

    from deepseek_flash.client.link import LinkSampler

    rate = 50e9
    t0 = time.monotonic()
    nvml = SimpleNamespace(NVML_PCIE_UTIL_RX_BYTES=0, nvmlInit=lambda: None,
                           nvmlDeviceGetHandleByIndex=lambda i: None,
                           nvmlDeviceGetPcieLinkMaxSpeed=lambda h: 5,
                           nvmlDeviceGetMaxPcieLinkWidth=lambda h: 16,
                           nvmlDeviceGetPcieThroughput=lambda h, c: rate / 1024)
    sampler = LinkSampler(0, lambda: int(rate * (time.monotonic() - t0)), interval=0.1,
                          sample_s=0.005, nvml=nvml).start()
    try:
        deadline = time.monotonic() + 10
        while sampler.load is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sampler.load is not None and sampler.load < 0.05
    finally:
        sampler.stop()


def test_streamed_host_leases_each_layer_once_and_pins_only_its_ranges():
    """Daemon mode on a GPU: attach page-locks nothing; a background thread leases the streamed
    layers and page-locks just their blocks' ranges (adjacent blocks merged), which close
    unpins and releases."""
    import threading
    from types import SimpleNamespace

    from deepseek_flash.client.streamed_host import StreamedHost
    from deepseek_flash.wire import Plan

    blocks = {10: SimpleNamespace(length=5000), 11: SimpleNamespace(length=8192),
              20: SimpleNamespace(length=100), 21: SimpleNamespace(length=4096)}
    offsets = {3: {10: 0, 11: 8192}, 4: {20: 65536, 21: 1 << 20}}
    calls, released = [], []
    lock = threading.Lock()

    class FakeClient:
        def acquire(self, model, blocks, priority=0):
            layer = 3 if blocks == [10, 11] else 4
            with lock:
                calls.append(layer)
            return SimpleNamespace(id=layer, blocks=offsets[layer])

        def release(self, lease):
            released.append(lease.id)

    registered, unregistered = [], []
    plan = Plan(budget=0, resident=[], streamed_layers=[3, 4], stream_blocks={3: [10, 11], 4: [20, 21]},
                slot_bytes=16384, n_slots=2)
    side = StreamedHost(FakeClient(), "m", plan, blocks, 1 << 40,
                        register=lambda a, n: registered.append((a - (1 << 40), n)) or True,
                        unregister=lambda a: unregistered.append(a - (1 << 40))).start()
    assert side.fetch(3) == offsets[3]          # the runtime's first pass asks as well
    side._thread.join(timeout=10)
    assert sorted(calls) == [3, 4]              # one lease per layer, whoever asked first
    assert registered == [(0, 16384), (65536, 4096), (1 << 20, 4096)]
    assert side.pinned_bytes == 24576 and side.pin_seconds is not None
    side.close()
    assert unregistered == [0, 65536, 1 << 20] and sorted(released) == [3, 4]


class _FakeEvent:
    """A CUDA event's Python surface: recorded at a tick of a shared clock, always complete."""

    clock = 0

    def __init__(self, timing=False):
        self.t = None

    def record(self, stream=None):
        _FakeEvent.clock += 1
        self.t = _FakeEvent.clock

    def query(self):
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return float(other.t - self.t)


class _FakeStream:
    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass

    def synchronize(self):
        pass


class _FakeCudaOps:
    """``_CudaOps`` with fake streams and events (copies run at once): the runtime's CUDA-only
    Python -- traced copies, timing pairs, copies in flight -- on the CPU."""

    device = 0

    def __init__(self):
        self.copy_stream = _FakeStream()

    def event(self, timing=False):
        return _FakeEvent(timing)

    def copy(self, dst, src, wait_for):
        dst.copy_(src)

    def record_copy(self, event):
        event.record()

    def wait_copy(self, event):
        pass

    def record_compute(self, event):
        event.record()

    def synchronize(self):
        pass


@pytest.mark.parametrize("unit", ["layer", "projection"])
def test_cuda_side_counters_trace_and_static_ring_with_fake_events(packed, unit, monkeypatch):
    store, host, ref = packed
    model, plan, runtime = streamed_model(store, host, budgets(store, unit)["minimum"], "auto", unit)
    runtime.ops, runtime.is_cuda = _FakeCudaOps(), True
    runtime.copy_done = [runtime.ops.event() for _ in range(runtime.n)]
    runtime.compute_done = [runtime.ops.event() for _ in range(runtime.n)]
    m = runtime.m
    runtime.trace_copies(limit=2 * m)
    ids = torch.randint(0, 256, (1, 5))
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(ids).logits, ref(ids).logits)
    trace = runtime.copy_trace()
    assert [(c["pass"], c["idx"]) for c in trace] == [(seq // m, seq % m) for seq in range(2 * m)]
    assert all(c["end_ms"] > c["start_ms"] >= 0 for c in trace)
    stats = runtime.stats()
    assert stats["passes"] == 3 and stats["streamed_units"] == m
    assert stats["prefetch_hits"] + stats["prefetch_miss_count"] == 3 * m
    assert stats["fabric_stall_us"] > 0 and runtime._timing == deque()
    assert runtime.completed_bytes() == runtime.bytes_streamed > 0
    # The static schedule with the same fake CUDA surface.
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream())
    ring = runtime.static_ring()
    ring.enter()
    assert runtime._suspended
    ring.begin()
    for layer in ring.layers:
        ring.before(layer)
        if unit == "projection":
            mlp = model.model.layers[layer].mlp
            calls = [ring.wrap(getattr(mlp, f"{p}_proj")) for p in ("gate", "up", "down")]
            assert all(type(c).__name__ == "_UnitCall" for c in calls)
            for call in calls:
                call(torch.zeros(1, call.module.in_features, dtype=call.weight.dtype))
        ring.after(layer)
    ring.end()
    before = runtime.bytes_streamed
    ring.count_step()
    assert runtime.bytes_streamed - before == ring.step_bytes
    assert runtime.completed_bytes() == runtime.bytes_streamed
    assert ring.copies == [(layer, idx % ring.n) for idx, (layer, _) in enumerate(runtime.units)]
    ring.exit()
    assert not runtime._suspended
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
