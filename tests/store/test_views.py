"""block_tensors: zero-copy views of every name and alias over tensors and buffers."""
from __future__ import annotations

import pytest
import torch
from conftest import reference_tensors

from deepseek_flash.store import Store
from deepseek_flash.store.views import block_tensors


def test_views_are_zero_copy_over_a_uint8_tensor(store_dir, model_factory):
    store = Store.open(store_dir)
    ref = reference_tensors(model_factory("qwen2", "bfloat16", False))
    for block in store.blocks:
        payload = torch.frombuffer(bytearray(store.read_block(block.id)), dtype=torch.uint8)
        views = block_tensors(block, payload)
        assert set(views) == set(block.names)
        base = payload.data_ptr()
        for t in block.tensors:
            v = views[t.name]
            assert v.data_ptr() == base + t.offset            # a view, not a copy
            assert v.untyped_storage().data_ptr() == base
            assert torch.equal(v, ref[t.name])
            for alias in t.aliases:
                assert views[alias] is v
    embed = store.blocks[0]
    payload = torch.zeros(embed.length, dtype=torch.uint8)
    views = block_tensors(embed, payload)
    payload[embed.tensors[0].offset:embed.tensors[0].offset + 2] = torch.tensor([0x80, 0x3F], dtype=torch.uint8)
    assert views["lm_head.weight"].flatten()[0].item() == 1.0   # bf16 0x3F80 == 1.0, seen through the view


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview"])
def test_views_over_buffers(kind, store_dir):
    store = Store.open(store_dir)
    block = store.blocks[2]
    data = store.read_block(block.id)
    buf = {"bytes": data, "bytearray": bytearray(data), "memoryview": memoryview(bytearray(data))}[kind]
    views = block_tensors(block, buf)
    for t in block.tensors:
        assert torch.equal(views[t.name], store.tensor(t.name))


def test_view_spec_is_cached_and_larger_payloads_accepted(store_dir):
    store = Store.open(store_dir)
    block = store.blocks[3]
    data = bytearray(store.read_block(block.id)) + bytearray(4096)   # an arena slot rounded up
    block_tensors(block, data)
    spec = block._view_spec
    block_tensors(block, data)
    assert block._view_spec is spec


def test_bad_payloads_rejected(store_dir):
    store = Store.open(store_dir)
    block = store.blocks[3]
    with pytest.raises(ValueError, match="holds 10 bytes"):
        block_tensors(block, bytearray(10))
    with pytest.raises(ValueError, match="1-D uint8"):
        block_tensors(block, torch.zeros(block.length, dtype=torch.float32))
