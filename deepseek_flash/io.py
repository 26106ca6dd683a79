"""Small Python helpers over the native IO engine (``deepseek_flash._core``): turning a failed
completion into its typed exception, and reading a list of extents in one call."""
from __future__ import annotations

from collections.abc import Iterable

from deepseek_flash import _core

ReadRequest = _core.ReadRequest
Completion = _core.Completion
IOEngine = _core.IOEngine


def raise_for(completion: Completion) -> None:
    """Raise ``FlashIOError`` (errno, path, offset, block_id) or ``BlockChecksumError`` (block_id,
    path, expected, actual) for a failed completion; return quietly for a good one. The message
    and fields come from the same native function that ``IOEngine.read`` raises through."""
    completion.raise_if_failed()


def read_all(engine: IOEngine, requests: Iterable[ReadRequest], timeout: float | None = None) -> list[Completion]:
    """Submit ``requests`` as one batch, wait, and raise for the first failed completion (in request
    order). Returns the completions, all good."""
    completions = engine.wait(engine.submit(list(requests)), timeout)
    for c in completions:
        raise_for(c)
    return completions
