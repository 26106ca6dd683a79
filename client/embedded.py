"""The controller inside the caller's process: the daemon's BlockManager and op table, no socket.

``Client(embedded=True)`` (and ``Client()`` where no daemon answers) runs this. It builds the same
``BlockManager`` and ``Operations`` objects the daemon builds, so requests are validated, answered
and fail with the same typed errors in both modes; only the transport differs. The arena is this
process's own; nothing is shared with other processes.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future
from pathlib import Path

from .. import paths
from ..daemon.block_manager import BlockManager
from ..daemon.config import FlashConfig
from ..daemon.loader import build_device_tier
from ..daemon.operations import Operations

log = logging.getLogger("deepseek_flash.embedded")


def make_config(config) -> FlashConfig:
    """A FlashConfig from None (the system config file, or defaults), a dict, a path or itself."""
    if config is None:
        return FlashConfig.load(paths.config_path())
    if isinstance(config, FlashConfig):
        return config
    if isinstance(config, dict):
        return FlashConfig.from_dict(config)
    return FlashConfig.load(Path(config))


class EmbeddedController:
    """One in-process controller and its single client."""

    mode = "embedded"

    def __init__(self, config=None, extensions=()):
        from .._core import HostArena, IOEngine

        self.config = make_config(config)
        self.arena = HostArena(self.config.host_cache_bytes, "deepseek-flash-embedded")
        self.engine = IOEngine()
        self.manager = BlockManager(self.config, self.arena, self.engine)
        self.attachments = build_device_tier(self.manager, self.arena, self.config)
        self.fabric = self.attachments.fabric
        self.ops = Operations(self.manager, attachments=self.attachments)
        for extend in extensions:
            extend(self)            # the same hooks as daemon.app.Application's
        self.client_id = self.manager.connect({"name": "embedded"})
        self.generation = 0

    def call(self, op: str, args: dict, retry: bool = True):
        result = self.ops.call(self.client_id, op, args)
        if isinstance(result, Future):
            result = result.result()
        return result

    def close(self) -> None:
        if self.manager is None:
            return
        self.manager.disconnect(self.client_id)
        self.attachments.close()
        self.manager.save_access_counts()
        self.manager.close()
        self.engine.close()
        self.manager = None
