"""``Store``: open a packed model, list its blocks, read a block's verified bytes.

This is the store's read API for the daemon, the model loader and the tools. Bulk, batched reads
into the host arena go through ``_core.IOEngine`` in the daemon; ``read_block`` is the simple,
synchronous path (tools, tests, embedded fallbacks).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import (BlockChecksumError, FlashIOError, MetadataError, NotAStore, StoreTruncated,
                      UnknownBlock)
from .format import DATA_FILE, METADATA_FILE, BlockInfo, TensorInfo, crc32c, decode_metadata


def read_metadata(path: Path) -> tuple[list[BlockInfo], dict]:
    """(blocks, model) of the store at ``path`` (MetadataError naming the file on any flaw)."""
    meta = Path(path) / METADATA_FILE
    try:
        data = meta.read_bytes()
    except FileNotFoundError:
        raise MetadataError(f"{meta}: missing; rebuild it with `deepseek-flash-repair --model_path "
                            f"{path} --force_rebuild`", path=str(meta)) from None
    except OSError as exc:
        raise MetadataError(f"{meta}: cannot read: {exc.strerror}", path=str(meta)) from None
    return decode_metadata(data, meta)


class Store:
    """A packed model on disk. Cheap to open: reads the metadata and config.json only."""

    def __init__(self, path: Path, blocks: list[BlockInfo], model: dict, config: dict):
        self.path = path
        self.blocks = blocks
        self.model = model
        self.config = config
        self._by_id = {b.id: b for b in blocks}
        self._by_name: dict[str, tuple[BlockInfo, TensorInfo]] = {}
        for b in blocks:
            for t in b.tensors:
                for name in (t.name, *t.aliases):
                    self._by_name[name] = (b, t)

    @classmethod
    def open(cls, path) -> Store:
        path = Path(path)
        if not path.is_dir() or not ((path / METADATA_FILE).exists() or (path / DATA_FILE).exists()):
            raise NotAStore(f"{path}: not a deepseek-flash store (no {METADATA_FILE} or {DATA_FILE}; "
                            f"make one with `deepseek-flash pack`)", path=str(path))
        blocks, model = read_metadata(path)
        cfg_path = path / "config.json"
        try:
            config = json.loads(cfg_path.read_text())
        except FileNotFoundError:
            raise NotAStore(f"{cfg_path}: missing from the store", path=str(cfg_path)) from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise NotAStore(f"{cfg_path}: not valid JSON ({exc})", path=str(cfg_path)) from None
        return cls(path, blocks, model, config)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def num_layers(self) -> int:
        return int(self.config.get("num_hidden_layers", 1 + max((b.layer for b in self.blocks), default=-1)))

    @property
    def total_bytes(self) -> int:
        return sum(b.length for b in self.blocks)

    def block(self, block_id: int) -> BlockInfo:
        try:
            return self._by_id[block_id]
        except KeyError:
            raise UnknownBlock(f"{self.path}: no block {block_id} (the store has "
                               f"{len(self.blocks)})", block_id=block_id) from None

    def find(self, hf_name: str) -> tuple[BlockInfo, TensorInfo]:
        try:
            return self._by_name[hf_name]
        except KeyError:
            raise UnknownBlock(f"{self.path}: no tensor named {hf_name!r}", tensor=hf_name) from None

    def data_path(self, block: BlockInfo) -> Path:
        return self.path / block.file

    def read_block(self, block_id: int, verify: bool = True) -> bytes:
        """The payload of ``block_id``; with ``verify``, BlockChecksumError if its crc32c is off."""
        block = self.block(block_id)
        path = self.data_path(block)
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                data = os.pread(fd, block.length, block.offset)
            finally:
                os.close(fd)
        except OSError as exc:
            raise FlashIOError(f"{path}: reading block {block_id}: {exc.strerror}", errno=exc.errno,
                               path=str(path), offset=block.offset, block_id=block_id) from None
        if len(data) != block.length:
            raise StoreTruncated(f"{path}: block {block_id} truncated: {len(data)} of {block.length} "
                                 f"bytes at offset {block.offset}: the data file is shorter than its "
                                 f"metadata says", path=str(path), offset=block.offset,
                                 length=block.length, block_id=block_id)
        if verify:
            actual = crc32c(data)
            if actual != block.crc32c:
                raise BlockChecksumError(
                    f"{path}: block {block_id} ({block.role}, layer {block.layer}) crc32c "
                    f"{actual:#010x} != recorded {block.crc32c:#010x}", block_id=block_id,
                    path=str(path), expected=block.crc32c, actual=actual)
        return data

    @property
    def quant(self) -> dict | None:
        """How the store was quantized (``scheme``, ``granularity``, ``group_size``), or None."""
        return next((dict(b.quant) for b in self.blocks if b.quant), None)

    def tensor(self, hf_name: str):
        """A copy of one tensor (tests, tools); the hot path uses views.block_tensors."""
        from .views import block_tensors
        block, _ = self.find(hf_name)
        from ..quant import QuantizedTensor
        tensor = block_tensors(block, bytearray(self.read_block(block.id)))[hf_name]
        # A quantized weight comes back dequantized to the dtype it is computed in.
        return tensor.dequantize() if isinstance(tensor, QuantizedTensor) else tensor.clone()
