"""``repair``: rebuild ``flash_metadata.bin`` from the inline block headers in the data file.

Like a NAND controller rebuilding its mapping table from the spare area: scan the data file in
4 KiB steps, keep every header whose crc32c holds, check each payload's crc32c, and write a new
index atomically (temp file, fsync, rename, directory fsync). Block data is never modified, and a
store that was readable stays readable whatever moment repair is killed at: the old metadata is
replaced only by a complete new one, and only when every block was found.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import MetadataError, NotAStore
from ..fsutil import align_up, atomic_write
from .format import (
    BLOCK_ALIGN,
    BLOCK_FIXED,
    DATA_FILE,
    METADATA_FILE,
    BadHeader,
    BlockInfo,
    crc32c,
    decode_block_header,
    encode_metadata,
    header_size_at,
)
from .layout import architecture
from .pack import model_summary
from .reader import read_metadata
from .verify import read_sequential


@dataclass
class RepairReport:
    action: str = "none"            # "none" (metadata was fine) | "rebuilt" | "refused"
    reason: str = ""                # why the metadata was rebuilt (or the old one's error)
    blocks: int = 0
    bad: list = field(default_factory=list)       # (block_id, reason): payload crc wrong
    missing: list = field(default_factory=list)   # block ids no valid header was found for
    skipped: list = field(default_factory=list)   # (offset, reason): 4 KiB slots that looked like
                                                  # a damaged header (magic present, rest not)

    @property
    def ok(self) -> bool:
        return not (self.bad or self.missing)


def scan_data_file(path: Path, file: str, progress=None) -> tuple[dict, list, list, list]:
    """(blocks by id, block_count claims, bad payloads, damaged header slots) of one data file."""
    size = path.stat().st_size
    found: dict[int, BlockInfo] = {}
    claims: list[int] = []
    bad: list = []
    skipped: list = []
    fd = os.open(path, os.O_RDONLY)
    try:
        pos = 0
        while pos + BLOCK_FIXED.size <= size:
            first = os.pread(fd, BLOCK_ALIGN, pos)
            try:
                hsize = header_size_at(first)
                region = first if hsize == len(first) else os.pread(fd, hsize, pos)
                block, count = decode_block_header(region, pos, file)
            except BadHeader as exc:
                if first[:4] == b"DSFL":
                    skipped.append((pos, str(exc)))
                pos += BLOCK_ALIGN
                if progress is not None:
                    progress(BLOCK_ALIGN)
                continue
            end = block.offset + block.length
            if end > size:
                bad.append((block.id, f"payload truncated: ends at byte {end}, {path} has {size}"))
                skipped.append((pos, "header of a truncated block"))
                pos += BLOCK_ALIGN
                continue
            crc = 0
            for _off, mv in read_sequential(path, block.offset, end):
                crc = crc32c(mv, crc)
            if block.id in found:
                skipped.append((pos, f"second header for block {block.id} (first at "
                                     f"{found[block.id].header_offset})"))
            else:
                found[block.id] = block
                claims.append(count)
                if crc != block.crc32c:
                    bad.append((block.id, f"payload crc32c {crc:#010x} != header's "
                                          f"{block.crc32c:#010x} ({path}, offset {block.offset})"))
            new_pos = align_up(end, BLOCK_ALIGN)
            if progress is not None:
                progress(new_pos - pos)
            pos = new_pos
    finally:
        os.close(fd)
    return found, claims, bad, skipped


def _model_from_config(path: Path, blocks: list) -> dict:
    cfg_path = path / "config.json"
    try:
        config = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise NotAStore(f"{cfg_path}: needed to rebuild the metadata and not readable ({exc})",
                        path=str(cfg_path)) from None
    return model_summary(config, architecture(config, cfg_path), blocks)


def write_metadata_atomic(path: Path, data: bytes) -> None:
    """Replace ``path/flash_metadata.bin`` by ``data``: temp file, fsync, rename, directory fsync."""
    atomic_write(path / METADATA_FILE, data)


def repair(path, force_rebuild: bool = False, progress=None) -> RepairReport:
    """Check ``path``'s metadata; rebuild it from the data when missing, corrupt or forced."""
    path = Path(path)
    if not path.is_dir() or not any(path.glob("blocks*.dat")):
        raise NotAStore(f"{path}: not a deepseek-flash store (no {DATA_FILE})", path=str(path))
    report = RepairReport()
    try:
        old_blocks, old_model = read_metadata(path)
    except MetadataError as exc:
        old_blocks, old_model = None, None
        report.reason = exc.message
    if old_blocks is not None and not force_rebuild:
        report.blocks = len(old_blocks)
        return report
    if old_blocks is not None:
        report.reason = "rebuild forced"
    files = sorted({b.file for b in old_blocks} if old_blocks else
                   {p.name for p in path.glob("blocks*.dat")})
    found: dict[int, BlockInfo] = {}
    claims: list[int] = []
    for file in files:
        if not (path / file).exists():
            continue
        f_found, f_claims, f_bad, f_skipped = scan_data_file(path / file, file, progress)
        for bid, block in f_found.items():
            if bid in found:
                report.skipped.append((block.header_offset, f"block {bid} also in {found[bid].file}"))
            else:
                found[bid] = block
        claims.extend(f_claims)
        report.bad.extend(f_bad)
        report.skipped.extend(f_skipped)
    count = max(claims, default=0)
    report.missing = sorted(set(range(count)) - found.keys())
    report.blocks = len(found)
    if report.missing or not found:
        # A partial index would make a store whose old index still reads worse, not better.
        report.action = "refused"
        return report
    blocks = [found[i] for i in range(count)]
    old_by_id = {b.id: b for b in old_blocks or ()}
    for b in blocks:
        old = old_by_id.get(b.id)
        if old is not None and (old.file, old.offset, old.crc32c) == (b.file, b.offset, b.crc32c):
            b.access_freq, b.quant = old.access_freq, old.quant
    model = dict(old_model) if old_model else _model_from_config(path, blocks)
    write_metadata_atomic(path, encode_metadata(blocks, model))
    report.action = "rebuilt"
    return report
