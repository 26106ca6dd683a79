"""inspect: the table and the JSON description."""
from __future__ import annotations

from deepseek_flash.store import Store
from deepseek_flash.store.inspect import describe, format_table, human


def test_describe_and_table(store_dir):
    store = Store.open(store_dir)
    d = describe(store)
    assert d["block_count"] == len(store.blocks) == len(d["blocks"])
    assert d["total_bytes"] == store.total_bytes == sum(d["per_layer_bytes"].values())
    assert set(d["per_layer_bytes"]) == {"-1", "0", "1"}
    b2 = d["blocks"][2]
    assert b2["role"] == "attn" and b2["dtypes"] == ["bfloat16"]
    assert b2["shape"] == "32x32;32;16x32;16;16x32;16;32x32"
    table = format_table(store)
    lines = table.splitlines()
    assert lines[0].split() == ["id", "layer", "role", "dtype", "shapes", "size", "offset"]
    assert lines[1].split()[:4] == ["0", "-", "embed", "bfloat16"]
    assert "layer 1:" in table and "total: 10 blocks, 2 layers" in table


def test_human():
    assert human(10) == "10 B" and human(4096) == "4.00 KiB" and human(3 << 30) == "3.00 GiB"
