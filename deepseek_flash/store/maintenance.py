"""Writers of a live store's metadata other than pack: the store's maintenance lock, and the
access counts the daemon folds in (which ``defrag`` orders blocks by).

Everything that rewrites ``flash_metadata.bin`` of an existing store takes the exclusive
``.defrag.lock`` first, so a count update and a defrag never interleave.
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

from ..errors import StoreInUse
from .format import METADATA_FILE, decode_metadata, encode_metadata
from .repair import write_metadata_atomic

LOCK_FILE = ".defrag.lock"


def lock_store(store_path: Path) -> int:
    """The store's maintenance lock (an open fd; close it to release); ``StoreInUse`` if held."""
    fd = os.open(Path(store_path) / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StoreInUse(f"{store_path}: its maintenance lock {Path(store_path) / LOCK_FILE} is "
                         f"held (a defrag or a count update is running)",
                         path=str(store_path)) from None
    return fd


def add_access_counts(store_path, counts: dict[int, int]) -> int:
    """Add ``counts`` (block id -> uses) to the blocks' ``access_freq`` in the metadata, written
    atomically under the maintenance lock; returns how many blocks changed. Ids the metadata does
    not have (the store was replaced meanwhile) are ignored."""
    path = Path(store_path)
    fd = lock_store(path)
    try:
        meta = path / METADATA_FILE
        blocks, model = decode_metadata(meta.read_bytes(), meta)
        changed = 0
        for block in blocks:
            add = counts.get(block.id, 0)
            if add:
                block.access_freq += add
                changed += 1
        if changed:
            write_metadata_atomic(path, encode_metadata(blocks, model))
        return changed
    finally:
        os.close(fd)
