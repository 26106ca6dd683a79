"""Reading on while CUDA starts: a model's blocks beyond the host arena, in ordinary memory.

The first GPU attach after the daemon starts waits for CUDA (torch's import and the context:
seconds). ``Attachments.read_ahead`` fills the host arena's free space with the model's first
blocks meanwhile; for a model larger than that free space the disk would then sit idle for the
rest of CUDA's start. ``StartupReads`` reads the next stages, in forward order, into memory of
their own (all but the model's last stages where there is much more to read: ``tail_stages``) --
one memfd mapping per stage, faulted in before its reads are queued, at most the model's
remaining bytes and ``MEMORY_SHARE`` of the memory the kernel calls available -- through the host
tier's read pipeline (same queue order, priority, engine shape and crc32c check;
``bytes_read_nvme`` counts them). The GPU load then copies
such a stage straight from there (pageable host -> device, several times the disk's rate) and
drops its mappings once copied. A block whose read failed is read again through the host tier by
the load, where its errors and recovery are those of any read. What the load does not take (a
streamed plan, a load that failed) is dropped when the load ends.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

from ..errors import DeviceError, FlashError

log = logging.getLogger("deepseek_flash.loader")

# At most this share of MemAvailable is read ahead beyond the host arena.
MEMORY_SHARE = 0.5
# The model's last stages within this share of the host arena (at least the last one) are left to
# the load when more than the arena's size is read beyond it besides them (``tail_stages``).
TAIL_ARENA_SHARE = 0.25


def tail_stages(stages, arena_bytes: int) -> int:
    """How many of the last ``stages`` (lists of BlockInfo beyond the host arena's, forward order)
    are not read beyond the arena but left to the load, which reads them into the page-locked
    host arena once CUDA is up: the stages at the end within ``TAIL_ARENA_SHARE`` of the arena, at
    least the last one -- 0 unless the stages before them still hold more than ``arena_bytes``
    (reads enough to keep the disk busy while CUDA starts). The last stage read is the one whose
    copy is left after the disk's last read: from the page-locked arena it runs at the link's
    rate (~50 GB/s on the H200 machine) instead of a pageable copy's (~6.6 GB/s: 0.16 s for an 8B
    model's 1 GB head), and its memory is not mapped and faulted in only to be unmapped."""
    sizes = [sum(b.length for b in stage) for stage in stages]
    room, tail = arena_bytes * TAIL_ARENA_SHARE, 0
    while tail < len(sizes) and (tail == 0 or sizes[-tail - 1] <= room):
        room -= sizes[-tail - 1]
        tail += 1
    return tail if sum(sizes[:len(sizes) - tail]) > arena_bytes else 0


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
    """Blocks of one model read into memory of their own (see the module docstring).

    The memory of each stage is one ``HostArena`` (a memfd mapping) faulted in
    (``populate``) on the ``flash-startup-reads`` thread before the stage's reads are queued: a
    read into memory never touched before pays for faulting each page in on the read's own path
    (one 4 MiB read at a time into fresh memory read at half the rate on the CI box), so the
    thread keeps ahead of the disk instead."""

    def __init__(self, model: str, stages):
        self.model = model
        self.stages = [list(stage) for stage in stages]
        self.blocks = {b.id: b for stage in self.stages for b in stage}
        self.bytes = sum(b.length for b in self.blocks.values())
        self.done: dict[int, Future] = {bid: Future() for bid in self.blocks}
        self.buffers: dict[int, memoryview] = {}     # made stage by stage, until taken or dropped
        self.planned = set(self.blocks)              # not yet taken or dropped
        self.taken = 0                      # bytes a load copied from here
        self.load = None                    # the GPU load that copies from here (set by it)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @classmethod
    def start(cls, manager, model: str, stages, budget: int):
        """Read the longest prefix of ``stages`` (lists of BlockInfo, forward order) within
        ``budget`` bytes, whole stages only (a layer's blocks depend on each other: one acquired
        through the host tier reads the rest); None when nothing fits."""
        chosen, room = [], budget
        for stage in stages:
            need = sum(_aligned(b.length) for b in stage)
            if need > room:
                break
            room -= need
            chosen.append(stage)
        if not chosen:
            return None
        reads = cls(model, chosen)
        reads._thread = threading.Thread(target=reads._run, args=(manager,), daemon=True,
                                         name="flash-startup-reads")
        reads._thread.start()
        log.info("reading %d blocks (%d bytes) of %s beyond the host arena while CUDA starts",
                 len(reads.blocks), reads.bytes, model)
        return reads

    def _run(self, manager) -> None:
        from .._core import HostArena

        for i, stage in enumerate(self.stages):
            with self._lock:
                wanted = [b for b in stage if b.id in self.planned]
            if not wanted:
                continue
            try:
                offsets, size = {}, 0
                for b in wanted:
                    offsets[b.id] = size
                    size += _aligned(b.length)
                memory = HostArena(size, f"flash-startup-{i}")
                memory.populate()
                whole = memoryview(memory)
                views = {b.id: whole[offsets[b.id]:offsets[b.id] + b.length] for b in wanted}
                with self._lock:
                    views = {bid: v for bid, v in views.items() if bid in self.planned}
                    self.buffers.update(views)
                reads = [(self.blocks[bid], view, self._landed(bid)) for bid, view in views.items()]
                if reads and not manager.read_outside(self.model, reads):
                    raise DeviceError(f"{self.model}: not read beyond the host arena (served "
                                      f"without disk reads or quantized as it enters the host "
                                      f"tier)", model=self.model)
            except Exception as exc:   # noqa: BLE001 -- the load reads these through the host tier
                error = exc if isinstance(exc, FlashError) else FlashError(
                    f"{self.model}: reading beyond the host arena failed: {exc!r}", model=self.model)
                log.warning("%s", error)
                for stage_left in self.stages[i:]:
                    for b in stage_left:
                        if not self.done[b.id].done():
                            self.done[b.id].set_exception(error)
                return

    def _landed(self, block_id: int):
        def callback(error) -> None:
            if error is None:
                self.done[block_id].set_result(None)
            else:
                self.done[block_id].set_exception(error)
        return callback

    def covered(self, block_ids) -> list[int]:
        """Those of ``block_ids`` (to be) read here and not yet taken."""
        with self._lock:
            return [b for b in block_ids if b in self.planned]

    def take(self, block_ids) -> dict:
        """Wait for the blocks' reads: ``{block_id: buffer}`` with their exact bytes. Raises the
        first read's typed error (the blocks are dropped; the caller reads them again)."""
        try:
            for b in block_ids:
                self.done[b].result()
        except BaseException:
            self.drop(block_ids)
            raise
        with self._lock:
            self.taken += sum(self.blocks[b].length for b in block_ids)
            return {b: self.buffers[b] for b in block_ids}

    def drop(self, block_ids) -> None:
        """Forget these blocks (copied, or not wanted): their memory goes with the last reference
        (the IO engine holds a buffer until its read completes)."""
        with self._lock:
            for b in block_ids:
                self.planned.discard(b)
                self.buffers.pop(b, None)

    def close(self) -> None:
        """Drop every block not taken (the load ended, or no load came)."""
        with self._lock:
            left = list(self.planned)
        self.drop(left)


def _aligned(n: int) -> int:
    return (n + 4095) // 4096 * 4096
