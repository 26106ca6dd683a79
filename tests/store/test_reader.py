"""Store.open / read_block / find: metadata failures and checksum failures are typed and named."""
from __future__ import annotations

import struct

import pytest

from deepseek_flash import errors
from deepseek_flash.store import Store
from deepseek_flash.store.format import DATA_FILE, METADATA_FILE


def _raises(cls, code, fn, *match):
    with pytest.raises(cls) as info:
        fn()
    assert type(info.value) is cls and info.value.code == code
    for m in match:
        assert m in str(info.value), (m, str(info.value))
    return info.value


def test_open_and_lookup(store_dir):
    store = Store.open(store_dir)
    assert store.name == "qwen2.flash" and store.path == store_dir
    assert store.block(3) is store.blocks[3]
    block, tensor = store.find("model.layers.1.mlp.down_proj.weight")
    assert block.role == "mlp_down" and block.layer == 1 and tensor.shape == (32, 64)
    assert store.data_path(block) == store_dir / DATA_FILE
    assert len(store.read_block(block.id)) == block.length
    _raises(errors.UnknownBlock, 401, lambda: store.block(99), "no block 99")
    _raises(errors.UnknownBlock, 401, lambda: store.find("nope.weight"), "nope.weight")


def test_not_a_store(tmp_path):
    _raises(errors.NotAStore, 108, lambda: Store.open(tmp_path), str(tmp_path), "not a deepseek-flash store")
    _raises(errors.NotAStore, 108, lambda: Store.open(tmp_path / "missing"))


@pytest.mark.parametrize("damage,expect", [
    ("missing", "missing"),
    ("truncated_header", "truncated"),
    ("truncated_body", "truncated"),
    ("magic", "wrong magic"),
    ("newer", "newer"),
    ("body_crc", "body crc32c"),
    ("empty", "truncated"),
])
def test_metadata_damage(damage, expect, store_dir):
    meta = store_dir / METADATA_FILE
    data = meta.read_bytes()
    if damage == "missing":
        meta.unlink()
    elif damage == "truncated_header":
        meta.write_bytes(data[:20])
    elif damage == "truncated_body":
        meta.write_bytes(data[:-10])
    elif damage == "magic":
        meta.write_bytes(b"NOTMETA!" + data[8:])
    elif damage == "newer":
        from deepseek_flash.store.format import crc32c
        fixed = bytearray(data[:32])
        struct.pack_into("<H", fixed, 8, 99)
        struct.pack_into("<I", fixed, 28, crc32c(bytes(fixed[:28])))
        meta.write_bytes(bytes(fixed) + data[32:])
    elif damage == "body_crc":
        meta.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    else:
        meta.write_bytes(b"")
    err = _raises(errors.MetadataError, 106, lambda: Store.open(store_dir), str(meta), expect)
    assert err.path == str(meta)
    if damage != "newer":
        assert "deepseek-flash-repair" in str(err)


def test_block_checksum_error_names_block_and_file(store_dir):
    store = Store.open(store_dir)
    block = store.blocks[2]
    with open(store_dir / DATA_FILE, "r+b") as f:
        f.seek(block.offset + 7)
        byte = f.read(1)
        f.seek(block.offset + 7)
        f.write(bytes([byte[0] ^ 1]))
    err = _raises(errors.BlockChecksumError, 107, lambda: store.read_block(2), "block 2",
                  str(store_dir / DATA_FILE))
    assert err.block_id == 2 and err.expected == block.crc32c and err.actual != block.crc32c
    assert err.path == str(store_dir / DATA_FILE)
    assert len(store.read_block(2, verify=False)) == block.length
    assert store.read_block(1) is not None   # other blocks unaffected


def test_truncated_data_file_is_a_store_error(store_dir):
    # The file ends inside the last block: the store is corrupt (112), not an IO failure with errno 0.
    store = Store.open(store_dir)
    data = store_dir / DATA_FILE
    last = store.blocks[-1]
    data.write_bytes(data.read_bytes()[:last.offset + 10])
    err = _raises(errors.StoreTruncated, 112, lambda: store.read_block(last.id), "truncated")
    assert "10 of" in str(err) and str(data) in str(err)
    assert (err.block_id, err.path, err.offset, err.length) == (last.id, str(data), last.offset, last.length)
    assert store.read_block(store.blocks[0].id) is not None   # blocks before the end still read
