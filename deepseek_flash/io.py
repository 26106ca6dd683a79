"""Small Python helpers over the native IO engine (``deepseek_flash._core``): turning a failed
completion into its typed exception, and reading a list of extents in one call.

There is one completion -> exception mapping, the native one (``completion_failure`` in
ext/io_engine.cpp): it is what ``IOEngine.read`` raises, and it alone sees the offset where a
read failed, whether the file ended early (``eof``) and the checksum that arrived. Callers with
more context (the daemon knows the model, role and layer) add it with ``error_of``.
"""
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


def error_of(completion: Completion, block_id: int | None = None, context: str = "", **fields):
    """The typed exception of a failed completion (None for a good one): the native mapping's
    class, message and fields, with ``block_id`` naming the block (where the request carried a
    routing token), ``context`` put before the message and ``fields`` added."""
    err = completion.error(block_id)
    if err is None:
        return None
    if not context and not fields:
        return err
    return type(err)(f"{context}: {err.message}" if context else err.message, **{**err.fields, **fields})


def read_all(engine: IOEngine, requests: Iterable[ReadRequest], timeout: float | None = None) -> list[Completion]:
    """Submit ``requests`` as one batch, wait, and raise for the first failed completion (in request
    order). Returns the completions, all good."""
    completions = engine.wait(engine.submit(list(requests)), timeout)
    for c in completions:
        raise_for(c)
    return completions
