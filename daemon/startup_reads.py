"""Reading on while CUDA starts: a model's blocks beyond the host arena, in ordinary memory.

The first GPU attach after the daemon starts waits for CUDA (torch's import and the context:
seconds). ``Attachments.read_ahead`` fills the host arena's free space with the model's first
blocks meanwhile; for a model larger than that free space the disk would then sit idle for the
rest of CUDA's start. ``StartupReads`` reads the next blocks, in forward order, into anonymous
memory -- one mapping per block, at most the model's remaining bytes and ``MEMORY_SHARE`` of the
memory the kernel calls available -- through the host tier's read pipeline (same queue order,
priority, engine shape and crc32c check; ``bytes_read_nvme`` counts them). The GPU load then copies
such a stage straight from there (pageable host -> device, several times the disk's rate) and
drops its mappings once copied. A block whose read failed is read again through the host tier by
the load, where its errors and recovery are those of any read. What the load does not take (a
streamed plan, a load that failed) is dropped when the load ends.
"""
from __future__ import annotations

import logging
import mmap
import threading
from concurrent.futures import Future

log = logging.getLogger("deepseek_flash.loader")

# At most this share of MemAvailable is read ahead beyond the host arena.
MEMORY_SHARE = 0.5


def available_memory() -> int:
    """MemAvailable of /proc/meminfo in bytes (0 where unreadable: nothing is read beyond)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


class StartupReads:
    """Blocks of one model read into their own anonymous mappings (see the module docstring)."""

    def __init__(self, model: str, blocks):
        self.model = model
        self.blocks = {b.id: b for b in blocks}
        self.buffers: dict[int, mmap.mmap] = {}
        self.done: dict[int, Future] = {}
        self.bytes = sum(b.length for b in blocks)
        self.taken = 0                      # bytes a load copied from here
        self.load = None                    # the GPU load that copies from here (set by it)
        self._lock = threading.Lock()

    @classmethod
    def start(cls, manager, model: str, stages, budget: int):
        """Read the longest prefix of ``stages`` (lists of BlockInfo, forward order) within
        ``budget`` bytes, whole stages only (a layer's blocks depend on each other: one acquired
        through the host tier reads the rest); None when nothing fits or the model is served
        quantized on entry (its blocks are transcoded as they enter the host tier: only that
        path makes them)."""
        chosen, room = [], budget
        for stage in stages:
            need = sum(b.length for b in stage)
            if need > room:
                break
            room -= need
            chosen += stage
        if not chosen:
            return None
        reads = cls(model, chosen)
        if not manager.read_outside(model, [(b, reads._buffer(b), reads._landed(b.id))
                                            for b in chosen]):
            return None
        log.info("reading %d blocks (%d bytes) of %s beyond the host arena while CUDA starts",
                 len(chosen), reads.bytes, model)
        return reads

    def _buffer(self, block) -> mmap.mmap:
        buf = mmap.mmap(-1, max(block.length, 1))      # page-aligned: O_DIRECT reads land here
        self.buffers[block.id] = buf
        self.done[block.id] = Future()
        return buf

    def _landed(self, block_id: int):
        def callback(error) -> None:
            if error is None:
                self.done[block_id].set_result(None)
            else:
                self.done[block_id].set_exception(error)
        return callback

    def covered(self, block_ids) -> list[int]:
        """Those of ``block_ids`` (being) read here and not yet taken."""
        with self._lock:
            return [b for b in block_ids if b in self.buffers]

    def take(self, block_ids) -> dict:
        """Wait for the blocks' reads: ``{block_id: buffer}`` with their exact bytes. Raises the
        first read's typed error (the blocks are dropped; the caller reads them again)."""
        with self._lock:
            futures = [self.done[b] for b in block_ids]
        try:
            for fut in futures:
                fut.result()
        except BaseException:
            self.drop(block_ids)
            raise
        with self._lock:
            self.taken += sum(self.blocks[b].length for b in block_ids)
            return {b: self.buffers[b] for b in block_ids}

    def drop(self, block_ids) -> None:
        """Forget these blocks' mappings (copied, or not wanted): unmapped once their reads are
        done and nothing else holds them."""
        with self._lock:
            for b in block_ids:
                buf = self.buffers.pop(b, None)
                fut = self.done.pop(b, None)
                if buf is not None and fut is not None:
                    # The engine holds the buffer until its read completes; close after that.
                    fut.add_done_callback(lambda _f, buf=buf: _close(buf))

    def close(self) -> None:
        """Drop every block not taken (the load ended)."""
        with self._lock:
            left = list(self.buffers)
        self.drop(left)


def _close(buf: mmap.mmap) -> None:
    try:
        buf.close()
    except BufferError:
        pass        # still exported (a tensor over it): freed with its last reference
