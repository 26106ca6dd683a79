"""format: the exact bytes of block headers and flash_metadata.bin, as docs/format.md specifies."""
from __future__ import annotations

import struct

import msgpack
import pytest

from deepseek_flash import errors
from deepseek_flash.store.format import (
    BadHeader,
    BlockInfo,
    TensorInfo,
    crc32c,
    decode_block_header,
    decode_metadata,
    encode_block_header,
    encode_metadata,
)


def _block(names=1):
    tensors = [TensorInfo(f"model.layers.0.t{i}.weight", "bfloat16", (8, 4), i * 256, 64) for i in range(names)]
    return BlockInfo(id=7, role="attn", layer=3, file="blocks.dat", offset=8192, length=256 * names,
                     crc32c=0x12345678, tensors=tensors, deps=[5, 6], precision_req="quantizable",
                     header_offset=4096)


def test_block_header_bytes():
    raw = encode_block_header(_block(), block_count=9)
    assert len(raw) == 4096
    magic, ver, flags, size, bid, layer, length, pcrc, blen, res, hcrc = struct.unpack_from(
        "<8sHHIIiQIIII", raw)
    assert (magic, ver, flags, size, bid, layer, length, pcrc, res) == (
        b"DSFLBLK\x00", 1, 0, 4096, 7, 3, 256, 0x12345678, 0)
    body = raw[48:48 + blen]
    assert hcrc == crc32c(raw[:44] + body)
    assert raw[48 + blen:] == bytes(4096 - 48 - blen)
    doc = msgpack.unpackb(body)
    assert doc == {"role": "attn", "block_count": 9, "deps": [5, 6], "precision_req": "quantizable",
                   "tensors": [{"name": "model.layers.0.t0.weight", "dtype": "bfloat16", "shape": [8, 4],
                                "offset": 0, "nbytes": 64, "aliases": []}]}
    block, count = decode_block_header(raw, 4096, "blocks.dat")
    assert count == 9 and block.to_dict() == _block().to_dict()


def test_large_header_spans_several_pages():
    raw = encode_block_header(_block(names=200), block_count=1)
    assert len(raw) % 4096 == 0 and len(raw) > 4096
    assert decode_block_header(raw, 0, "f")[0].tensors[199].name == "model.layers.0.t199.weight"


@pytest.mark.parametrize("offset", [0, 20, 44, 60])
def test_any_flipped_header_byte_is_detected(offset):
    raw = bytearray(encode_block_header(_block(), block_count=1))
    raw[offset] ^= 0x01
    with pytest.raises(BadHeader):
        decode_block_header(bytes(raw), 0, "f")


def test_metadata_bytes_round_trip():
    blocks = [_block()]
    raw = encode_metadata(blocks, {"architecture": "LlamaForCausalLM"})
    magic, ver, flags, count, blen, bcrc, hcrc = struct.unpack_from("<8sHHIQII", raw)
    assert (magic, ver, flags, count, blen) == (b"DSFLMETA", 1, 0, 1, len(raw) - 32)
    assert bcrc == crc32c(raw[32:]) and hcrc == crc32c(raw[:28])
    doc = msgpack.unpackb(raw[32:])
    assert doc["format_version"] == 1 and doc["data_files"] == ["blocks.dat"]
    assert set(doc["blocks"][0]) == {"id", "role", "layer", "file", "offset", "length", "crc32c",
                                     "header_offset", "header_size", "tensors", "deps", "access_freq",
                                     "precision_req", "quant"}
    got, model = decode_metadata(raw, "m")
    assert model == {"architecture": "LlamaForCausalLM"} and got[0].to_dict() == blocks[0].to_dict()
    with pytest.raises(errors.MetadataError, match="header counts"):
        fixed = bytearray(raw[:32])
        struct.pack_into("<I", fixed, 12, 2)
        struct.pack_into("<I", fixed, 28, crc32c(bytes(fixed[:28])))
        decode_metadata(bytes(fixed) + raw[32:], "m")


def test_crc32c_is_castagnoli():
    assert crc32c(b"123456789") == 0xE3069283
