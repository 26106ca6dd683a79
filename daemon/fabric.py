"""GPU fabric: one arena per device, filled from the host arena on a copy stream, shared by CUDA IPC.

Why the daemon owns the device memory: weights outlive client processes and are shared by all of
them. A client opens each device arena once (one CUDA IPC open) and then only receives offsets.

Readiness crosses processes without a CPU round trip per layer:

* every model placed on a device gets *gates* -- 0 for the embeddings, 1..L for the decoder layers,
  L+1 for the final norm and head -- and one interprocess CUDA event per gate;
* the loader enqueues a gate's copies on the copy stream, records the gate's event, and only then
  flips the gate's word in a small *control page* that lives in the shared host arena;
* a client whose model is still loading checks that word before a layer runs (a load from shared
  memory) and makes its compute stream wait on the event -- the GPU, not the CPU, waits for the copy.

Everything that touches CUDA imports torch lazily: the controller runs on machines without a GPU,
where device ``cpu`` means "the host arena is the device".
"""
from __future__ import annotations

import logging
import threading
import time

from ..cuda import (
    cuda_available,
    link_bytes_per_s,
    nvidia_driver_present,
    register_host_memory,
    unregister_host_memory,
)
from ..errors import DeviceError, FlashError
from ..prefetch import ForwardOrder
from .gpu_arena import GpuArena

log = logging.getLogger("deepseek_flash.fabric")


class DevicePlacement:
    """A model's resident blocks on one device: offsets, gate events, the control page."""

    def __init__(self, fabric: Fabric, model: str, device: int, arena: GpuArena,
                 offsets: dict[int, int], stages: list[list[int]]):
        import torch

        self.fabric = fabric
        self.model = model
        self.device = device
        self.arena = arena
        self.offsets = offsets                  # block id -> byte offset in the arena
        self.stages = stages                    # gate -> block ids (forward order)
        with torch.cuda.device(device):
            self.events = [torch.cuda.Event(interprocess=True) for _ in stages]
            self.event_handles = [bytes(ev.ipc_handle()) for ev in self.events]


class Fabric:
    """GPU arenas per device, created lazily, filled from the host arena."""

    def __init__(self, host_arena, unified_memory_ratio: float, devices: list[int] | None = None):
        self.host_arena = host_arena
        self.unified_memory_ratio = unified_memory_ratio
        self.devices = devices                  # CUDA indices served (None: every visible one)
        self.arenas: dict[int, GpuArena] = {}
        self.placements: dict[tuple, DevicePlacement] = {}
        self.slots: dict[tuple, list[int]] = {}      # (client, device) -> slot offsets
        self.slot_bytes: dict[tuple, int] = {}       # (client, device) -> bytes of the ring
        self.host_pinned = False
        self._pin_tried = False
        self._pin_lock = threading.Lock()
        self._prepare_thread: threading.Thread | None = None
        self._pin_thread: threading.Thread | None = None
        self._populate_thread: threading.Thread | None = None
        self._host_tensor = None
        self._lock = threading.Lock()            # arena creation
        self._count_lock = threading.Lock()      # bytes_h2d: every load thread adds to it
        self.bytes_h2d = 0
        self.device_h2d: dict[int, int] = {}     # per device: bytes the loads copied to it
        self._rate_marks: dict[int, tuple[float, int]] = {}   # device -> (time, device_h2d) last read
        self._links: dict[int, float | None] = {}             # device -> PCIe capacity (NVML)
        self._available: bool | None = None
        self._closing = threading.Event()

    @property
    def available(self) -> bool:
        if self._available is None:
            self._available = cuda_available()
        return self._available

    @property
    def available_hint(self) -> bool:
        """``available`` without waiting for it: while still unknown (CUDA starting on the
        prepare thread, torch being imported), whether an NVIDIA driver is present. For the status
        snapshot, which the start publishes before serving: asking ``available`` there held the
        socket back until torch was imported (~1 s on the CI box, ~3.4 s on the GPU machines)."""
        if self._available is not None:
            return self._available
        return nvidia_driver_present()

    def device_count(self) -> int:
        if not self.available:
            return 0
        import torch

        return torch.cuda.device_count()

    def ready(self, device: int) -> bool:
        """True once ``device``'s arena exists (attaching to it no longer page-locks or allocates)."""
        return device in self.arenas

    def arena(self, device: int) -> GpuArena:
        """The arena of ``device``, created on first use (and the host arena pinned once)."""
        with self._lock:
            if device in self.arenas:
                return self.arenas[device]
            if not self.available:
                raise DeviceError(f"cuda:{device} requested but CUDA is not available in the daemon",
                                  device=device)
            import torch

            if device >= torch.cuda.device_count():
                raise DeviceError(f"cuda:{device} does not exist ({torch.cuda.device_count()} devices)",
                                  device=device)
            if self.devices is not None and device not in self.devices:
                raise DeviceError(f"cuda:{device} is not served by this controller (devices: "
                                  f"{self.devices} in the configuration)", device=device,
                                  allowed=list(self.devices))
            _, total = torch.cuda.mem_get_info(device)
            # A ceiling, not an allocation: segments are mapped as loads and slot rings need them.
            arena = GpuArena.create(device, int(total * self.unified_memory_ratio),
                                    ratio=self.unified_memory_ratio)
            log.info("GPU arena on cuda:%d: ceiling %d bytes (unified_memory_ratio %.2f), mapped "
                     "on demand", device, arena.ceiling, self.unified_memory_ratio)
            self.arenas[device] = arena
            return arena

    def pin_host(self, wait: bool = True) -> bool:
        """Page-lock the host arena once for every device (``cudaHostRegister``, portable); a
        caller that comes while another thread pins waits for it. True when pinned.

        ``wait=False`` (a load's copies): never wait -- start the pinning on its own thread if
        nobody has, and answer whether it is done; until it is, copies run from pageable memory
        (~6.6 GB/s on the H200 machine, still above the disk), so a load right after start is not
        held up by page-locking a large host arena (40 GiB: ~25 s there)."""
        if self.host_pinned or self._pin_tried:
            return self.host_pinned
        if not wait:
            with self._lock:
                if self._pin_thread is None:
                    self._pin_thread = threading.Thread(target=self.pin_host, daemon=True,
                                                        name="flash-host-pin")
                    self._pin_thread.start()
            return False
        with self._pin_lock:
            if not self._pin_tried:
                start = time.monotonic()
                # Fault the pages in first, outside CUDA: cudaHostRegister of populated memory
                # is ~4x faster (0.56 s vs 2.6 s for 4 GiB on the H200 machine), and the driver
                # appears to hold other CUDA calls of this process while it registers.
                populate = getattr(self.host_arena, "populate", None)
                if populate is not None:
                    populate()
                self.host_pinned = register_host_memory(self.host_arena.address, self.host_arena.size)
                self._pin_tried = True
                log.info("host arena of %d bytes %s in %.2f s", self.host_arena.size,
                         "page-locked" if self.host_pinned else "left pageable",
                         time.monotonic() - start)
        return self.host_pinned

    def host_tensor(self):
        if self._host_tensor is None:
            import torch

            self._host_tensor = torch.frombuffer(self.host_arena, dtype=torch.uint8)
        return self._host_tensor

    def place(self, key, device: int, blocks, num_layers: int | None = None) -> DevicePlacement:
        """Allocate device ranges for ``blocks`` (BlockInfo list) or raise naming the sizes.

        ``key`` names the placement (the loader's load key; its first item is the model name).
        ``num_layers``: the model's (the gates are the whole model's, also where ``blocks`` is
        one device's share of a split model); default: the last layer among ``blocks``.
        """
        model = key[0]
        arena = self.arena(device)
        offsets = dict(zip([b.id for b in blocks], arena.alloc_many(
            (b.length for b in blocks), what=f"model {model!r}")))
        if num_layers is None:
            num_layers = 1 + max((b.layer for b in blocks), default=-1)
        stages = ForwardOrder(blocks, num_layers).stages
        placement = DevicePlacement(self, model, device, arena, offsets, stages)
        placement.bytes = sum(b.length for b in blocks)
        self.placements[key] = placement
        return placement

    def copy_gate(self, placement: DevicePlacement, gate: int, host_offsets: dict[int, int],
                  lengths: dict[int, int], sources: dict | None = None) -> None:
        """Enqueue a gate's host->device copies and record its event (the loader opens the gate).
        A block in ``sources`` (block id -> a buffer of its bytes outside the host arena: the
        reads beyond it while CUDA started) is copied from there, synchronously (pageable
        memory: the buffer may go once this returns); the others from ``host_offsets``."""
        import torch

        arena = placement.arena
        # Never waits for the page-locking (see pin_host): pageable copies until it is done.
        pinned = self.pin_host(wait=False)
        host = self.host_tensor()
        copied = 0
        with torch.cuda.stream(arena.copy_stream):
            for block_id in placement.stages[gate]:
                dst, n = placement.offsets[block_id], lengths[block_id]
                if sources is not None and block_id in sources:
                    src = torch.frombuffer(sources[block_id], dtype=torch.uint8, count=n)
                    arena[dst:dst + n].copy_(src, non_blocking=False)
                    del src
                else:
                    src = host_offsets[block_id]
                    arena[dst:dst + n].copy_(host[src:src + n], non_blocking=pinned)
                copied += n
            placement.events[gate].record(arena.copy_stream)
        with self._count_lock:
            self.bytes_h2d += copied
            self.device_h2d[arena.device] = self.device_h2d.get(arena.device, 0) + copied

    def prepare(self, on_cuda=None) -> threading.Thread | None:
        """At start, on a background thread: the CUDA context and arena (a ceiling, nothing
        allocated) of every served device, then the host arena page-locked -- seconds for a large
        host cache, done before the first client asks instead of in its request. A load that comes
        meanwhile starts its disk reads at once and copies from pageable memory until the pinning
        is done. Where no NVIDIA driver is present nothing is imported or started. ``on_cuda()``:
        called on that thread once the arenas are made (torch and CUDA's libraries loaded: the
        daemon learns what its start imported, ``ImportsAhead.learn_own``); its errors are logged."""
        if not nvidia_driver_present():
            return None
        if getattr(self.host_arena, "populate", None) is not None:
            # The host arena's pages faulted in now, beside CUDA's start, before the first load's
            # reads land in them: a read into memory never touched pays for each page on its own
            # path (one 4 MiB read at a time into fresh memory read at half the rate on the CI
            # box); the page-locking below then finds them present.
            self._populate_thread = threading.Thread(target=self._populate, daemon=True,
                                                     name="flash-host-populate")
            self._populate_thread.start()

        def run():
            try:
                started = time.monotonic()
                if not self.available:
                    if self.devices:
                        log.warning("devices %s configured but CUDA is not available", self.devices)
                    return
                devices = self.devices if self.devices is not None else range(self.device_count())
                for device in devices:
                    if self._closing.is_set():
                        return
                    try:
                        self.arena(device)
                    except FlashError as exc:
                        # One device that does not exist must not keep the others from being
                        # prepared; a client asking for it gets the same error, typed.
                        log.error("preparing cuda:%s: %s", device, exc)
                log.info("CUDA started (torch imported, context and arenas made) in %.2f s",
                         time.monotonic() - started)
                if on_cuda is not None:
                    try:
                        on_cuda()
                    except Exception:   # noqa: BLE001 -- learning is an optimisation only
                        log.exception("after CUDA's start")
                if not self._closing.is_set():
                    self.pin_host()
            except Exception:   # noqa: BLE001 -- a failed preparation only costs the first client time
                log.exception("preparing the GPU fabric at start failed; the first load does it")

        thread = self._prepare_thread = threading.Thread(target=run, daemon=True,
                                                         name="flash-fabric-prepare")
        thread.start()
        return thread

    def alloc_slots(self, owner, device: int, n_slots: int, slot_bytes: int) -> list[int]:
        """A client's ring of streaming slots in the arena (freed by ``free_slots``)."""
        offsets = self.arena(device).alloc_many([slot_bytes] * n_slots, what="a streaming slot ring")
        self.slots[(owner, device)] = offsets
        self.slot_bytes[(owner, device)] = n_slots * slot_bytes
        return offsets

    def free_slots(self, owner, device: int) -> None:
        self.slot_bytes.pop((owner, device), None)
        for off in self.slots.pop((owner, device), []):
            self.arenas[device].free(off)

    def evict(self, key) -> int:
        """Drop one placement's device copies; bytes freed."""
        placement = self.placements.pop(key)
        placement.arena.copy_stream.synchronize()
        freed = 0
        for off in placement.offsets.values():
            freed += placement.arena.free(off)
        return freed

    def _populate(self) -> None:
        start = time.monotonic()
        try:
            how = self.host_arena.populate()
        except FlashError as exc:   # advisory: the reads then fault the pages in themselves
            log.warning("host arena not faulted in ahead: %s", exc)
            return
        log.info("host arena of %d bytes faulted in (%s) in %.2f s", self.host_arena.size, how,
                 time.monotonic() - start)

    def close(self) -> None:
        """Free every device arena and unpin the host arena (before the host arena is unmapped:
        a registration left behind would make later allocations at that address fail). Waits
        for the prepare thread (which starts nothing more once closing), the populating thread
        and any pinning thread."""
        self._closing.set()
        for thread in (self._prepare_thread, self._pin_thread, self._populate_thread):
            if thread is not None:
                thread.join()
        self._prepare_thread = self._pin_thread = self._populate_thread = None
        for arena in self.arenas.values():
            arena.copy_stream.synchronize()
            arena.close()
        self.placements.clear()
        self.slots.clear()
        self.slot_bytes.clear()
        self.arenas.clear()
        self._host_tensor = None
        if self.host_pinned:
            unregister_host_memory(self.host_arena.address)
            self.host_pinned = False
        if self._available:
            import torch

            torch.cuda.empty_cache()

    def telemetry(self, now: float | None = None) -> dict:
        """Per device: its arena (size, used, ceiling, segments), what is in it (models placed
        and their bytes, streaming slot rings and theirs), its link (bytes our loads copied to
        it, their rate since the previous call, the PCIe capacity) and, through pynvml, the
        link's measured throughput (all traffic, clients' streaming included) and memory."""
        now = time.monotonic() if now is None else now
        out = {}
        placements = list(self.placements.values())
        rings = dict(self.slot_bytes)
        for device, arena in self.arenas.items():
            mine = [p for p in placements if p.device == device]
            ring = [n for (_, d), n in rings.items() if d == device]
            copied = self.device_h2d.get(device, 0)
            last_t, last_bytes = self._rate_marks.get(device, (now, copied))
            self._rate_marks[device] = (now, copied)
            if device not in self._links:
                self._links[device] = link_bytes_per_s(device) if self.available else None
            out[f"cuda:{device}"] = {
                "arena_bytes": arena.size, "arena_used_bytes": arena.used,
                "arena_ceiling_bytes": arena.ceiling, "arena_segments": len(arena.memory),
                "models": ",".join(sorted({p.model for p in mine})),
                "placements": len(mine), "placed_bytes": sum(getattr(p, "bytes", 0) for p in mine),
                "slot_rings": len(ring), "slot_bytes": sum(ring),
                "bytes_h2d": copied,
                "h2d_bytes_per_s": int((copied - last_bytes) / (now - last_t)) if now > last_t else 0,
                "link_capacity_bytes_per_s": int(self._links[device] or 0)}
        for name, fields in nvml_telemetry().items():
            out.setdefault(name, {}).update(fields)
        return out


def nvml_telemetry() -> dict:
    """PCIe rx/tx (KB/s) and memory per GPU from NVML; empty where NVML is absent."""
    try:
        import pynvml
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return {}
    out = {}
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            entry = out.setdefault(f"cuda:{i}", {})
            entry.update({
                "gpu_memory_used_bytes": int(mem.used), "gpu_memory_total_bytes": int(mem.total),
                "pcie_rx_kbps": int(pynvml.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_RX_BYTES)),
                "pcie_tx_kbps": int(pynvml.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_TX_BYTES)),
            })
    except pynvml.NVMLError as exc:
        log.debug("NVML query failed: %s", exc)
    return out
