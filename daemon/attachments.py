"""Attachments: what a client's ``attach``/``detach`` operations do above the loads.

``attach`` plans a model's residency on a device for one client (``daemon.planner``), joins or
starts its load (``daemon.loader``), and answers with everything the client needs to build its
model: the plan, the load's control page, the GPU arena and gate events (CUDA), the client's
streaming slots. Before CUDA is up in a fresh daemon, the first GPU attach reads the model's
first blocks into the host arena and the rest beyond it (``daemon.startup_reads``) meanwhile.
``build_device_tier`` wires this tier above the host arena, as the daemon and the embedded
controller both build it.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

from ..errors import FlashError, StoreInUse, UnknownBlock
from ..prefetch import ForwardOrder
from ..wire import GATE_READY
from .host_state import aligned
from .loader import Load, Loader, _device_name

log = logging.getLogger("deepseek_flash.loader")


def _when_done(load: Load, result: dict) -> Future:
    future: Future = Future()

    def done(finished):
        if finished.exception() is not None:
            future.set_exception(finished.exception())
        else:
            future.set_result(result)

    load.finished.add_done_callback(done)
    return future


class Attachments:
    """The ``attach``/``detach`` operations: plan, load, streaming slots -- one client's view.

    ``attach`` answers with everything a client needs to build its model: the residency plan,
    the load's control page (gates and block offsets), the GPU arena and gate events (CUDA), and
    the client's slot offsets when layers stream.
    """

    def __init__(self, manager, loader: Loader, fabric=None):
        self.manager = manager
        self.loader = loader
        self.fabric = fabric
        self._slots: dict[tuple, int] = {}     # (client, model) -> device holding its slots
        self._slots_lock = threading.Lock()
        self._startup: dict = {}                 # model -> StartupReads while its attach waits

    def attach(self, client_id: int, model: str, device, weight_budget=None,
               ipc: bool = True, priority: int = 0, blocks: list[int] | None = None,
               part: int = 0) -> dict | Future:
        """The attach reply, or a Future of it: a CPU attach answers once the blocks are read;
        the first attach to a device whose arena does not exist yet runs on its own thread (it
        waits for CUDA to start in the daemon: importing torch and making the context take ~1.5 s
        on the H200 machine), so the daemon's loop keeps serving everyone else meanwhile, and
        the model's first blocks are read from disk in the meantime (``read_ahead``).

        ``blocks`` (a model split over devices, ``load_model(device_map=...)``): only these
        blocks are planned and placed, as part ``part`` of this client's attachment of the
        model; each part has its own load, plan and slot ring."""
        if device != "cpu" and self.fabric is not None and not self.fabric.ready(int(device)):
            startup = self.read_ahead(client_id, model, weight_budget if blocks is None else 0)
            future: Future = Future()

            def run():
                try:
                    # Outside the loader's lock, which other clients' attaches need meanwhile.
                    self.fabric.arena(int(device))
                    out = self._attach(client_id, model, device, weight_budget, ipc, priority,
                                       blocks, part, startup)
                except BaseException as exc:   # noqa: BLE001 -- delivered to the client, typed
                    future.set_exception(exc)
                    return
                finally:
                    if startup is not None:
                        with self._slots_lock:
                            self._startup.pop(startup.model, None)
                        if startup.load is None:     # no new GPU load took them
                            startup.close()
                if not self.manager.connected(client_id):
                    # The client left while its attach ran: its disconnect found nothing to end.
                    self.detach(client_id)
                future.set_result(out)

            threading.Thread(target=run, daemon=True, name=f"flash-attach-cuda:{device}").start()
            return future
        return self._attach(client_id, model, device, weight_budget, ipc, priority, blocks, part)

    def read_ahead(self, client_id: int, model: str, weight_budget=0):
        """Start reading the model's first blocks in forward order while the device is not ready
        yet, into the host arena's free space (at least half the arena, what a GPU load keeps in
        flight): CUDA's start in a fresh daemon lasts seconds, as long as reading several GB, and
        the disk must not wait for it. The load then finds them read or in flight: it takes
        blocks in forward order and holds at most its window of them while their copies are in
        flight (``Load._run``), so the ones beyond stay unleased until it reaches them and its own
        reads find released, copied blocks to replace.

        Where the whole model goes onto the device (``weight_budget`` None) and it is larger than
        that room, the blocks after it are read on into ordinary memory (``StartupReads``, at most
        half the memory available), which the new GPU load copies from: returned (None
        otherwise) -- all but the model's last stages where there is much more to read
        (``startup_reads.tail_stages``: the load reads those into the page-locked arena). Advisory: nothing is raised (the attach itself reports errors)."""
        from .startup_reads import MEMORY_SHARE, StartupReads, available_memory, tail_stages

        try:
            info = self.manager.open_model(client_id, model)
            length = {b.id: aligned(b.length) for b in info.blocks}
            arena = self.loader.arena
            room, ids = max(arena.size - arena.used, arena.size // 2), []
            stages = [s for s in ForwardOrder(info.blocks, info.num_layers).stages if s]
            whole = weight_budget is None
            taken = 0
            for stage in stages:
                # Loading the whole model, the room ends at a stage's end: the blocks after it
                # are read beyond the arena, and a stage split between the two would be read
                # twice (a layer's blocks depend on each other: acquiring one reads the rest).
                need = sum(length[b] for b in stage)
                if whole and need > room:
                    break
                for bid in stage:
                    room -= length[bid]
                    if room < 0:
                        break
                    ids.append(bid)
                if room < 0:
                    break
                taken += 1
            if ids:
                self.manager.prefetch(info.name, blocks=ids, client_id=client_id)
            rest = [[info.blocks[b] for b in stage] for stage in stages[taken:]]
            if not whole or not rest:
                return None
            rest = rest[:len(rest) - tail_stages(rest, arena.size)]
            with self._slots_lock:
                if info.name in self._startup:      # another attach is reading them already
                    return None
                budget = int(available_memory() * MEMORY_SHARE)
                startup = StartupReads.start(self.manager, info.name, rest, budget)
                if startup is not None:
                    self._startup[info.name] = startup
                return startup
        except FlashError as exc:
            log.debug("read-ahead of %s before the device is ready: %s", model, exc)
            return None

    def _attach(self, client_id: int, model: str, device, weight_budget, ipc: bool,
                priority: int = 0, blocks: list[int] | None = None, part: int = 0,
                startup=None) -> dict | Future:
        from .planner import plan_residency

        info = self.manager.open_model(client_id, model)
        from ..cuda import link_bytes_per_s

        placed = info.blocks
        if blocks is not None:
            known = {b.id for b in info.blocks}
            unknown = sorted(set(blocks) - known)
            if unknown:
                raise UnknownBlock(f"attach: model {info.name} has no block {unknown[0]} "
                                   f"(blocks 0-{len(info.blocks) - 1})", model=info.name,
                                   block_id=unknown[0])
            wanted = set(blocks)
            placed = [b for b in info.blocks if b.id in wanted]
        link = None if device == "cpu" else link_bytes_per_s(int(device))
        where = "" if blocks is None else f" part {part} on {_device_name(device)}"
        plan = plan_residency(placed, weight_budget, info.flash_config["prefetch_window"],
                              info.name + where, link, info.flash_config["stream_unit"])
        load = self.loader.attach(client_id, info, device, plan.resident, priority, part,
                                  startup=startup)
        out = load.describe()
        out["plan"] = plan.to_wire()
        if device != "cpu":
            if plan.streaming:
                with self._slots_lock:
                    key = (client_id, info.name, part)
                    self._free_slots(*key)
                    out["slots"] = self.loader.with_room(int(device), lambda: self.fabric.alloc_slots(
                        key, int(device), plan.n_slots, plan.slot_bytes))
                    self._slots[key] = int(device)
            if ipc:
                # After the slots: the descriptor lists every segment the reply's offsets are in.
                out["gpu_arena"] = self.fabric.arena(int(device)).ipc_descriptor()
        summary = {"device": _device_name(device),
                   **{k: v for k, v in plan.to_wire().items() if k not in ("resident", "stream_blocks")},
                   "resident_blocks": len(plan.resident)}
        if blocks is None:
            self.manager.set_plan(info.name, {**info.plan, **summary})
        else:
            parts = {**info.plan.get("parts", {}), str(part): summary}
            self.manager.set_plan(info.name, {**info.plan, "parts": parts})
        if device == "cpu" and not load.finished.done():
            # CPU views are made from host offsets, known once the blocks are read: answer then.
            return _when_done(load, out)
        return out

    def _free_slots(self, client_id: int, model: str, part: int = 0) -> None:
        key = (client_id, model, part)
        device = self._slots.pop(key, None)
        if device is not None:
            self.fabric.free_slots(key, device)

    def unload(self, model: str) -> int:
        """Drop the model's device copies; refused while a client is attached to one."""
        busy = sorted({c for load in self.loader.loads() if load.info.name == model
                       for c in load.clients})
        if busy:
            raise StoreInUse(f"model {model}: clients {busy} are attached to its device copies; "
                             f"they must close the model first", model=model, clients=busy)
        return self.loader.unload(model)

    def close(self) -> None:
        """End every load and free the device memory (controller shutdown)."""
        self.loader.close()
        self.fabric.close()

    def copy_source(self, model: str, block, dest) -> bool:
        """Graceful recovery: a good copy of ``block`` from a GPU load that holds it, copied back
        to ``dest`` (device -> host). Called under the block manager's lock, so it takes no lock
        of the loader (whose holders call into the manager): it reads a snapshot of the loads."""
        for load in list(self.loader._loads.values()):
            placement = load.placement
            if placement is None or load.info.name != model or block.id not in placement.offsets:
                continue
            gate = next(g for g, ids in enumerate(load.order.stages) if block.id in ids)
            if load.gates[gate] != GATE_READY:
                continue
            import torch

            placement.events[gate].synchronize()
            off = placement.offsets[block.id]
            torch.frombuffer(dest, dtype=torch.uint8).copy_(
                placement.arena[off:off + block.length])
            return True
        return False

    def by_control_offset(self, offset: int) -> Load:
        return next(ld for ld in self.loader.loads() if ld.control_offset == offset)

    def detach(self, client_id: int, model: str | None = None) -> None:
        self.loader.detach(client_id, model)
        with self._slots_lock:
            for key in [k for k in self._slots if k[0] == client_id and (model is None or k[1] == model)]:
                self._free_slots(*key)


def build_device_tier(manager, arena, config) -> Attachments:
    """The tier above the host arena, as the daemon and the embedded controller both build it:
    the GPU fabric (idle until a client asks for a CUDA device), loads and attachments, and the
    hook that ends a client's attachments when it disconnects."""
    from .fabric import Fabric

    fabric = Fabric(arena, config.unified_memory_ratio, config.devices)
    attachments = Attachments(manager, Loader(manager, arena, fabric), fabric)
    manager.on_disconnect(attachments.detach)
    manager.add_copy_source(attachments.copy_source)
    return attachments
