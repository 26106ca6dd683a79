"""Streamed execution: decoder layers whose MLP does not fit the weight budget pass through slots.

The plan (``wire.Plan``, computed by the daemon's planner) keeps anchors resident and streams the
MLP blocks of a run of layers (the first ones) through a ring of ``N`` slots, one *unit* per
slot: a layer's whole MLP, or with ``stream_unit: projection`` one of its projections (gate, up,
down; ``wire.stream_units``). Streamed unit ``idx`` (in forward order) is bound for good to slot
``idx % N``: its parameters are views into that slot, so nothing is rebound per token.

Per unit, two hooks on the module that runs it (the decoder layer, or the projection's linear
module) keep the ring moving:

* pre-forward: issue the unit's copy if the window has not already done so, then make the
  compute stream wait on the slot's *copy-done* event (the GPU waits, not the CPU);
* post-forward: record the slot's *compute-done* event, then issue the copies of the next units
  within the prefetch window whose slots are free; each copy first makes the copy stream wait on
  the slot's compute-done event, so a slot is overwritten only after its last reader ran. The
  window may be every slot: the slot just computed is refilled at once (on the GPU, after that
  compute), which matters between passes -- the host then samples a token and runs the resident
  layers, issuing nothing, while the queued copies keep the link busy.

Copies come from the client's own mapping of the host arena (page-locked once in this process)
into the slots on a dedicated copy stream, so no request crosses the socket on the per-layer path.
On the CPU the same schedule runs with plain synchronous copies; that is what CI tests.

Slots are per client: a slot's contents follow one client's position in its own forward pass, so
sharing slots would serialize clients. Resident blocks are shared by every client.
"""
from __future__ import annotations

import logging
import threading
from collections import deque

from ..errors import FlashError
from ..fsutil import align_up
from ..prefetch import WindowController
from ..store.views import block_tensors
from ..store.views import range_tensors
from ..wire import SLOT_ALIGNMENT, Plan, stream_units, unit_module
from .link import LinkSampler, _sm_clock_mhz
from .skeleton import bind_parameters, decoder_parts
from .static_ring import StaticRing
from .streamed_host import StreamedHost

log = logging.getLogger("deepseek_flash.stream")

# A compute stream that waited longer than this on a copy counts as a stalled layer.
STALL_THRESHOLD_US = 20.0


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


class _Reporting:
    """Counters sent to the controller from a background thread (``stats()`` is the subclass's)."""

    _reporter = None

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

    def _stop_reporting(self) -> None:
        if self._reporter is not None:
            self._stop.set()
            self._reporter.join()
            self._report(self.stats())
            self._reporter = None


class StreamRuntime(_Reporting):
    """Runs one client's ring of slots for one model (see the module docstring)."""

    def __init__(self, model, plan: Plan, blocks: dict, host, host_offsets: dict, slots: list,
                 device, window: int, fetch_host=None, complete: bool = True):
        self.plan = plan
        self.blocks = blocks                 # block id -> BlockInfo
        self.host = host                     # uint8 tensor over the host arena (this mapping)
        self.host_offsets = host_offsets     # block id -> host arena offset (leased)
        self.fetch_host = fetch_host         # layer -> {block id: host offset}, for cold layers
        self.slots = slots                   # uint8 tensors, one per slot, on the device
        self.layers = list(plan.streamed_layers)
        # (layer, [(block id, offset in the block, offset in the slot, length)]) per unit.
        self.units: list[tuple[int, list]] = []
        for layer in self.layers:
            group = [blocks[bid] for bid in plan.stream_blocks[layer]]
            for ranges in stream_units(group, plan.unit):
                offset, layout = 0, []
                for bid, start, length in ranges:
                    layout.append((bid, start, offset, length))
                    offset += align_up(length, SLOT_ALIGNMENT)
                self.units.append((layer, layout))
        self.n = len(slots)
        self.m = len(self.units)
        self._suspended = False              # a static schedule runs the ring (``StaticRing``)
        self.ops = _CpuOps() if device == "cpu" else _CudaOps(int(device))
        self.is_cuda = device != "cpu"
        # Up to every slot ahead: the copy into a slot waits (on the GPU) for its last reader.
        self.controller = WindowController(window, low=min(1, window), high=self.n)
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
        self._in_flight: deque = deque()    # (slot, bytes) copies issued, oldest first (CUDA)
        self._bytes_completed = 0
        self._issued_mark = 0
        self.tokens = 0
        self._pass_misses = 0
        self._pass_stalls = 0
        self._timing: deque = deque()       # (start, end) timing events in flight, oldest first
        self._timing_pool: list = []
        self.host_side = None                # StreamedHost (daemon mode on a GPU), else None
        self._copy_trace = None              # trace_copies(): (seq, start, end) timing events
        self._copy_trace_limit = 0
        self.close_hooks: list = []          # run once at close (the host leases go back)
        self._bind(model, complete)
        self.link = LinkSampler(int(device), self.completed_bytes).start() if self.is_cuda else None
        self._hooks = []
        embed, decoder_layers, _, _ = decoder_parts(model)
        # The module that runs each unit (after binding: a quantized weight's module is swapped).
        if plan.unit == "layer":
            self.unit_modules = [decoder_layers[layer] for layer, _ in self.units]
        else:
            self.unit_modules = [model.get_submodule(self._unit_name(layout))
                                 for _, layout in self.units]
        self._hooked = [embed] + self.unit_modules
        # The first copies are issued when a pass starts (at the embeddings), not here: an
        # attach never waits for the streamed blocks' host leases or their disk reads.
        self._hooks.append(embed.register_forward_pre_hook(self._start_hook))
        for idx, module in enumerate(self.unit_modules):
            self._hooks.append(module.register_forward_pre_hook(self._pre_hook(idx)))
            self._hooks.append(module.register_forward_hook(self._post_hook(idx)))

    # --- binding ---------------------------------------------------------------------------------
    def _unit_name(self, layout) -> str:
        """The module a unit's first range serves (``stream_unit: projection``)."""
        bid, start = layout[0][0], layout[0][1]
        name = next(t.name for t in self.blocks[bid].tensors if t.offset == start)
        return unit_module(name)

    def _bind(self, model, complete: bool) -> None:
        tensors = {}
        for idx, (_, layout) in enumerate(self.units):
            slot = self.slots[idx % self.n]
            placed: dict[int, dict] = {}
            for bid, start, offset, length in layout:
                placed.setdefault(bid, {})[start] = slot[offset:offset + length]
            for bid, ranges in placed.items():
                block = self.blocks[bid]
                if list(ranges) == [0] and ranges[0].numel() == block.length:
                    tensors.update(block_tensors(block, ranges[0]))
                else:
                    tensors.update(range_tensors(block, ranges))
        # ``complete``: every parameter is bound afterwards (not so for one part of a split model);
        # not ``fixed``: a slot's bytes change every pass.
        bind_parameters(model, tensors, complete=complete, fixed=False)

    # --- schedule --------------------------------------------------------------------------------
    def _slot_of(self, seq: int) -> int:
        return (seq % self.m) % self.n

    def _issue(self, seq: int) -> None:
        """Copy the ranges of ``seq``'s unit into its slot (after the slot's last reader)."""
        layer, layout = self.units[seq % self.m]
        slot = self._slot_of(seq)
        wait_for = self.compute_done[slot] if self._slot_owner[slot] is not None else None
        traced = self._copy_trace is not None and len(self._copy_trace) < self._copy_trace_limit
        if traced:
            stream = self.ops.copy_stream
            if wait_for is not None:
                stream.wait_event(wait_for)
                wait_for = None
            start, end = self.ops.event(timing=True), self.ops.event(timing=True)
            start.record(stream)
        for bid, begin, offset, n in layout:
            src_off = self.host_offsets.get(bid)
            if src_off is None:
                self.host_offsets.update(self.fetch_host(layer))
                src_off = self.host_offsets[bid]
            src_off += begin
            self.ops.copy(self.slots[slot][offset:offset + n], self.host[src_off:src_off + n], wait_for)
            wait_for = None
            self.bytes_streamed += n
        self.ops.record_copy(self.copy_done[slot])
        if traced:
            end.record(stream)
            self._copy_trace.append((seq, start, end))
        if self.is_cuda:
            self._in_flight.append((slot, self.bytes_streamed - self._issued_mark))
            self._issued_mark = self.bytes_streamed
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

    def _start_hook(self, module, args):
        """A pass starts: copies up to the window ahead of the next streamed unit (normally
        issued already by the previous pass's last units; on the first pass, here)."""
        if self._suspended:
            return
        with self._lock:
            self._fill(self._next - 1)

    def _pre_hook(self, idx: int):
        def pre(module, args):
            if self._suspended:
                return
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
            if self._suspended:
                return
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
        log.warning("streamed pass resynchronised at unit %d of layer %d (expected unit %d)", idx,
                    self.units[idx][0], self._next % self.m)
        self.ops.synchronize()
        base = (self._issued // self.m + 1) * self.m + idx
        self._slot_owner = [None] * self.n
        self._slot_busy = [False] * self.n
        self._issued = base - 1
        self._next = base
        self._fill(base - 1)

    # --- measurement -----------------------------------------------------------------------------
    def completed_bytes(self) -> int:
        """Bytes whose copies have finished on the copy stream (all issued bytes on the CPU).

        Copies finish in issue order (one stream), so the walk stops at the first unfinished one.
        A slot's event may since have been recorded again for a later copy: that one finishing
        means the earlier did too; until it does, the earlier one is counted a little late."""
        if not self.is_cuda:
            return self.bytes_streamed
        with self._lock:
            while self._in_flight and self.copy_done[self._in_flight[0][0]].query():
                self._bytes_completed += self._in_flight.popleft()[1]
            return self._bytes_completed

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
            return {"streamed_layers": len(self.layers), "streamed_units": self.m, "slots": self.n,
                    "prefetch_window": self.controller.window,
                    "prefetch_hits": self.hits, "prefetch_miss_count": self.misses,
                    "prefetch_hit_rate": self.hits / total if total else 0.0,
                    "fabric_stall_us": self.stall_us,
                    "fabric_stall_cycles": int(self.stall_us * _sm_clock_mhz()),
                    "bytes_streamed": self.bytes_streamed, "passes": self.tokens,
                    "decisions": list(self.controller.decisions)}

    def trace_copies(self, limit: int = 512) -> None:
        """A diagnostic (CUDA): time the next ``limit`` units' copies on the copy stream
        (``copy_trace``), to see where the link idles. Off by default; a few microseconds a unit."""
        with self._lock:
            self._copy_trace = [] if self.is_cuda else None
            self._copy_trace_limit = limit

    def copy_trace(self) -> list[dict]:
        """The traced copies, in issue order (= copy-stream order): the pass, the streamed
        unit's index in it (``units``), start and end in ms from the first traced copy's start.
        Waits for them; stops tracing."""
        with self._lock:
            trace, self._copy_trace = self._copy_trace or [], None
        if not trace:
            return []
        trace[-1][2].synchronize()
        first = trace[0][1]
        return [{"pass": seq // self.m, "idx": seq % self.m,
                 "start_ms": round(first.elapsed_time(start), 3),
                 "end_ms": round(first.elapsed_time(end), 3)} for seq, start, end in trace]

    # --- static schedule (decode steps) ---------------------------------------------------------
    def hooked_modules(self) -> list:
        """The modules this runtime's hooks sit on (the embeddings, the streamed layers)."""
        return list(self._hooked)

    def static_ring(self) -> StaticRing:
        """The same ring as a fixed schedule the caller runs itself (``StaticRing``)."""
        return StaticRing(self)

    def suspend(self) -> None:
        """Static steps run the ring (``StaticRing.enter``): the hooks do nothing until ``resume``
        (a static step calls the units' modules too, when they are projections)."""
        self._suspended = True

    def resume(self) -> None:
        """Hooks take over again after static steps: nothing in a slot is trusted (the static
        steps left other units there), and the next copies wait for the last compute."""
        self._suspended = False
        with self._lock:
            if self.is_cuda:
                import torch

                self.ops.copy_stream.wait_stream(torch.cuda.current_stream(self.ops.device))
            self._slot_owner = [None] * self.n
            self._slot_busy = [False] * self.n
            self._issued = self._next - 1

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        # The model holds this runtime (``model.flash.stream``): without this reference back, a
        # closed model and its slot views die with their last reference, not at the next cyclic
        # garbage collection (device memory the arena has already handed out again).
        self._hooked = []
        self.unit_modules = []
        if self.link is not None:
            self.link.stop()
        self.ops.synchronize()
        self._stop_reporting()
        for hook in self.close_hooks:
            hook()
        self.close_hooks = []


_SUMMED = ("streamed_layers", "streamed_units", "slots", "prefetch_hits", "prefetch_miss_count",
           "fabric_stall_us",
           "fabric_stall_cycles", "bytes_streamed")


class StreamGroup(_Reporting):
    """The streaming runtimes of one model split over devices (one per streaming part,
    ``load_model(device_map=...)``), seen as one: summed counters (each part's under ``parts``),
    one report to the controller, one close. Each runtime keeps its own slots, copy stream,
    window and link sampler: the parts' links work side by side."""

    def __init__(self, runtimes: list):
        self.runtimes = list(runtimes)

    def stats(self, settle: bool = True) -> dict:
        parts = [r.stats(settle) for r in self.runtimes]
        out = {k: sum(p[k] for p in parts) for k in _SUMMED}
        total = out["prefetch_hits"] + out["prefetch_miss_count"]
        out.update(prefetch_hit_rate=out["prefetch_hits"] / total if total else 0.0,
                   prefetch_window=max(p["prefetch_window"] for p in parts),
                   passes=max(p["passes"] for p in parts),
                   decisions=[d for p in parts for d in p["decisions"]], parts=parts)
        return out

    def close(self) -> None:
        for runtime in self.runtimes:
            runtime.close()
        self._stop_reporting()


def start_streaming(model, handle, plan: Plan, desc: dict, memory, target,
                    part: bool = False) -> StreamRuntime:
    """The streamed part of an attach (``load_model`` bound the resident part): slots, host
    leases of the streamed blocks (after a prefetch hint that starts their disk reads now), the
    runtime, and its counter reports. In daemon mode on a GPU the leases and the page-locking
    of the streamed ranges run in the background (``StreamedHost``); embedded, the controller
    pinned the whole arena already. ``part``: one device's share of a split model (its
    parameters are not all of the model's; its counters are reported with the other parts')."""
    import torch

    client, info = handle.client, handle.info
    blocks = {b.id: b for b in info.blocks}
    if target == "cpu":
        slots = [torch.empty(plan.slot_bytes, dtype=torch.uint8) for _ in range(plan.n_slots)]
    else:
        slots = [memory[off:off + plan.slot_bytes] for off in desc["slots"]]
    client.prefetch(info.name, layers=plan.streamed_layers)
    if target != "cpu" and client.mode == "daemon":
        host = client.host_tensor()
        side = StreamedHost(client, info.name, plan, blocks, client.arena.address,
                            priority=handle.priority)
        fetch_host, close = side.fetch, side.close
        side.start()
    else:
        host = client.host_tensor(pinned=target != "cpu")
        side = None
        leases = []

        def fetch_host(layer: int) -> dict:
            lease = client.acquire(info.name, blocks=plan.stream_blocks[layer],
                                   priority=handle.priority)
            leases.append(lease)
            return lease.blocks

        def close():
            for lease in leases:
                client.release(lease)

    runtime = StreamRuntime(model, plan, blocks, host, {}, slots, target, plan.window, fetch_host,
                            complete=not part)
    runtime.host_side = side
    if not part:
        start_reports(runtime, handle)
    runtime.close_hooks.append(close)
    return runtime


def start_reports(source, handle) -> None:
    """``source``'s counters (a runtime or a ``StreamGroup``) to the controller once a second."""
    client, name = handle.client, handle.info.name
    source.start_reporting(lambda stats: client.call("report_stream", {"model": name, "stats": stats}))
