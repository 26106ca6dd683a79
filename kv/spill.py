"""The NVMe tier of the KV cache: whole host chunks of pages written to ``spill_dir`` and pages
read back one by one when selected.

A chunk is written by the native ``AlignedWriter`` (O_DIRECT where the file system allows it),
each page starting on a 4 KiB boundary, then fsynced and closed before its host memory is freed,
so a page is never in neither place. Each page's crc32c is kept in memory; reads go through the
native ``IOEngine`` with that crc as ``expected_crc``, so a page whose bytes changed on disk raises
``KVPageCorrupt`` naming the file, layer, page and sequence.
"""
from __future__ import annotations

import errno as errno_mod
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepseek_flash import _core
from deepseek_flash.errors import BlockChecksumError, FlashIOError, KVPageCorrupt, KVSpillFailed

ALIGN = 4096


def _bytes_of(t: torch.Tensor):
    """A uint8 numpy view of a contiguous CPU tensor (bf16 has no numpy dtype; bytes do)."""
    return t.contiguous().view(-1).view(torch.uint8).numpy()


@dataclass
class SpilledChunk:
    """Where a chunk's pages live on disk: ``path``, page ``stride`` (4 KiB multiple), crcs."""

    path: str
    stride: int
    page_bytes: int
    crcs: list[int] = field(default_factory=list)

    @property
    def file_bytes(self) -> int:
        return self.stride * len(self.crcs)


class SpillStore:
    """One cache's spill files under ``directory`` (created when missing), removed by ``close``."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.tag = f"kv-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._engine: _core.IOEngine | None = None
        self._paths: list[str] = []
        self.bytes_written = 0
        self.bytes_read = 0

    def write_chunk(self, name: str, pages: torch.Tensor) -> SpilledChunk:
        """Write ``pages`` (``[n, ...]``, CPU, one page per row) to a new file; fsync; return
        its map. Raises ``KVSpillFailed`` (path, errno) and leaves no file behind on failure."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise KVSpillFailed(f"KV spill directory {self.directory}: cannot create it: "
                                f"{exc.strerror}", path=str(self.directory),
                                errno=exc.errno or 0) from exc
        path = str(self.directory / f"{self.tag}-{name}.pages")
        n = pages.shape[0]
        rows = pages.reshape(n, -1)
        page_bytes = rows[0].numel() * rows.element_size()
        stride = -(-page_bytes // ALIGN) * ALIGN
        chunk = SpilledChunk(path, stride, page_bytes)
        try:
            with _core.AlignedWriter(path) as writer:
                for i in range(n):
                    data = _bytes_of(rows[i])
                    chunk.crcs.append(_core.crc32c(data))
                    writer.write(data)
                    writer.pad_to(ALIGN)
        except (FlashIOError, OSError) as exc:
            err = getattr(exc, "errno", 0) or 0
            try:
                os.unlink(path)
            except OSError:
                pass
            reason = os.strerror(err) if err else str(exc)
            raise KVSpillFailed(f"KV spill directory {self.directory}: writing {chunk.stride * n} "
                                f"bytes to {path} failed: {reason}", path=path,
                                errno=err) from exc
        self._paths.append(path)
        self.bytes_written += chunk.file_bytes
        return chunk

    def read_page(self, chunk: SpilledChunk, index: int, dest: torch.Tensor, *, layer: int,
                  page: int, row: int) -> None:
        """Read page ``index`` of ``chunk`` into ``dest`` (contiguous CPU tensor of the page's
        size), crc-checked. Raises ``KVPageCorrupt`` or ``FlashIOError`` naming the file."""
        if self._engine is None:
            self._engine = _core.IOEngine(queue_depth=8)
        try:
            self._engine.read(chunk.path, index * chunk.stride, chunk.page_bytes, _bytes_of(dest),
                              block_id=page, expected_crc=chunk.crcs[index])
        except BlockChecksumError as exc:
            raise KVPageCorrupt(
                f"KV page corrupt in {chunk.path}: layer {layer} page {page} (sequence {row}, "
                f"bytes {index * chunk.stride}..{index * chunk.stride + chunk.page_bytes}) failed "
                f"crc32c", path=chunk.path, layer=layer, page=page, row=row,
                expected=getattr(exc, "expected", chunk.crcs[index]),
                actual=getattr(exc, "actual", None)) from exc
        self.bytes_read += chunk.page_bytes

    def remove(self, chunk: SpilledChunk) -> None:
        try:
            os.unlink(chunk.path)
        except OSError as exc:
            if exc.errno != errno_mod.ENOENT:
                raise
        if chunk.path in self._paths:
            self._paths.remove(chunk.path)

    def close(self) -> None:
        """Remove every file this store wrote; close the engine. Idempotent."""
        for path in self._paths:
            try:
                os.unlink(path)
            except OSError:
                pass
        self._paths.clear()
        if self._engine is not None:
            self._engine.close()
            self._engine = None
