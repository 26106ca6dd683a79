"""Device loads: fill a model's memory on one device in forward order, gate by gate.

A *load* is what ``load_model`` attaches to. It owns a small *control page* in the shared host
arena (gate states and block offsets; the layout is ``deepseek_flash.wire``'s).

The loader thread walks the stages in forward order. For each stage it takes the host blocks
(the block manager reads them from NVMe, many stages in flight at once so the disk queue stays
deep), then:

* device ``cpu`` -- the host arena *is* the device memory: it writes the blocks' host offsets and
  opens the gate; the blocks stay leased to the client for as long as it keeps the model;
* device ``cuda:N`` -- it enqueues the stage's copies into the GPU arena on the copy stream,
  records the stage's interprocess event, then opens the gate; the host lease is dropped once the
  copy has finished, so a model larger than the host cache still loads.

A client's layer waits only where its gate is still closed (``client.model.Gates``). GPU loads are
shared by every client of the model on that device and outlive them until evicted or unloaded;
CPU loads are one per client, over shared host blocks.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait

from ..errors import (
    ArenaFull,
    BudgetTooSmall,
    DeviceError,
    FlashError,
    LeaseError,
    UnknownClient,
)
from ..prefetch import ForwardOrder
from ..wire import GATE_FAILED, GATE_READY, control_page_size, control_views
from .host_state import DAEMON_CLIENT

log = logging.getLogger("deepseek_flash.loader")


class Load:
    """One model's memory on one device, and the thread that fills it."""

    def __init__(self, manager, arena, info, device, owner: int, resident: list[int],
                 placement=None, requester: int | None = None, priority: int = 0, startup=None):
        self.manager = manager
        self.arena = arena
        self.info = info
        self.device = device                     # "cpu" or a CUDA index
        self.owner = owner                       # client whose leases keep host blocks (cpu)
        self.requester = owner if requester is None else requester   # whose reads (profiler)
        self.placement = placement
        self.priority = priority                 # of the reads (the attach that started it)
        self.resident = frozenset(resident)      # the blocks this load puts on the device
        self.order = ForwardOrder([b for b in info.blocks if b.id in self.resident],
                                  info.num_layers)
        self.index = {b.id: i for i, b in enumerate(info.blocks)}
        self.num_gates = len(self.order.stages)
        self.control_offset = arena.alloc(control_page_size(self.num_gates, len(info.blocks)))
        self.gates, self.offsets = control_views(arena, self.control_offset, self.num_gates,
                                                 len(info.blocks))
        self.gates[:] = 0
        self.leases: list[int] = []
        self.clients: set[int] = set()
        self.last_used = time.monotonic()
        self.error: FlashError | None = None
        self.finished: Future = Future()        # resolved (or failed) when the walk ends
        self.seconds: float | None = None        # start -> every block on the device (logged)
        self._stop: FlashError | None = None     # set by close(): the walk ends at its next stage
        # Blocks read beyond the host arena while CUDA started (GPU loads; startup_reads.py).
        self.startup = startup if placement is not None else None
        if self.startup is not None:
            self.startup.load = self
        if placement is not None:
            for bid, off in placement.offsets.items():
                self.offsets[self.index[bid]] = off
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"flash-load-{info.name}-{device}")

    def start(self) -> Load:
        self._thread.start()
        return self

    def describe(self) -> dict:
        out = {"model": self.info.name, "device": self.device, "control_offset": self.control_offset,
               "num_gates": self.num_gates, "num_blocks": len(self.info.blocks)}
        if self.placement is not None:
            out["events"] = self.placement.event_handles
        return out

    def _run(self) -> None:
        started = time.monotonic()
        stages = self.order.stages
        # Keep at most half the host arena in flight for a GPU load: stages leave the host tier
        # once copied, so a model larger than the host cache streams through it.
        window = self.arena.size // 2 if self.placement is not None else None
        futures: dict[int, object] = {}         # gate -> its host acquire (None: nothing to lease)
        beyond: dict[int, list[int]] = {}       # gate -> its blocks read beyond the arena
        length = {b.id: b.length for b in self.info.blocks}
        stage_bytes = [sum(length[b] for b in s) for s in stages]
        host_bytes: dict[int, int] = {}         # gate -> bytes its host lease holds
        submitted = 0
        inflight = 0
        copied: deque = deque()
        startup = self.startup
        try:
            for gate in range(self.num_gates):
                if self._stop is not None:
                    raise self._stop
                while submitted < self.num_gates:
                    stage = stages[submitted]
                    # Blocks read beyond the host arena while CUDA started take no host lease.
                    outside = [] if startup is None else startup.covered(stage)
                    from_host = [b for b in stage if b not in outside]
                    cost = sum(length[b] for b in from_host)
                    fits = window is None or inflight + cost <= window
                    if not fits and submitted <= gate and copied:
                        # The window is full of stages whose copies are still on the link (the
                        # walk outruns the copies when the host tier already holds the stages):
                        # wait for the oldest instead of taking more of the host arena than the
                        # window, which a model larger than the arena cannot give (its next
                        # read would find every block leased: OutOfMemory).
                        g, lease_id = copied.popleft()
                        self.placement.events[g].synchronize()
                        self._release(lease_id)
                        inflight -= host_bytes.pop(g)
                        continue
                    if not fits and submitted > gate:
                        break
                    if outside:
                        beyond[submitted] = outside
                    futures[submitted] = None
                    if from_host:
                        futures[submitted] = self.manager.acquire_async(
                            self.owner, self.info.name, blocks=from_host,
                            priority=self.priority, requester=self.requester)
                        inflight += cost
                        host_bytes[submitted] = cost
                    submitted += 1
                future = futures.pop(gate)
                if not stages[gate]:
                    self.gates[gate] = GATE_READY
                    continue
                buffers = None
                if gate in beyond:
                    try:
                        buffers = startup.take(beyond[gate])
                    except FlashError as exc:
                        # Read the stage again, whole, through the host tier (its typed errors
                        # and recovery); what was leased of it is handed back first.
                        log.warning("loading %s: a block read while CUDA started failed (%s); "
                                    "reading it again", self.info.name, exc)
                        del beyond[gate]
                        if future is not None:
                            self.manager.release(self.owner, future.result().id)
                            inflight -= host_bytes.pop(gate)
                        future = self.manager.acquire_async(
                            self.owner, self.info.name, blocks=list(stages[gate]),
                            priority=self.priority, requester=self.requester)
                        host_bytes[gate] = stage_bytes[gate]
                        inflight += stage_bytes[gate]
                lease = None if future is None else future.result()
                if lease is not None:
                    self.leases.append(lease.id)
                if self.placement is None:
                    for bid, off in lease.blocks.items():
                        if bid in self.index:
                            self.offsets[self.index[bid]] = off
                    self.gates[gate] = GATE_READY
                    continue
                lengths = {b: length[b] for b in stages[gate]}
                # Copies enqueued and the gate's event recorded: only now may clients wait on it.
                if buffers is None:
                    self.placement.fabric.copy_gate(self.placement, gate, lease.blocks, lengths)
                else:
                    self.placement.fabric.copy_gate(self.placement, gate,
                                                    {} if lease is None else lease.blocks,
                                                    lengths, sources=buffers)
                    # Copied from pageable memory: done once copy_gate returned.
                    del buffers
                    startup.drop(beyond.pop(gate))
                self.gates[gate] = GATE_READY
                if lease is not None:
                    copied.append((gate, lease.id))
                # Hand host blocks back once their copies are done (never blocks the walk).
                while copied and self.placement.events[copied[0][0]].query():
                    g, lease_id = copied.popleft()
                    self._release(lease_id)
                    inflight -= host_bytes.pop(g)
            while copied:
                g, lease_id = copied.popleft()
                self.placement.events[g].synchronize()
                self._release(lease_id)
            self.seconds = time.monotonic() - started
            nbytes = sum(stage_bytes)
            # What a cold load after start waits for on the daemon's side (bench/paths.py reads it).
            log.info("load of %s onto %s done: %d bytes in %.3f s (%.3f GB/s)%s", self.info.name,
                     _device_name(self.device), nbytes, self.seconds,
                     nbytes / max(self.seconds, 1e-9) / 1e9,
                     "" if startup is None else f"; {startup.taken} of them read beyond the host "
                                                f"arena while CUDA started")
        except Exception as exc:   # noqa: BLE001 -- any failure closes the gates, typed
            if not isinstance(exc, FlashError):
                exc = DeviceError(f"loading {self.info.name} onto {self.device} failed: "
                                  f"{type(exc).__name__}: {exc}", model=self.info.name,
                                  device=str(self.device))
            self.error = exc
            self.gates[self.gates != GATE_READY] = GATE_FAILED
            if exc is self._stop:
                log.info("loading %s onto %s stopped: %s", self.info.name, self.device, exc)
            else:
                log.error("loading %s onto %s failed: %s", self.info.name, self.device, exc)
            for fut in futures.values():
                if fut is not None:      # None: nothing leased (blocks read beyond the arena)
                    fut.add_done_callback(self._release_future)
        finally:
            if startup is not None:
                startup.close()
            if self.error is not None:
                self.finished.set_exception(self.error)
            else:
                self.finished.set_result(None)

    def _release(self, lease_id: int) -> None:
        self.leases.remove(lease_id)
        self.manager.release(self.owner, lease_id)

    def _release_future(self, fut) -> None:
        if fut.exception() is None:
            try:
                self.manager.release(self.owner, fut.result().id)
            except FlashError:
                pass   # the owner already disconnected: its leases went with it

    def close(self, why: FlashError | None = None) -> None:
        """End the load and give back its host leases and control page.

        With ``why`` (a CPU load whose client detached or left) the walk stops at its next stage
        and the caller does not wait: the leases and the control page are given back on the load
        thread when it ends, so the server's loop is not held up by a cold read. Without it the
        load is waited for (a GPU load: its device ranges are freed right after)."""
        if why is not None:
            self._stop = why
            self.finished.add_done_callback(lambda _f: self._give_back())
            return
        futures_wait([self.finished])
        self._give_back()

    def _give_back(self) -> None:
        for lease_id in list(self.leases):
            try:
                self._release(lease_id)
            except FlashError:
                pass   # the owner already disconnected: its leases went with it
        self.leases.clear()
        self.arena.free(self.control_offset)


class Loader:
    """Starts, shares and ends loads; the daemon's ``attach``/``detach`` operations land here."""

    def __init__(self, manager, arena, fabric=None):
        self.manager = manager
        self.arena = arena
        self.fabric = fabric
        self._lock = threading.RLock()     # with_room runs inside attach and on its own
        self._loads: dict[tuple, Load] = {}
        self._serial = itertools.count(1)
        self.evictions = 0                       # idle GPU loads dropped to make room

    def attach(self, client_id: int, info, device, resident: list[int], priority: int = 0,
               part: int = 0, startup=None) -> Load:
        """A load of ``resident`` blocks of the model on ``device`` for this client.

        CPU loads are per client and ``part`` (a model split over several devices attaches each
        part on its own; its leases keep the host blocks). A GPU load is shared: a client
        joins any load of the model on that device whose blocks cover what it needs; otherwise a
        new load (its own device copy) is started -- a client with a smaller budget never
        changes what another client already computes with.
        """
        wanted = frozenset(resident)
        with self._lock:
            if device == "cpu":
                key = (info.name, "cpu", client_id, part)
                load = self._loads.get(key)
                if load is not None and load.resident != wanted:
                    self._drop(key, LeaseError(f"client {client_id} attached {info.name} again with "
                                               f"another plan; the earlier load was ended",
                                               client=client_id, model=info.name))
                    load = None
                if load is None:
                    load = self._loads[key] = Load(self.manager, self.arena, info, "cpu",
                                                   owner=client_id, resident=resident,
                                                   priority=priority).start()
            else:
                device = int(device)
                for key, load in list(self._loads.items()):
                    if key[:2] == (info.name, device) and load.error is not None and not load.clients:
                        self._drop(key)
                load = next((ld for k, ld in self._loads.items()
                             if k[:2] == (info.name, device) and ld.error is None
                             and wanted <= ld.resident), None)
                if load is None:
                    if self.fabric is None:
                        raise DeviceError(f"cuda:{device} requested but this controller has no GPU "
                                          f"fabric", device=device)
                    key = (info.name, device, next(self._serial))
                    blocks = [b for b in info.blocks if b.id in wanted]
                    placement = self.with_room(device, lambda: self.fabric.place(
                        key, device, blocks, info.num_layers))
                    load = self._loads[key] = Load(self.manager, self.arena, info, device,
                                                   owner=DAEMON_CLIENT, resident=resident,
                                                   placement=placement, requester=client_id,
                                                   priority=priority, startup=startup).start()
            load.clients.add(client_id)
            load.last_used = time.monotonic()
            return load

    def with_room(self, device: int, allocate):
        """``allocate()``, evicting idle GPU loads of ``device`` (no client attached, least
        recently used first) while it does not fit. Models stay on the GPU after their last
        client leaves exactly until their memory is needed."""
        while True:
            try:
                return allocate()
            except (ArenaFull, BudgetTooSmall):
                with self._lock:
                    idle = sorted((ld.last_used, k) for k, ld in self._loads.items()
                                  if ld.device == device and not ld.clients and ld.finished.done())
                    if not idle:
                        raise
                    victim = idle[0][1]
                    log.info("evicting idle model %s from cuda:%d to make room", victim[0], device)
                    self._drop(victim)
                    self.evictions += 1

    def detach(self, client_id: int, model: str | None = None) -> None:
        """A client is done with ``model`` (all models when None): its CPU loads end; GPU loads
        stay resident for the next client."""
        with self._lock:
            for key, load in list(self._loads.items()):
                if model is not None and key[0] != model:
                    continue
                load.clients.discard(client_id)
                load.last_used = time.monotonic()
                if load.device == "cpu" and load.owner == client_id:
                    self._drop(key, UnknownClient(f"client {client_id} detached from {key[0]} (or left) "
                                                  f"before its load finished", client=client_id,
                                                  model=key[0]))

    def unload(self, model: str) -> int:
        """End every load of ``model``; returns device bytes freed."""
        with self._lock:
            freed = 0
            for key in [k for k in self._loads if k[0] == model]:
                freed += self._drop(key)
            return freed

    def _drop(self, key, why: FlashError | None = None) -> int:
        """End one load; ``why`` lets a CPU load end without waiting (see ``Load.close``)."""
        load = self._loads.pop(key)
        if load.placement is not None:
            load.close()
            return self.fabric.evict(key)
        load.close(why)
        return 0

    def close(self) -> None:
        """End every load (controller shutdown)."""
        with self._lock:
            for key in list(self._loads):
                self._drop(key)

    def loads(self) -> list[Load]:
        with self._lock:
            return list(self._loads.values())


def _device_name(device) -> str:
    return "cpu" if device == "cpu" else f"cuda:{int(device)}"
