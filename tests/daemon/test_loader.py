"""Device loads: gates open in forward order with offsets written; the GPU copy serves recovery."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from deepseek_flash.daemon.block_manager import BlockManager
from deepseek_flash.daemon.config import FlashConfig
from deepseek_flash.daemon.fabric import GATE_READY
from deepseek_flash.daemon.loader import Attachments, Loader, control_views
from deepseek_flash.daemon.prefetch import ForwardOrder

from deepseek_flash import _core
from deepseek_flash.store import Store


@pytest.fixture
def controller(tiny_store):
    arena = _core.HostArena(16 << 20)
    engine = _core.IOEngine()
    manager = BlockManager(FlashConfig({"host_cache_bytes": 16 << 20}), arena, engine)
    yield manager, arena
    manager.close()
    engine.close()


def test_cpu_load_opens_every_gate_with_the_host_offsets(controller, tiny_store):
    manager, arena = controller
    cid = manager.connect({"name": "t"})
    info = manager.open_model(cid, str(tiny_store))
    loader = Loader(manager, arena)
    load = loader.attach(cid, info, "cpu", [b.id for b in info.blocks])
    load.finished.result(timeout=30)
    gates, offsets = control_views(arena, load.control_offset, load.num_gates, len(info.blocks))
    assert (gates == GATE_READY).all() and load.num_gates == info.num_layers + 2
    store = Store.open(tiny_store)
    for i, block in enumerate(info.blocks):
        got = bytes(arena.view(int(offsets[i]), block.length))
        assert got == store.read_block(block.id)
    assert manager.stats()["active_leases"] == load.num_gates
    loader.detach(cid)
    assert manager.stats()["active_leases"] == 0


def test_gpu_copy_serves_as_a_recovery_source(controller, tiny_store):
    manager, arena = controller
    cid = manager.connect({"name": "t"})
    info = manager.open_model(cid, str(tiny_store))
    store = Store.open(tiny_store)
    block = info.blocks[3]
    device = torch.zeros(1 << 20, dtype=torch.uint8)      # stands in for the GPU arena
    device[4096:4096 + block.length] = torch.from_numpy(
        np.frombuffer(store.read_block(block.id), dtype=np.uint8).copy())
    order = ForwardOrder(info.blocks, info.num_layers)
    gate = next(g for g, ids in enumerate(order.stages) if block.id in ids)
    gates = np.zeros(len(order.stages), dtype=np.uint32)
    placement = SimpleNamespace(offsets={block.id: 4096}, arena=SimpleNamespace(tensor=device),
                                events=[SimpleNamespace(synchronize=lambda: None)] * len(gates))
    load = SimpleNamespace(placement=placement, info=info, order=order, gates=gates)
    loader = Loader(manager, arena)
    loader._loads[("m", 0, 1)] = load
    attachments = Attachments(manager, loader)
    dest = bytearray(block.length)
    assert attachments.copy_source(info.name, block, memoryview(dest)) is False   # gate closed
    gates[gate] = GATE_READY
    assert attachments.copy_source(info.name, block, memoryview(dest)) is True
    assert bytes(dest) == store.read_block(block.id)
    assert attachments.copy_source(info.name, info.blocks[4], memoryview(bytearray(10))) is False


def test_device_tier_registers_its_hooks(controller):
    from deepseek_flash.daemon.loader import build_device_tier

    manager, arena = controller
    attachments = build_device_tier(manager, arena, manager.config)
    assert attachments.copy_source in manager._copy_sources
    assert attachments.detach in manager._disconnect_hooks
    attachments.close()
