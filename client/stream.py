"""Streamed execution: decoder layers whose MLP does not fit the weight budget pass through slots.

The plan (``wire.Plan``, computed by the daemon's planner) keeps anchors resident and streams the
MLP blocks of a tail of layers through a ring of ``N`` slots. Streamed layer ``idx`` (in forward order) is bound for good
to slot ``idx % N``: its parameters are views into that slot, so nothing is rebound per token.

Per streamed layer, two hooks on the decoder layer (never per tensor) keep the ring moving:

* pre-forward: issue the layer's copy if the window has not already done so, then make the
  compute stream wait on the slot's *copy-done* event (the GPU waits, not the CPU);
* post-forward: record the slot's *compute-done* event, then issue the copies of the next layers
  within the prefetch window whose slots are free; each copy first makes the copy stream wait on
  the slot's compute-done event, so a slot is overwritten only after its last reader ran.

Copies come from the client's own mapping of the host arena (page-locked once in this process)
into the slots on a dedicated copy stream, so no request crosses the socket on the per-layer path.
On the CPU the same schedule runs with plain synchronous copies; that is what CI tests.

Slots are per client: a slot's contents follow one client's position in its own forward pass, so
sharing slots would serialize clients. Resident blocks are shared by every client.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque

from ..errors import FlashError
from ..fsutil import align_up
from ..prefetch import WindowController
from ..store.views import block_tensors
from ..wire import SLOT_ALIGNMENT, Plan
from .skeleton import bind_parameters, decoder_parts

log = logging.getLogger("deepseek_flash.stream")

# A compute stream that waited longer than this on a copy counts as a stalled layer.
STALL_THRESHOLD_US = 20.0
# Nominal clock for fabric_stall_cycles where NVML cannot tell the SM clock.
NOMINAL_CLOCK_MHZ = 1000


class _CpuOps:
    """The schedule's primitives on the CPU: copies are synchronous, so events are no-ops."""

    def __init__(self):
        self.copy_stream = None

    def event(self, timing: bool = False):
        return None

    def copy(self, dst, src, wait_for):
        dst.copy_(src)

    def record_copy(self, event):
        pass

    def wait_copy(self, event):
        pass

    def record_compute(self, event):
        pass

    def synchronize(self):
        pass


class _CudaOps:
    """The schedule's primitives on a CUDA device: a copy stream and events."""

    def __init__(self, device: int):
        import torch

        self.torch = torch
        self.device = device
        self.copy_stream = torch.cuda.Stream(device=device)

    def event(self, timing: bool = False):
        return self.torch.cuda.Event(enable_timing=timing)

    def copy(self, dst, src, wait_for):
        with self.torch.cuda.stream(self.copy_stream):
            if wait_for is not None:
                self.copy_stream.wait_event(wait_for)
            dst.copy_(src, non_blocking=True)

    def record_copy(self, event):
        event.record(self.copy_stream)

    def wait_copy(self, event):
        self.torch.cuda.current_stream(self.device).wait_event(event)

    def record_compute(self, event):
        event.record(self.torch.cuda.current_stream(self.device))

    def synchronize(self):
        self.copy_stream.synchronize()
        self.torch.cuda.current_stream(self.device).synchronize()


class StreamRuntime:
    """Runs one client's ring of slots for one model (see the module docstring)."""

    def __init__(self, model, plan: Plan, blocks: dict, host, host_offsets: dict, slots: list,
                 device, window: int, fetch_host=None):
        self.plan = plan
        self.blocks = blocks                 # block id -> BlockInfo
        self.host = host                     # uint8 tensor over the host arena (this mapping)
        self.host_offsets = host_offsets     # block id -> host arena offset (leased)
        self.fetch_host = fetch_host         # layer -> {block id: host offset}, for cold layers
        self.slots = slots                   # uint8 tensors, one per slot, on the device
        self.layers = list(plan.streamed_layers)
        self.n = len(slots)
        self.m = len(self.layers)
        self.ops = _CpuOps() if device == "cpu" else _CudaOps(int(device))
        self.is_cuda = device != "cpu"
        self.controller = WindowController(window, low=min(1, window), high=self.n - 1 if self.n > 1 else 0)
        self.copy_done = [self.ops.event() for _ in range(self.n)]
        self.compute_done = [self.ops.event() for _ in range(self.n)]
        self._slot_owner = [None] * self.n   # seq whose bytes the slot holds (or is receiving)
        self._slot_busy = [False] * self.n   # copied-into but not yet consumed
        self._issued = -1                    # highest seq issued (seq = pass * m + idx)
        self._next = 0                       # seq expected at the next pre-hook
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.stall_us = 0.0
        self.bytes_streamed = 0
        self.tokens = 0
        self._pass_misses = 0
        self._pass_stalls = 0
        self._timing: deque = deque()       # (start, end) timing events in flight, oldest first
        self._timing_pool: list = []
        self._reporter = None
        self.close_hooks: list = []          # run once at close (the host leases go back)
        self._slot_layout = {}
        for layer in self.layers:
            offset, layout = 0, []
            for bid in plan.stream_blocks[layer]:
                layout.append((bid, offset))
                offset += align_up(blocks[bid].length, SLOT_ALIGNMENT)
            self._slot_layout[layer] = layout
        self._bind(model)
        self.link = LinkSampler(int(device), lambda: self.bytes_streamed).start() if self.is_cuda else None
        self._hooks = []
        _, decoder_layers, _, _ = decoder_parts(model)
        for idx, layer in enumerate(self.layers):
            module = decoder_layers[layer]
            self._hooks.append(module.register_forward_pre_hook(self._pre_hook(idx)))
            self._hooks.append(module.register_forward_hook(self._post_hook(idx)))
        with self._lock:
            self._fill(0)

    # --- binding ---------------------------------------------------------------------------------
    def _bind(self, model) -> None:
        tensors = {}
        for idx, layer in enumerate(self.layers):
            slot = self.slots[idx % self.n]
            for bid, offset in self._slot_layout[layer]:
                block = self.blocks[bid]
                tensors.update(block_tensors(block, slot[offset:offset + block.length]))
        bind_parameters(model, tensors)

    # --- schedule --------------------------------------------------------------------------------
    def _slot_of(self, seq: int) -> int:
        return (seq % self.m) % self.n

    def _issue(self, seq: int) -> None:
        """Copy the blocks of ``seq``'s layer into its slot (after the slot's last reader)."""
        layer = self.layers[seq % self.m]
        slot = self._slot_of(seq)
        wait_for = self.compute_done[slot] if self._slot_owner[slot] is not None else None
        for bid, offset in self._slot_layout[layer]:
            src_off = self.host_offsets.get(bid)
            if src_off is None:
                self.host_offsets.update(self.fetch_host(layer))
                src_off = self.host_offsets[bid]
            n = self.blocks[bid].length
            self.ops.copy(self.slots[slot][offset:offset + n], self.host[src_off:src_off + n], wait_for)
            wait_for = None
            self.bytes_streamed += n
        self.ops.record_copy(self.copy_done[slot])
        self._slot_owner[slot] = seq
        self._slot_busy[slot] = True
        self._issued = seq

    def _fill(self, current: int) -> None:
        """Issue copies for seqs after ``current`` up to the window, while their slots are free."""
        window = self.controller.window
        while self._issued < current + window:
            seq = self._issued + 1
            if self._slot_busy[self._slot_of(seq)]:
                break
            self._issue(seq)

    def _pre_hook(self, idx: int):
        def pre(module, args):
            with self._lock:
                if self._next % self.m != idx:
                    self._resync(idx)
                seq = self._next
                slot = self._slot_of(seq)
                # A hit: the copy was issued before the layer asked for it (prefetched). Whether
                # the compute stream still waits on it is the stall, measured separately.
                prefetched = self._issued >= seq
                if not prefetched:
                    self._issue(seq)
                self._count(hit=prefetched)
                if self.is_cuda:
                    start, end = (self._timing_pool.pop() if self._timing_pool else
                                  (self.ops.event(timing=True), self.ops.event(timing=True)))
                    self.ops.record_compute(start)
                    self.ops.wait_copy(self.copy_done[slot])
                    self.ops.record_compute(end)
                    self._timing.append((start, end))
                    self._harvest()
        return pre

    def _post_hook(self, idx: int):
        def post(module, args, output):
            with self._lock:
                seq = self._next
                slot = self._slot_of(seq)
                self.ops.record_compute(self.compute_done[slot])
                self._slot_busy[slot] = False
                self._next = seq + 1
                if idx == self.m - 1:
                    self._end_of_pass()
                self._fill(seq)
        return post

    def _resync(self, idx: int) -> None:
        """A forward pass was cut short (an exception mid-model): restart the ring at ``idx``."""
        log.warning("streamed pass resynchronised at layer %d (expected %d)", self.layers[idx],
                    self.layers[self._next % self.m])
        self.ops.synchronize()
        base = (self._issued // self.m + 1) * self.m + idx
        self._slot_owner = [None] * self.n
        self._slot_busy = [False] * self.n
        self._issued = base - 1
        self._next = base
        self._fill(base - 1)

    # --- measurement -----------------------------------------------------------------------------
    def _count(self, hit: bool) -> None:
        if hit:
            self.hits += 1
        else:
            self.misses += 1
            self._pass_misses += 1

    def _harvest(self, block: bool = False) -> None:
        """Add the stall time of finished timing pairs (never blocks by default). Pairs finish in
        the order they were recorded on the one compute stream, so the walk stops at the first
        unfinished pair, and finished pairs go back to the pool."""
        while self._timing:
            start, end = self._timing[0]
            if block:
                end.synchronize()
            elif not end.query():
                break
            self._timing.popleft()
            us = start.elapsed_time(end) * 1000.0
            self.stall_us += us
            if us > STALL_THRESHOLD_US:
                self._pass_stalls += 1
            self._timing_pool.append((start, end))

    def _end_of_pass(self) -> None:
        self.tokens += 1
        # Grow the window on layers that were not prefetched or that stalled on their copy.
        link = self.link.load if self.link is not None else None
        self.controller.update(max(self._pass_misses, self._pass_stalls), self.m, link)
        self._pass_misses = 0
        self._pass_stalls = 0

    def stats(self, settle: bool = True) -> dict:
        """Counters so far; ``settle`` first waits for timing events still in flight."""
        with self._lock:
            if self.is_cuda:
                self._harvest(block=settle)
            total = self.hits + self.misses
            return {"streamed_layers": self.m, "slots": self.n, "prefetch_window": self.controller.window,
                    "prefetch_hits": self.hits, "prefetch_miss_count": self.misses,
                    "prefetch_hit_rate": self.hits / total if total else 0.0,
                    "fabric_stall_us": self.stall_us,
                    "fabric_stall_cycles": int(self.stall_us * _sm_clock_mhz()),
                    "bytes_streamed": self.bytes_streamed, "passes": self.tokens,
                    "decisions": list(self.controller.decisions)}

    def start_reporting(self, send, interval: float = 1.0) -> None:
        """Send ``stats()`` to the controller every ``interval`` seconds from a background
        thread (never from the per-layer path), and once more at close."""
        self._send = send
        self._stop = threading.Event()

        def loop():
            last = None
            while not self._stop.wait(interval):
                stats = self.stats(settle=False)
                if stats != last:
                    self._report(stats)
                    last = stats

        self._reporter = threading.Thread(target=loop, daemon=True, name="flash-stream-report")
        self._reporter.start()

    def _report(self, stats: dict) -> None:
        try:
            self._send(stats)
        except (FlashError, OSError) as exc:   # the controller may be restarting; the next report catches up
            log.debug("stream report not sent: %s", exc)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.link is not None:
            self.link.stop()
        self.ops.synchronize()
        if self._reporter is not None:
            self._stop.set()
            self._reporter.join()
            self._report(self.stats())
            self._reporter = None
        for hook in self.close_hooks:
            hook()
        self.close_hooks = []


# nvmlDeviceGetPcieLinkMaxSpeed answers with an enum (NVML_PCIE_LINK_MAX_SPEED_*), not a number:
# 1..6 stand for 2500, 5000, 8000, 16000, 32000, 64000 Mbit/s per lane (PCIe generations 1..6).
_NVML_LINK_SPEED_MBPS = {1: 2500, 2: 5000, 3: 8000, 4: 16000, 5: 32000, 6: 64000}


def pcie_capacity(nv, handle) -> float:
    """The device's PCIe link capacity in bytes/s, one direction: per-lane signalling rate, less
    line encoding (8b/10b up to 5 GT/s, 128b/130b from 8 GT/s), times the link width."""
    speed = int(nv.nvmlDeviceGetPcieLinkMaxSpeed(handle))
    mbps = _NVML_LINK_SPEED_MBPS.get(speed, speed)   # a driver that answers in Mbit/s: as is
    encoding = 8 / 10 if mbps <= 5000 else 128 / 130
    return mbps * 1e6 / 8 * encoding * int(nv.nvmlDeviceGetMaxPcieLinkWidth(handle))


class LinkSampler:
    """How busy the PCIe link is with traffic that is not this client's streaming.

    A background thread reads the device's PCIe receive throughput from NVML every ``interval``
    seconds, subtracts what this process streamed over the same interval, and keeps the rest as a
    fraction of the link's capacity in ``load`` (None until the first sample, or without NVML).
    """

    def __init__(self, device: int, streamed_bytes, interval: float = 0.5, nvml=None):
        self.load: float | None = None
        self._streamed = streamed_bytes          # callable: bytes this client streamed so far
        self._interval = interval
        self._stop = threading.Event()
        self._nvml = nvml
        self._device = device
        self._thread = threading.Thread(target=self._run, daemon=True, name="flash-link-sampler")

    def start(self) -> LinkSampler:
        self._thread.start()
        return self

    def _open(self):
        if self._nvml is None:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
        nv = self._nvml
        handle = nv.nvmlDeviceGetHandleByIndex(self._device)
        return handle, pcie_capacity(nv, handle)

    def sample(self, handle, capacity, last_bytes: int, seconds: float) -> int:
        """One measurement: update ``load``; returns the streamed-bytes mark for the next one."""
        nv = self._nvml
        rx = nv.nvmlDeviceGetPcieThroughput(handle, nv.NVML_PCIE_UTIL_RX_BYTES) * 1024.0  # KB/s
        now_bytes = self._streamed()
        ours = (now_bytes - last_bytes) / seconds if seconds > 0 else 0.0
        self.load = max(0.0, rx - ours) / capacity if capacity else None
        return now_bytes

    def _run(self) -> None:
        try:
            handle, capacity = self._open()
        except Exception as exc:   # noqa: BLE001 -- NVML absent or refusing (its own error types):
            log.debug("PCIe load not sampled: %s", exc)   # the window then ignores the link
            return
        mark, t = self._streamed(), time.monotonic()
        while not self._stop.wait(self._interval):
            now = time.monotonic()
            try:
                mark = self.sample(handle, capacity, mark, now - t)
            except Exception as exc:   # noqa: BLE001 -- a sampler thread must outlive NVML hiccups
                log.debug("PCIe sample failed: %s", exc)
            t = now

    def stop(self) -> None:
        self._stop.set()


def _sm_clock_mhz() -> int:
    try:
        import pynvml
    except ImportError:
        return NOMINAL_CLOCK_MHZ
    try:
        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetClockInfo(pynvml.nvmlDeviceGetHandleByIndex(0),
                                                 pynvml.NVML_CLOCK_SM)) or NOMINAL_CLOCK_MHZ
    except pynvml.NVMLError:   # no GPU or no driver: the nominal clock (docs/architecture.md)
        return NOMINAL_CLOCK_MHZ


def start_streaming(model, handle, plan: Plan, desc: dict, memory, target) -> StreamRuntime:
    """The streamed part of an attach (``load_model`` bound the resident part): slots, host
    leases of the streamed blocks (taken per layer on the first pass, after a prefetch hint that
    starts their disk reads now), the runtime, and its counter reports."""
    import torch

    client, info = handle.client, handle.info
    if target == "cpu":
        slots = [torch.empty(plan.slot_bytes, dtype=torch.uint8) for _ in range(plan.n_slots)]
    else:
        slots = [memory[off:off + plan.slot_bytes] for off in desc["slots"]]
    host = client.host_tensor(pinned=target != "cpu")
    client.prefetch(info.name, layers=plan.streamed_layers)
    leases = []

    def fetch_host(layer: int) -> dict:
        lease = client.acquire(info.name, blocks=plan.stream_blocks[layer],
                               priority=handle.priority)
        leases.append(lease)
        return lease.blocks

    runtime = StreamRuntime(model, plan, {b.id: b for b in info.blocks}, host, {}, slots, target,
                            info.flash_config["prefetch_window"], fetch_host)
    runtime.start_reporting(lambda stats: client.call(
        "report_stream", {"model": info.name, "stats": stats}))
    runtime.close_hooks.append(lambda: [client.release(lease) for lease in leases])
    return runtime
