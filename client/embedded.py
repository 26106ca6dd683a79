"""The controller inside the caller's process: the daemon's parts and op table, no socket.

``Client(embedded=True)`` (and ``Client()`` where no daemon answers) runs this. Its controller
comes from ``daemon.factory.build_controller``, the factory ``deepseek-flashd`` uses, so it has the
same parts (block manager, device watch, device tier, op table): requests are validated, answered
and fail with the same typed errors in both modes; only the transport differs. The arena is this
process's own; nothing is shared with other processes.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future

from ..daemon.factory import build_controller

log = logging.getLogger("deepseek_flash.embedded")


class EmbeddedController:
    """One in-process controller and its single client."""

    mode = "embedded"

    def __init__(self, config=None):
        self.controller = build_controller(config, arena_name="deepseek-flash-embedded")
        self.config = self.controller.config
        self.arena = self.controller.arena
        self.manager = self.controller.manager
        self.attachments = self.controller.attachments
        self.fabric = self.controller.fabric
        self.ops = self.controller.ops
        self.client_id = self.manager.connect({"name": "embedded"})
        self.generation = 0

    def call(self, op: str, args: dict, retry: bool = True, sent=None):
        """``op``'s result; ``sent`` (see ``Client.attach``) is called first."""
        if sent is not None:
            sent()
        result = self.ops.call(self.client_id, op, args)
        if isinstance(result, Future):
            result = result.result()
        return result

    def close(self) -> None:
        if self.manager is None:
            return
        self.manager.disconnect(self.client_id)
        self.controller.close()
        self.manager = None
