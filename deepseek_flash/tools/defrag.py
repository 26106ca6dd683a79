"""``defrag``: rewrite a store's data file so the most used blocks come first, crash-safely.

Order: ``access`` puts blocks by descending ``access_freq`` (ties in forward order, so a store
whose counts are all zero keeps forward order); ``forward`` restores the packer's order.

Crash safety (a kill at any moment leaves a store that opens and verifies, old or new layout):

1. copy every block -- its inline header and payload, byte for byte; the header holds no file
   offset -- into ``.blocks.<gen>.dat.tmp-<pid>`` (a name neither the reader nor ``repair``'s
   ``blocks*.dat`` scan looks at), checking each payload's crc32c on the way, and fsync it;
2. rename it to ``blocks.<gen>.dat`` and fsync the directory (both data files are now complete);
3. write the new ``flash_metadata.bin`` naming ``blocks.<gen>.dat`` (temp + fsync + rename +
   directory fsync, ``repair.write_metadata_atomic``) -- **the commit point**;
4. delete the old data file and fsync the directory.

Leftovers of a killed run (a temp file, or a complete data file the metadata does not name) are
removed by the next defrag under its lock. Block ids never change (they are the blocks' names;
``deps`` refer to them); only ``file``, ``header_offset`` and ``offset`` move.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import BlockChecksumError, StoreInUse
from ..fsutil import fsync_dir
from ..store.format import BLOCK_ALIGN, BlockInfo, encode_metadata
from ..store.maintenance import lock_store
from ..store.reader import Store
from ..store.repair import write_metadata_atomic

ORDERS = ("access", "forward")
_DATA_NAME = re.compile(r"blocks(?:\.(\d+))?\.dat")
_TEMP_NAME = re.compile(r"\.blocks\.\d+\.dat\.tmp-\d+")
_COPY_CHUNK = 16 << 20


@dataclass
class DefragReport:
    action: str                 # "rewritten" | "none" (already in the wanted order)
    order: str
    old_files: list
    new_file: str | None
    blocks: int
    bytes: int
    note: str = ""
    order_ids: list = field(default_factory=list)   # block ids in the new file order
    removed_leftovers: list = field(default_factory=list)


# --- in use? ---------------------------------------------------------------------------------------
def _tree_fields(path: Path) -> dict:
    out = {}
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return out
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def _pid_alive(pid: str) -> bool:
    return pid.isdigit() and Path(f"/proc/{pid}").exists()


def daemon_users(store_path: Path, runtime: Path) -> list[str]:
    """Names under which a *running* daemon has ``store_path`` open, from its status tree.

    The tree outlives a daemon that was killed (docs/operations.md), so it counts only when the
    ``pid`` in ``status`` still runs.
    """
    status = _tree_fields(runtime / "status")
    if not _pid_alive(status.get("pid", "")):
        return []
    users = []
    models = runtime / "models"
    for info in sorted(models.glob("*/info")) if models.is_dir() else []:
        path = _tree_fields(info).get("path")
        if path and os.path.realpath(path) == os.path.realpath(store_path):
            users.append(info.parent.name)
    return users


# --- leftovers -------------------------------------------------------------------------------------
def _remove_leftovers(store: Store) -> list[str]:
    """Delete what killed runs left: temp files, and complete data files the metadata does not name.

    Called under the defrag lock, so no temp file belongs to a running defrag.
    """
    named = {b.file for b in store.blocks}
    removed = []
    for p in store.path.iterdir():
        if _TEMP_NAME.fullmatch(p.name) or (_DATA_NAME.fullmatch(p.name) and p.name not in named):
            p.unlink()
            removed.append(p.name)
    if removed:
        fsync_dir(store.path)
    return removed


def _next_file(store: Store) -> str:
    gens = [int(m.group(1) or 0) for p in store.path.iterdir()
            if (m := _DATA_NAME.fullmatch(p.name))]
    return f"blocks.{max(gens, default=0) + 1}.dat"


# --- order -----------------------------------------------------------------------------------------
def plan_order(blocks: list[BlockInfo], order: str) -> tuple[list[BlockInfo], str]:
    """(blocks in the new file order, a note for the operator)."""
    if order not in ORDERS:
        raise ValueError(f"order {order!r}: choose from {', '.join(ORDERS)}")
    forward = sorted(blocks, key=lambda b: b.id)
    if order == "forward":
        return forward, "forward (pack) order"
    if not any(b.access_freq for b in blocks):
        return forward, ("every block's access_freq is 0 (no counts recorded yet): keeping "
                         "forward order")
    return (sorted(forward, key=lambda b: -b.access_freq),
            "by descending access_freq, ties in forward order")


def _physical(blocks: list[BlockInfo]) -> list[tuple]:
    return [(b.file, b.header_offset, b.id) for b in sorted(blocks, key=lambda b: (b.file, b.header_offset))]


# --- the copy ---------------------------------------------------------------------------------------
def _copy_block(src_fd: int, block: BlockInfo, writer, src_path: Path) -> None:
    from .. import _core

    header = os.pread(src_fd, block.header_size, block.header_offset)
    if len(header) != block.header_size:
        raise BlockChecksumError(f"{src_path}: block {block.id}: header truncated at offset "
                                 f"{block.header_offset}", block_id=block.id, path=str(src_path),
                                 expected=block.crc32c, actual=0)
    writer.write(header)
    crc, pos, end = 0, block.offset, block.offset + block.length
    while pos < end:
        piece = os.pread(src_fd, min(_COPY_CHUNK, end - pos), pos)
        if not piece:
            break
        crc = _core.crc32c(piece, crc)
        writer.write(piece)
        pos += len(piece)
    if pos != end or crc != block.crc32c:
        # Never copy a damaged block into the new layout: the old one stays, untouched.
        raise BlockChecksumError(
            f"{src_path}: block {block.id} ({block.role}, layer {block.layer}) crc32c {crc:#010x} != "
            f"recorded {block.crc32c:#010x}; defrag stopped, the store is unchanged (run "
            f"`deepseek-flash verify`)", block_id=block.id, path=str(src_path),
            expected=block.crc32c, actual=crc)
    writer.pad_to(BLOCK_ALIGN)


def defrag(path, order: str = "access", progress=None, runtime=None) -> DefragReport:
    """Re-lay out the store at ``path``; ``progress(nbytes)`` after each block.

    Raises NotAStore/MetadataError (not a store), StoreInUse (a running daemon serves it, or
    another defrag runs), BlockChecksumError (a block is damaged: nothing changed).
    """
    from .. import _core
    from ..paths import runtime_dir

    path = Path(path).absolute()
    Store.open(path)   # NotAStore / MetadataError before creating a lock file in a stranger's dir
    lock_fd = lock_store(path)
    try:
        # Re-read under the lock: another defrag may have committed since.
        store = Store.open(path)
        runtime = Path(runtime) if runtime is not None else runtime_dir()
        users = daemon_users(path, runtime)
        if users:
            raise StoreInUse(f"{path}: open in the running daemon as model {', '.join(users)} "
                             f"(status tree {runtime}); unload it first: deepseek-flash unload "
                             f"{users[0]}", path=str(path), models=users)
        removed = _remove_leftovers(store)
        new_order, note = plan_order(store.blocks, order)
        old_files = sorted({b.file for b in store.blocks})
        total = sum(b.length for b in store.blocks)
        if len(old_files) == 1 and [b.id for b in new_order] == [x[2] for x in _physical(store.blocks)]:
            return DefragReport("none", order, old_files, None, len(store.blocks), total,
                                note + "; the file is already in that order",
                                [b.id for b in new_order], removed)
        new_file = _next_file(store)
        tmp = path / f".{new_file}.tmp-{os.getpid()}"
        moved: dict[int, BlockInfo] = {}
        src_fds = {f: os.open(path / f, os.O_RDONLY | os.O_CLOEXEC) for f in old_files}
        try:
            with _core.AlignedWriter(str(tmp), buffer_size=_COPY_CHUNK) as writer:
                for b in new_order:
                    header_offset = writer.tell()
                    _copy_block(src_fds[b.file], b, writer, path / b.file)
                    moved[b.id] = replace(b, file=new_file, header_offset=header_offset,
                                          offset=header_offset + b.header_size, _view_spec=None)
                    if progress is not None:
                        progress(b.length)
                # close() fsyncs the file.
            os.rename(tmp, path / new_file)
            fsync_dir(path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            for fd in src_fds.values():
                os.close(fd)
        new_blocks = [moved[b.id] for b in store.blocks]
        # The commit point: from here on the store reads the new file.
        write_metadata_atomic(path, encode_metadata(new_blocks, store.model))
        for f in old_files:
            (path / f).unlink(missing_ok=True)
        fsync_dir(path)
        return DefragReport("rewritten", order, old_files, new_file, len(new_blocks), total, note,
                            [b.id for b in new_order], removed)
    finally:
        os.close(lock_fd)
