"""``verify``: read every byte of a store once, sequentially, and check every block.

Each payload's crc32c is checked against the metadata, and each inline header is checked to
decode and agree with the metadata (so ``repair --force_rebuild`` would rebuild the same index).
Reads are large, sequential, O_DIRECT where the file system allows it (so the result says what is
on the disk, not in the page cache), double-buffered by a reader thread.
"""
from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import FlashIOError
from ..fsutil import align_up
from .format import BadHeader, BlockInfo, crc32c, decode_block_header
from .readahead import read_ahead
from .reader import Store

CHUNK = 16 << 20
_DEPTH = 3


def _open_for_stream(path: Path) -> tuple[int, bool]:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT), True
    except OSError:
        # tmpfs and some FUSE file systems refuse O_DIRECT; buffered reads are still correct.
        return os.open(path, os.O_RDONLY), False


def read_sequential(path: Path, start: int = 0, end: int | None = None, chunk: int = CHUNK):
    """Yield (offset, memoryview) covering [start, end) of ``path`` in order (short at EOF).

    A background thread keeps the next reads in flight while the caller checksums; each view is
    valid until the next one is requested.
    """
    path = Path(path)
    size = path.stat().st_size
    end = size if end is None else min(end, size)
    base = start - start % 4096
    if base >= end:
        return
    fd, direct = _open_for_stream(path)
    if not direct:
        os.posix_fadvise(fd, base, end - base, os.POSIX_FADV_SEQUENTIAL)

    def fill(take, give):
        pos = base
        try:
            while pos < end:
                buf = take()
                if buf is None:
                    return
                want = min(chunk, align_up(end - pos, 4096))
                with memoryview(buf) as whole, whole[:want] as dest:
                    n = os.preadv(fd, [dest], pos)
                give(buf, (pos, buf, n))
                if n < want:
                    return
                pos += n
        except OSError as exc:
            raise FlashIOError(f"{path}: read at offset {pos}: {exc.strerror}", errno=exc.errno,
                               path=str(path), offset=pos, block_id=-1) from None

    buffers = [mmap.mmap(-1, chunk) for _ in range(_DEPTH)]
    # closing(): the reader thread is joined before its fd is closed, however this generator ends.
    try:
        with contextlib.closing(read_ahead(buffers, fill, "verify-reader")) as items:
            for pos, buf, n in items:
                lo, hi = max(pos, start), min(pos + n, end)
                if hi > lo:
                    yield lo, memoryview(buf)[lo - pos:hi - pos]
                if n == 0:
                    return
    finally:
        # The buffers are freed with their last view; closing them here would race a caller
        # that still holds the view it was handed.
        os.close(fd)


@dataclass
class VerifyReport:
    blocks: int = 0
    bytes: int = 0
    bad: list = field(default_factory=list)   # (block_id, reason)

    @property
    def ok(self) -> bool:
        return not self.bad


def _check_header(block: BlockInfo, region: bytes, count: int) -> str | None:
    try:
        found, claimed = decode_block_header(region, block.header_offset, block.file)
    except BadHeader as exc:
        return f"inline header at offset {block.header_offset} is damaged ({exc})"
    mismatched = [k for k in ("id", "layer", "role", "offset", "length", "crc32c")
                  if getattr(found, k) != getattr(block, k)]
    if [t.to_dict() for t in found.tensors] != [t.to_dict() for t in block.tensors]:
        mismatched.append("tensors")
    if claimed != count:
        mismatched.append("block_count")
    if mismatched:
        return f"inline header disagrees with the metadata on {', '.join(mismatched)}"
    return None


def verify_store(store: Store, progress=None) -> VerifyReport:
    """Check every block of ``store``; ``progress(nbytes)`` is called as bytes are read."""
    report = VerifyReport(blocks=len(store.blocks))
    by_file: dict[str, list[BlockInfo]] = {}
    for b in store.blocks:
        by_file.setdefault(b.file, []).append(b)
    for file, blocks in by_file.items():
        path = store.path / file
        if not path.exists():
            report.bad.extend((b.id, f"data file {path} is missing") for b in blocks)
            continue
        size = path.stat().st_size
        blocks.sort(key=lambda b: b.header_offset)
        # Segments in file order: (start, end, block, is_header).
        segs = []
        for b in blocks:
            segs.append((b.header_offset, b.header_offset + b.header_size, b, True))
            segs.append((b.offset, b.offset + b.length, b, False))
        state = {}   # block id -> crc so far / header bytes
        idx = 0
        for pos, mv in read_sequential(path, 0, max(s[1] for s in segs)):
            chunk_end = pos + len(mv)
            while idx < len(segs) and segs[idx][0] < chunk_end:
                start, end, b, is_header = segs[idx]
                lo, hi = max(start, pos), min(end, chunk_end)
                if hi > lo:
                    piece = mv[lo - pos:hi - pos]
                    if is_header:
                        state[("h", b.id)] = state.get(("h", b.id), b"") + bytes(piece)
                    else:
                        state[("p", b.id)] = crc32c(piece, state.get(("p", b.id), 0))
                if end > chunk_end:
                    break
                idx += 1
            if progress is not None:
                progress(len(mv))
            report.bytes += len(mv)
        for b in blocks:
            if b.offset + b.length > size or b.header_offset + b.header_size > size:
                report.bad.append((b.id, f"{path} is truncated: block {b.id} ends at byte "
                                         f"{b.offset + b.length}, the file has {size}"))
                continue
            problem = _check_header(b, state.get(("h", b.id), b""), len(store.blocks))
            if problem:
                report.bad.append((b.id, problem))
            actual = state.get(("p", b.id), 0)
            if actual != b.crc32c:
                report.bad.append((b.id, f"payload crc32c {actual:#010x} != recorded "
                                         f"{b.crc32c:#010x} ({path}, offset {b.offset}, "
                                         f"{b.length} bytes)"))
    return report
