"""verify_store: every bad payload and header is named; a clean store passes; streaming reader."""
from __future__ import annotations

import os

from deepseek_flash.store import Store
from deepseek_flash.store.format import DATA_FILE
from deepseek_flash.store.verify import read_sequential, verify_store


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_clean_store_verifies(llama_store):
    store = Store.open(llama_store)
    seen = []
    report = verify_store(store, seen.append)
    assert report.ok and report.blocks == len(store.blocks)
    assert report.bytes == sum(seen) == (llama_store / DATA_FILE).stat().st_size


def test_every_bad_block_is_named(llama_store):
    store = Store.open(llama_store)
    data = llama_store / DATA_FILE
    _flip(data, store.blocks[2].offset + 5)                 # payload
    _flip(data, store.blocks[6].offset + store.blocks[6].length - 1)
    _flip(data, store.blocks[4].header_offset + 50)         # header body
    report = verify_store(store)
    assert not report.ok
    by_block = {}
    for bid, reason in report.bad:
        by_block.setdefault(bid, []).append(reason)
    assert sorted(by_block) == [2, 4, 6]
    assert "payload crc32c" in by_block[2][0] and str(data) in by_block[2][0]
    assert any("inline header" in r for r in by_block[4])


def test_truncated_data_file(llama_store):
    store = Store.open(llama_store)
    data = llama_store / DATA_FILE
    os.truncate(data, store.blocks[-2].offset + 4096)
    report = verify_store(store)
    bad = {bid for bid, _ in report.bad}
    assert store.blocks[-1].id in bad and any("truncated" in r for _, r in report.bad)


def test_read_sequential_covers_unaligned_ranges(tmp_path):
    f = tmp_path / "f"
    payload = os.urandom(3 * 4096 + 123)
    f.write_bytes(payload)
    for start, end, chunk in [(0, None, 4096), (100, 9000, 8192), (4096, 4097, 4096), (5000, 5000, 4096)]:
        got = bytearray()
        expect_pos = start
        for pos, mv in read_sequential(f, start, end, chunk=chunk):
            assert pos == expect_pos
            got += mv
            expect_pos += len(mv)
        assert bytes(got) == payload[start:end]
