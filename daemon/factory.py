"""The one place the controller's object graph is built, for ``deepseek-flashd`` and embedded mode.

``build_controller(config)`` makes the host arena, the IO engine, the block manager, the device
watch (recovery), the device tier (GPU fabric, loader, attachments) and the op table, wires
their hooks, and returns them as one ``Controller`` that also knows how to take them down in
order. ``daemon.app.Application`` adds the socket server, status tree and sd_notify around it;
``client.embedded.EmbeddedController`` calls ops on it in-process. Both therefore run the same
parts. This module is the only daemon module the client imports.

Arguments that differ between the two callers, and why:

* ``arena_name``: the memfd's name, so ``/proc/<pid>/fd`` tells a daemon arena from an embedded one;
* ``status``: the daemon's status op adds its own state (config reload, pid, version) to the
  controller's snapshot;
* ``udev_monitor``: tests hand the device watch a fake event source; ``use_udev=False`` leaves
  it probing only (no netlink socket), for callers that must not open one.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

from .. import paths
from .block_manager import BlockManager
from .config import FlashConfig, read_shape
from .imports_ahead import ImportsAhead
from .attachments import Attachments, build_device_tier
from .operations import Operations
from .recovery import DeviceWatch
from .shards import Shards

log = logging.getLogger("deepseek_flash.daemon")


def make_config(config) -> FlashConfig:
    """A FlashConfig from None (the system config file, or defaults), a dict, a path or itself."""
    if config is None:
        return FlashConfig.load(paths.config_path())
    if isinstance(config, FlashConfig):
        return config
    if isinstance(config, dict):
        return FlashConfig.from_dict(config)
    return FlashConfig.load(Path(config))


@dataclass
class Controller:
    """One controller's parts (see the module docstring); ``close()`` ends them in order."""

    config: FlashConfig
    arena: object
    engine: object
    manager: BlockManager
    recovery: DeviceWatch
    attachments: Attachments
    ops: Operations = field(repr=False)
    shards: Shards | None = None
    imports_ahead: ImportsAhead | None = None

    @property
    def fabric(self):
        return self.attachments.fabric

    def snapshot(self) -> dict:
        """The host tier's snapshot with the device tier's state merged in (what ``status``
        answers and the status tree shows)."""
        snap = self.manager.snapshot()
        status = snap["status"]
        fabric = self.attachments.fabric
        status["unified_memory_fabric"] = "ENABLED" if fabric.available_hint else "HOST_ONLY"
        if status.get("host_only_models"):
            # A model whose device is gone is served from the host tier alone.
            status["unified_memory_fabric"] = "HOST_ONLY"
        if not fabric.available_hint:
            # No GPU tier: every model is served from the host tier, whatever its own state says.
            for model in snap["models"].values():
                model["unified_memory_fabric"] = "HOST_ONLY"
        snap["devices"] = fabric.telemetry()
        gpu: dict[str, int] = {}
        for load in self.attachments.loader.loads():
            if load.device != "cpu":
                gpu[load.info.name] = gpu.get(load.info.name, 0) + sum(
                    b.length for b in load.info.blocks if b.id in load.resident)
        for name, model in snap["models"].items():
            model["gpu_bytes"] = gpu.get(name, 0)
        snap["stats"]["bytes_h2d"] = fabric.bytes_h2d + snap["stats"].get("bytes_streamed", 0)
        snap["stats"]["device_evictions"] = self.attachments.loader.evictions
        return snap

    def close(self) -> None:
        """Stop the device watch, end every load and free device memory, save the access counts,
        stop the completion thread, close the IO engine (the arena goes with the last ref)."""
        self.recovery.close()
        if self.imports_ahead is not None:
            self.imports_ahead.close()
        self.attachments.close()
        self.manager.save_access_counts()
        self.manager.close()
        self.engine.close()


def build_controller(config, *, arena_name: str = "deepseek-flash", status=None,
                     udev_monitor=None, use_udev: bool = True, imports_ahead: bool = False) -> Controller:
    """Build every part of a controller from ``config`` (anything ``make_config`` takes).
    ``imports_ahead`` (the daemon's): read the learned import files ahead at start and learn them
    from clients (``daemon.imports_ahead``)."""
    from .._core import HostArena, IOEngine

    config = make_config(config)
    arena = HostArena(config.host_cache_bytes, arena_name)
    depth, request = read_shape("read_shape", config.read_shape)
    engine = IOEngine(queue_depth=depth, request_size=request)
    log.info("host arena %d bytes (memfd %d), IO engine %s, reads %d x %d KiB", arena.size, arena.fd,
             engine.backend, depth, request >> 10)
    manager = BlockManager(config, arena, engine)
    recovery = attachments = ahead = None
    try:
        if imports_ahead:
            # First: the disk is idle until a client asks, and its imports want these files.
            ahead = ImportsAhead(paths.state_dir(), on_warm=manager.imports_read_ahead)
            # Before torch's import (the prepare thread): an installation without compiled
            # files reads them from the daemon's cache (deepseek_flash.bytecode).
            ahead.use_bytecode_cache()
            ahead.start()
        recovery = DeviceWatch(manager, monitor=udev_monitor, use_udev=use_udev)
        attachments = build_device_tier(manager, arena, config)
        # Once CUDA is up, the daemon's own imports (torch's modules) join the files read ahead
        # at its next start: after a restart they are as warm as the first start's package walk.
        attachments.fabric.prepare(on_cuda=None if ahead is None else lambda: threading.Thread(
            target=ahead.learn_own, daemon=True, name="flash-imports-learn").start())
    except BaseException:
        for part in (ahead, recovery, attachments, manager, engine):
            if part is not None:
                part.close()
        raise
    controller = Controller(config=config, arena=arena, engine=engine, manager=manager,
                            recovery=recovery, attachments=attachments, ops=None, imports_ahead=ahead)
    controller.shards = Shards(manager, paths.state_dir() / "shards")
    controller.ops = Operations(manager, status=status or controller.snapshot, attachments=attachments,
                                shards=controller.shards, imports_ahead=ahead)
    return controller
