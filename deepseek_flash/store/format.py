"""Byte layout of the block store: inline block headers and ``flash_metadata.bin``.

Encoding and decoding only -- no file system work -- so the packer, the reader, ``verify`` and
``repair`` agree on every byte by construction. ``docs/format.md`` is the human spec of the same
layout; change both together.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

import msgpack

from ..errors import MetadataError
from ..fsutil import align_up

# The newest version this release reads and writes. A store is written with the lowest version that
# holds it: 1 without quantized tensors (readable by every release), 2 with them (docs/format.md).
FORMAT_VERSION = 2
QUANT_VERSION = 2

DATA_FILE = "blocks.dat"
METADATA_FILE = "flash_metadata.bin"

# Blocks and payloads start on 4 KiB so O_DIRECT reads land straight in the arena; tensors inside a
# payload start on 256 B, enough for every vector unit and for CUDA's own allocation alignment.
BLOCK_ALIGN = 4096
TENSOR_ALIGN = 256

BLOCK_MAGIC = b"DSFLBLK\x00"
# magic, version, flags, header_size, block_id, layer, payload_length, payload_crc32c,
# body_length, reserved, header_crc32c
BLOCK_FIXED = struct.Struct("<8sHHIIiQIIII")
assert BLOCK_FIXED.size == 48

META_MAGIC = b"DSFLMETA"
# magic, version, flags, block_count, body_length, body_crc32c, header_crc32c
META_FIXED = struct.Struct("<8sHHIQII")
assert META_FIXED.size == 32

DTYPE_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4}
# Storage elements of quantized tensors (format version 2); their bytes are ``quant``'s to describe.
QUANT_DTYPES = ("int8", "int4")
SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}

ROLES = ("embed", "norms", "attn", "mlp_gate_up", "mlp_down", "final_norm", "lm_head")
HOT_ROLES = frozenset({"embed", "norms", "final_norm"})
# Norms and the vocabulary projections lose accuracy fast when quantized; projections do not.
EXACT_ROLES = frozenset({"embed", "norms", "final_norm", "lm_head"})


def crc32c(data, value: int = 0) -> int:
    from .. import _core
    return _core.crc32c(data, value)


@dataclass
class TensorInfo:
    """One HF tensor inside a block payload (``aliases`` are tied names served by the same bytes)."""

    name: str
    dtype: str
    shape: tuple
    offset: int
    nbytes: int
    aliases: list = field(default_factory=list)
    # Quantized weights only (version 2): scheme, granularity, group_size, dtype (compute),
    # scales_dtype, scales_shape, scales_offset, scales_nbytes -- docs/format.md.
    quant: dict | None = None

    @property
    def end(self) -> int:
        """Payload offset just past this tensor's bytes (its scales for a quantized one)."""
        if self.quant:
            return self.quant["scales_offset"] + self.quant["scales_nbytes"]
        return self.offset + self.nbytes

    def to_dict(self) -> dict:
        d = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
             "offset": self.offset, "nbytes": self.nbytes, "aliases": list(self.aliases)}
        if self.quant:
            d["quant"] = dict(self.quant)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TensorInfo:
        quant = d.get("quant")
        return cls(name=d["name"], dtype=d["dtype"], shape=tuple(d["shape"]), offset=d["offset"],
                   nbytes=d["nbytes"], aliases=list(d.get("aliases", ())),
                   quant=dict(quant) if quant else None)


@dataclass(eq=False)
class BlockInfo:
    """One semantic block: where its payload lies, what it serves, how it is used."""

    id: int
    role: str
    layer: int
    file: str
    offset: int
    length: int
    crc32c: int
    tensors: list
    deps: list = field(default_factory=list)
    access_freq: int = 0
    precision_req: str = "exact"
    quant: dict | None = None
    header_offset: int = 0
    header_size: int = BLOCK_ALIGN
    # Filled on first use by views.block_tensors: (name, offset, nbytes, torch dtype, shape) rows.
    _view_spec: list | None = field(default=None, repr=False, compare=False)

    @property
    def hot(self) -> bool:
        return self.role in HOT_ROLES

    @property
    def names(self) -> list:
        out = []
        for t in self.tensors:
            out.append(t.name)
            out.extend(t.aliases)
        return out

    def to_dict(self) -> dict:
        return {"id": self.id, "role": self.role, "layer": self.layer, "file": self.file,
                "offset": self.offset, "length": self.length, "crc32c": self.crc32c,
                "header_offset": self.header_offset, "header_size": self.header_size,
                "tensors": [t.to_dict() for t in self.tensors], "deps": list(self.deps),
                "access_freq": self.access_freq, "precision_req": self.precision_req,
                "quant": self.quant}

    @classmethod
    def from_dict(cls, d: dict) -> BlockInfo:
        return cls(id=d["id"], role=d["role"], layer=d["layer"], file=d["file"], offset=d["offset"],
                   length=d["length"], crc32c=d["crc32c"],
                   tensors=[TensorInfo.from_dict(t) for t in d["tensors"]], deps=list(d["deps"]),
                   access_freq=d.get("access_freq", 0), precision_req=d.get("precision_req", "exact"),
                   quant=d.get("quant"), header_offset=d["header_offset"],
                   header_size=d["header_size"])


# --- inline block header ----------------------------------------------------------------------
def block_version(block: BlockInfo) -> int:
    """The lowest format version that describes ``block`` (2 when it holds quantized tensors)."""
    return QUANT_VERSION if block.quant or any(t.quant for t in block.tensors) else 1


def encode_block_header(block: BlockInfo, block_count: int) -> bytes:
    """The header region (a multiple of 4 KiB, zero padded) that precedes ``block``'s payload."""
    doc = {
        "role": block.role,
        "block_count": block_count,
        "tensors": [t.to_dict() for t in block.tensors],
        "deps": list(block.deps),
        "precision_req": block.precision_req,
    }
    if block.quant:
        doc["quant"] = dict(block.quant)
    body = msgpack.packb(doc, use_bin_type=True)
    size = align_up(BLOCK_FIXED.size + len(body), BLOCK_ALIGN)
    fixed = BLOCK_FIXED.pack(BLOCK_MAGIC, block_version(block), 0, size, block.id, block.layer,
                             block.length, block.crc32c, len(body), 0, 0)
    hcrc = crc32c(body, crc32c(fixed[:44]))
    return fixed[:44] + struct.pack("<I", hcrc) + body + bytes(size - BLOCK_FIXED.size - len(body))


class BadHeader(ValueError):
    """Bytes at a 4 KiB boundary that are not a valid block header (the message says why)."""


def header_size_at(region: bytes | memoryview) -> int:
    """The size a header claims from its first 48 bytes (raises BadHeader when not a header)."""
    if len(region) < BLOCK_FIXED.size:
        raise BadHeader("short read")
    magic, version, _flags, size, *_rest = BLOCK_FIXED.unpack_from(region)
    if magic != BLOCK_MAGIC:
        raise BadHeader("no block magic")
    if version > FORMAT_VERSION:
        raise BadHeader(f"block format version {version} is newer than {FORMAT_VERSION}")
    if size < BLOCK_ALIGN or size % BLOCK_ALIGN or size > 64 * BLOCK_ALIGN:
        raise BadHeader(f"implausible header size {size}")
    return size


def decode_block_header(region: bytes | memoryview, header_offset: int, file: str) -> tuple[BlockInfo, int]:
    """Parse a header region; returns the block (payload placed right after it) and block_count."""
    size = header_size_at(region)
    if len(region) < size:
        raise BadHeader("header region truncated")
    (_magic, _version, _flags, size, block_id, layer, length, pcrc, body_len, _res,
     hcrc) = BLOCK_FIXED.unpack_from(region)
    if BLOCK_FIXED.size + body_len > size:
        raise BadHeader(f"body length {body_len} exceeds header size {size}")
    body = bytes(region[BLOCK_FIXED.size:BLOCK_FIXED.size + body_len])
    actual = crc32c(body, crc32c(bytes(region[:44])))
    if actual != hcrc:
        raise BadHeader(f"header crc32c {actual:#010x} != recorded {hcrc:#010x}")
    try:
        meta = msgpack.unpackb(body, raw=False)
        block = BlockInfo(id=block_id, role=meta["role"], layer=layer, file=file,
                          offset=header_offset + size, length=length, crc32c=pcrc,
                          tensors=[TensorInfo.from_dict(t) for t in meta["tensors"]],
                          deps=list(meta["deps"]), precision_req=meta["precision_req"],
                          quant=meta.get("quant"), header_offset=header_offset, header_size=size)
        return block, int(meta["block_count"])
    except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
        raise BadHeader(f"header body does not decode: {exc}") from None


# --- flash_metadata.bin -----------------------------------------------------------------------
def encode_metadata(blocks: list, model: dict) -> bytes:
    version = max((block_version(b) for b in blocks), default=1)
    body = msgpack.packb({
        "format_version": version,
        "model": model,
        "data_files": sorted({b.file for b in blocks}),
        "blocks": [b.to_dict() for b in blocks],
    }, use_bin_type=True)
    fixed = META_FIXED.pack(META_MAGIC, version, 0, len(blocks), len(body), crc32c(body), 0)
    return fixed[:28] + struct.pack("<I", crc32c(fixed[:28])) + body


def decode_metadata(data: bytes, path) -> tuple[list, dict]:
    """(blocks, model) from the bytes of ``flash_metadata.bin`` at ``path``; MetadataError on any flaw."""
    def fail(what: str):
        raise MetadataError(f"{path}: {what}; rebuild it with `deepseek-flash-repair --model_path "
                            f"{_parent(path)} --force_rebuild`", path=str(path))

    if len(data) < META_FIXED.size:
        fail(f"truncated ({len(data)} bytes, the fixed header alone is {META_FIXED.size})")
    magic, version, _flags, count, body_len, body_crc, hcrc = META_FIXED.unpack_from(data)
    if magic != META_MAGIC:
        fail(f"wrong magic {magic!r} (expected {META_MAGIC!r}): not a deepseek-flash metadata file")
    if crc32c(data[:28]) != hcrc:
        fail("fixed header crc32c mismatch")
    if version > FORMAT_VERSION:
        raise MetadataError(f"{path}: format version {version} is newer than this deepseek-flash "
                            f"reads ({FORMAT_VERSION}); upgrade deepseek-flash", path=str(path))
    if len(data) < META_FIXED.size + body_len:
        fail(f"truncated ({len(data)} bytes, header says {META_FIXED.size + body_len})")
    body = data[META_FIXED.size:META_FIXED.size + body_len]
    actual = crc32c(body)
    if actual != body_crc:
        fail(f"body crc32c {actual:#010x} != recorded {body_crc:#010x}")
    try:
        doc = msgpack.unpackb(body, raw=False)
        blocks = [BlockInfo.from_dict(b) for b in doc["blocks"]]
        model = doc["model"]
    except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
        fail(f"body does not decode ({exc})")
    if len(blocks) != count:
        fail(f"header counts {count} blocks, body holds {len(blocks)}")
    return blocks, model


def _parent(path) -> str:
    from pathlib import Path
    return str(Path(path).parent)
