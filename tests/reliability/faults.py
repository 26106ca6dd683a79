"""Fault helpers shared by the reliability tests: corrupt or truncate a store, a faulty engine,
fake udev events, and the figures docs/reliability.md quotes."""
from __future__ import annotations

import errno
import queue
import shutil
from pathlib import Path

from deepseek_flash.store import Store

# --- the figures docs/reliability.md quotes (keep both in sync) ----------------------------------
FUZZ_MIN_FRAMES = 100_000          # malformed/truncated/oversized/out-of-order frames per run
FUZZ_RSS_GROWTH_LIMIT = 8 << 20    # daemon anonymous RSS may grow at most this much over the run
# s: another client's acquire+release under abuse. A client made to wait on a stalled or flooding
# one would wait for ever (they never finish their frames / never read), so any finite max shows it
# did not; the max bounds scheduling noise on 2 CPUs shared with the flooders, measured 0.5-1.05 s.
STUCK_P50_LIMIT, STUCK_MAX_LIMIT = 0.02, 2.0
DEATH_KILLS_COLD_ACQUIRE = 6       # clients SIGKILLed at random moments of cold acquires
DEATH_DAEMON_KILLS = 3             # daemon SIGKILL + restart cycles under a looping client
LOAD_CI_CLIENTS, LOAD_CI_ROUNDS = 64, 300   # CI scale of bench/load_clients.py
LOAD_FULL_CLIENTS, LOAD_FULL_ROUNDS = 64, 10_000


def copy_store(src: Path, root: Path, name: str) -> Path:
    dst = root / "stores" / name
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, dst)
    return dst


def corrupt_block(store_path: Path, block_id: int, at: int = 100) -> bytes:
    """Flip one byte of a block's payload on disk; returns the corrupted payload."""
    store = Store.open(store_path)
    block = store.block(block_id)
    with open(store.data_path(block), "r+b") as f:
        f.seek(block.offset + at)
        byte = f.read(1)
        f.seek(block.offset + at)
        f.write(bytes([byte[0] ^ 0xFF]))
        f.seek(block.offset)
        return f.read(block.length)


def block_of(store_path: Path, role: str, layer: int):
    return next(b for b in Store.open(store_path).blocks if b.role == role and b.layer == layer)


class FaultyEngine:
    """A real IOEngine whose reads of chosen (path, offset) extents fail with ``errno`` through the
    engine's own fault hook (``IOEngine.inject_fault``): the failure travels the real completion
    path, exactly as a media error would."""

    def __init__(self, engine):
        if not hasattr(engine, "inject_fault"):
            raise RuntimeError("IOEngine.inject_fault is compiled only into test builds: rebuild with "
                               "DEEPSEEK_FLASH_FAULT_INJECTION=1 pip install --no-build-isolation -e .")
        self.engine = engine
        self.failing: dict[tuple[str, int], list] = {}   # (path, offset) -> [errno, reads left]
        self.injected = 0

    def fail(self, path, offset: int, err: int = errno.EIO, times: int = 1) -> None:
        """The next ``times`` reads of that extent fail with ``err``."""
        self.failing[(str(path), offset)] = [err, times]

    def heal(self) -> None:
        self.failing.clear()

    def submit(self, requests):
        for req in requests:
            fault = self.failing.get((req.path, req.offset))
            if fault is not None and fault[1] > 0:
                fault[1] -= 1
                self.engine.inject_fault(req.block_id, errno=fault[0], count=1)
                self.injected += 1
        return self.engine.submit(requests)

    def __getattr__(self, name):
        return getattr(self.engine, name)


class FakeDevice:
    """What pyudev's Monitor.poll returns, reduced to what the watch reads."""

    def __init__(self, action: str, device_number: int = 0, sys_name: str = "", ro: str | None = None):
        self.action = action
        self.device_number = device_number
        self.sys_name = sys_name
        self.attributes = {} if ro is None else {"ro": ro.encode()}
        self.properties = {}


class FakeMonitor:
    """A udev event source to inject: ``push`` events, the watch ``poll``s them."""

    def __init__(self):
        self.events: queue.Queue = queue.Queue()

    def push(self, device: FakeDevice) -> None:
        self.events.put(device)

    def poll(self, timeout=None):
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            return None
