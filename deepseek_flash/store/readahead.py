"""Reads kept in flight on a thread while the caller consumes: pack's and verify's pipeline.

``read_ahead(buffers, fill)`` runs ``fill(take, give)`` on a reader thread. ``take()`` hands it a
free buffer (None once the consumer has stopped: return then); ``give(buf, item)`` passes ``item``
to the consumer, which gets the items in order. ``buf`` (None for items that carry no buffer)
goes back to the free list once the consumer asks for the next item, so a view into it is valid
until then. Whatever ``fill`` raises is raised in the consumer; a consumer that stops early (or
fails) stops and joins the reader.
"""
from __future__ import annotations

import queue
import threading

_DONE = object()


class _Failed:
    def __init__(self, exc: BaseException):
        self.exc = exc


def read_ahead(buffers, fill, name: str = "read-ahead"):
    free: queue.Queue = queue.Queue()
    full: queue.Queue = queue.Queue()
    for buf in buffers:
        free.put(buf)
    stop = threading.Event()

    def take():
        buf = free.get()
        return None if buf is None or stop.is_set() else buf

    def run():
        try:
            fill(take, lambda buf, item: full.put((buf, item)))
            full.put(_DONE)
        except BaseException as exc:   # noqa: BLE001 -- handed to the consumer, which raises it
            full.put(_Failed(exc))

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    try:
        while True:
            entry = full.get()
            if entry is _DONE:
                return
            if isinstance(entry, _Failed):
                raise entry.exc
            buf, item = entry
            yield item
            if buf is not None:
                free.put(buf)
    finally:
        stop.set()
        free.put(None)
        thread.join()
