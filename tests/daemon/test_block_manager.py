"""BlockManager on the real HostArena and IOEngine: bytes, leases, eviction, budgets, failures."""
import os
import shutil
import threading

import pytest
from deepseek_flash.daemon.block_manager import BlockManager
from deepseek_flash.daemon.host_state import ABSENT, RESIDENT
from deepseek_flash.daemon.config import FlashConfig

from deepseek_flash._core import HostArena, IOEngine
from deepseek_flash.errors import (
    BlockChecksumError,
    BudgetTooSmall,
    LeaseError,
    LimitExceeded,
    NotResident,
    OutOfMemory,
    StoreInUse,
    UnknownBlock,
    UnknownClient,
    UnknownModel,
)
from deepseek_flash.store import Store

LAYER = 151552   # one tiny layer, 4 KiB aligned: 4 + 48 + 64 + 32 KiB


@pytest.fixture
def make(tiny_store):
    made = []

    def factory(arena_size=8 << 20, **cfg):
        cfg.setdefault("prefetch_window", 0)
        cfg.setdefault("eviction_threshold", 1.0)
        cfg.setdefault("store_roots", [str(tiny_store.parent)])
        m = BlockManager(FlashConfig.from_dict(cfg), HostArena(arena_size), IOEngine())
        made.append(m)
        return m
    yield factory
    for m in made:
        m.close()


def payload(manager, offset, block):
    return bytes(manager.arena.view(offset, block.length))


def test_bytes_served_equal_the_store(make, tiny_store):
    m = make()
    store = Store.open(tiny_store)
    info = m.open_model(0, "tiny")
    assert info.name == "tiny" and info.num_layers == 4 and len(info.blocks) == len(store.blocks)
    lease = m.acquire(0, "tiny", blocks=[b.id for b in store.blocks])
    assert set(lease.blocks) == {b.id for b in store.blocks}
    for bid, offset in lease.blocks.items():
        assert offset % 4096 == 0
        assert payload(m, offset, store.block(bid)) == store.read_block(bid)
    s = m.stats()
    assert s["misses"] == len(store.blocks) and s["bytes_read_nvme"] == store.total_bytes
    assert s["active_leases"] == 1


def test_layer_acquire_and_prefetch_window(make, tiny_store):
    m = make(prefetch_window=2)
    m.open_model(0, "tiny")
    lease = m.acquire(0, "tiny", layer=1)
    layers = {b.id: b.layer for b in Store.open(tiny_store).blocks}
    assert sorted(layers[b] for b in lease.blocks) == [1, 1, 1, 1]
    res = m.residency("tiny")
    # Layers 2 and 3 were read ahead; layer 0 was not.
    assert all(res[b] != ABSENT for b, layer in layers.items() if layer in (2, 3))
    assert all(res[b] == ABSENT for b, layer in layers.items() if layer == 0)
    m.acquire(0, "tiny", layer=2)
    s = m.stats()
    assert s["prefetch_used"] == 4 and s["hits"] == 4 and s["misses"] == 4
    assert s["prefetch_hit_rate"] == 0.5


def test_acquiring_a_block_loads_its_dependencies(make, tiny_store):
    m = make()
    m.open_model(0, "tiny")
    store = Store.open(tiny_store)
    attn = next(b for b in store.blocks if b.role == "attn" and b.layer == 0)
    lease = m.acquire(0, "tiny", blocks=[attn.id])
    assert list(lease.blocks) == [attn.id]
    res = m.residency("tiny")
    assert attn.deps and all(res[d] == RESIDENT for d in attn.deps)


def _layer_state(m, store, layer):
    res = m.residency("tiny")
    return {res[b.id] for b in store.blocks if b.layer == layer and not b.hot}


@pytest.mark.parametrize("policy, victim", [("lru", 1), ("access_frequency_weighted", 0)])
def test_eviction_policies_pick_their_victim(make, tiny_store, tmp_path, policy, victim):
    # A store of its own: the shared one's access_freq grows as other tests' daemons save their
    # counts, and the weighted policy must start from no history here.
    from flashd_harness import packed_model

    fresh = packed_model(tmp_path, "tiny", num_layers=4)
    m = make(arena_size=3 * LAYER + 4 * 4096, block_eviction_policy=policy, store_roots=[str(fresh.parent)])
    store = Store.open(fresh)
    m.open_model(0, "tiny")
    # Layer 1 used three times, then 2 twice, then 0 once: LRU's oldest is 1, the least used is 0.
    for layer in (1, 1, 1, 2, 2, 0):
        m.release(0, m.acquire(0, "tiny", layer=layer).id)
    m.acquire(0, "tiny", layer=3)
    assert _layer_state(m, store, victim) == {ABSENT}
    for keep in {0, 1, 2} - {victim}:
        assert _layer_state(m, store, keep) == {RESIDENT}
    assert m.stats()["block_eviction_count"] >= 3


def test_leased_blocks_are_never_evicted(make, tiny_store):
    m = make(arena_size=3 * LAYER + 4 * 4096)
    m.open_model(0, "tiny")
    leases = [m.acquire(0, "tiny", layer=i) for i in range(3)]
    with pytest.raises(OutOfMemory) as info:
        m.acquire(0, "tiny", layer=3)
    assert "leased" in str(info.value) and info.value.budget == 3 * LAYER + 4 * 4096
    for lease in leases:
        for bid in lease.blocks:
            assert m.residency("tiny")[bid] == RESIDENT
    # Releasing one layer makes room.
    m.release(0, leases[0].id)
    m.acquire(0, "tiny", layer=3)
    assert m.stats()["active_leases"] == 3


def test_hot_blocks_go_only_when_nothing_else_can(make, tiny_store):
    store = Store.open(tiny_store)
    embed = next(b for b in store.blocks if b.role == "embed")
    m = make(arena_size=3 * LAYER + 65536 + 4 * 4096)
    m.open_model(0, "tiny")
    m.release(0, m.acquire(0, "tiny", blocks=[embed.id]).id)      # oldest, but hot
    for layer in (0, 1, 2):
        m.release(0, m.acquire(0, "tiny", layer=layer).id)
    m.acquire(0, "tiny", layer=3)
    res = m.residency("tiny")
    assert res[embed.id] == RESIDENT and _layer_state(m, store, 0) == {ABSENT}
    # Everything non-hot leased: now the embeddings must make room.
    for layer in (1, 2):
        m.acquire(0, "tiny", layer=layer)
    head = next(b for b in store.blocks if b.role == "lm_head")
    m.acquire(0, "tiny", blocks=[head.id])
    assert m.residency("tiny")[embed.id] == ABSENT


def test_eviction_threshold(make, tiny_store):
    m = make(arena_size=4 * LAYER, eviction_threshold=0.5)
    store = Store.open(tiny_store)
    m.open_model(0, "tiny")
    for layer in (0, 1, 2):
        m.release(0, m.acquire(0, "tiny", layer=layer).id)
    assert m.arena.used <= 0.5 * m.arena.size + 3 * 4096     # hot norms may stay above
    assert _layer_state(m, store, 0) == {ABSENT}
    assert _layer_state(m, store, 2) == {RESIDENT}
    # Lowering the threshold at run time evicts at once.
    m.set_tunable("eviction_threshold", 0.0)
    assert _layer_state(m, store, 2) == {ABSENT}


def test_budget_smaller_than_a_layer(make, big_store):
    m = make(arena_size=1 << 20, store_roots=[str(big_store.parent)])
    with pytest.raises(BudgetTooSmall) as info:
        m.open_model(0, "big")
    err = info.value
    assert err.code == 402 and err.budget == 1 << 20 and err.needed > 1 << 20
    assert "1.0 MiB" in str(err) and "layer" in str(err)


def test_checksum_failure_names_the_block(make, tiny_store, tmp_path):
    bad = tmp_path / "stores" / "bad"
    shutil.copytree(tiny_store, bad)
    store = Store.open(bad)
    victim = next(b for b in store.blocks if b.role == "attn" and b.layer == 2)
    with open(bad / victim.file, "r+b") as f:
        f.seek(victim.offset + 100)
        byte = f.read(1)
        f.seek(victim.offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    m = make(store_roots=[str(bad.parent)])
    m.open_model(0, "bad")
    ok = m.acquire(0, "bad", layer=0)                            # other blocks serve fine
    with pytest.raises(BlockChecksumError) as info:
        m.acquire(0, "bad", blocks=[victim.id])
    assert info.value.block_id == victim.id and f"block {victim.id}" in str(info.value)
    # strict: the model stays failed until reopened
    with pytest.raises(BlockChecksumError):
        m.acquire(0, "bad", layer=0)
    assert m.stats()["checksum_errors"] == 1 and m.stats()["active_leases"] == 1
    assert m.list_models()[0]["state"] == "failed" and m.snapshot()["status"]["controller_state"] == "DEGRADED"
    m.release(0, ok.id)
    m.unload("bad")                                              # unloading clears the failure
    m.open_model(0, "bad")
    assert len(m.acquire(0, "bad", layer=0).blocks) == 4


def test_graceful_mode_retries_and_keeps_serving(make, tiny_store, tmp_path):
    bad = tmp_path / "stores" / "bad"
    shutil.copytree(tiny_store, bad)
    store = Store.open(bad)
    victim = next(b for b in store.blocks if b.role == "mlp_down" and b.layer == 1)
    with open(bad / victim.file, "r+b") as f:
        f.seek(victim.offset)
        f.write(b"\0" * 64)
    m = make(store_roots=[str(bad.parent)], error_recovery_mode="graceful")
    m.open_model(0, "bad")
    with pytest.raises(BlockChecksumError):
        m.acquire(0, "bad", blocks=[victim.id])
    assert m.stats()["checksum_errors"] == 2                     # read, then one retry
    lease = m.acquire(0, "bad", layer=3)
    assert len(lease.blocks) == 4


def test_leases_are_per_client_and_released_on_disconnect(make):
    m = make(arena_size=3 * LAYER + 4 * 4096)
    m.open_model(0, "tiny")
    a, b = m.connect({"name": "a"}), m.connect({"name": "b"})
    la = m.acquire(a, "tiny", layer=0)
    lb = m.acquire(b, "tiny", layer=0)            # same blocks, refcount 2
    assert la.blocks == lb.blocks
    with pytest.raises(LeaseError):
        m.release(b, la.id)
    m.release(a, la.id)
    with pytest.raises(LeaseError):
        m.release(a, la.id)
    m.acquire(b, "tiny", layer=1)
    assert m.stats()["active_leases"] == 2
    assert m.disconnect(b) == 2
    assert m.stats()["active_leases"] == 0 and m.stats()["connected_clients"] == 1
    with pytest.raises(UnknownClient):
        m.acquire(b, "tiny", layer=0)
    # The disconnected client's memory is reusable: three other layers fit now.
    for layer in (1, 2, 3):
        m.acquire(a, "tiny", layer=layer)


def test_unknown_model_block_layer_and_names(make, tiny_store, tmp_path):
    m = make()
    with pytest.raises(UnknownModel):
        m.open_model(0, "nope")
    for bad in ("../tiny", "tiny/../../etc", "./tiny", "a b"):
        with pytest.raises(UnknownModel):
            m.open_model(0, bad)
    # A symlink under the root that points outside it is not a name either.
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(tiny_store, root / "escape")
    m2 = make(store_roots=[str(root)])
    with pytest.raises(UnknownModel):
        m2.open_model(0, "escape")
    m.open_model(0, str(tiny_store))              # an absolute path is a path
    with pytest.raises(UnknownBlock) as info:
        m.acquire(0, "tiny", blocks=[999])
    assert info.value.block_id == 999
    with pytest.raises(UnknownBlock):
        m.acquire(0, "tiny", layer=4)
    with pytest.raises(UnknownModel):
        m.acquire(0, "other", layer=0)


def test_registered_names(make, tiny_store):
    m = make(store_roots=[], models={"my-model": str(tiny_store)})
    assert m.open_model(0, "my-model").path == str(tiny_store.resolve())


def test_wait_false_and_limits(make):
    m = make(max_leases_per_client=2)
    m.open_model(0, "tiny")
    with pytest.raises(NotResident):
        m.acquire(0, "tiny", layer=0, wait=False)
    # the read was started: it completes without anyone waiting
    import time
    deadline = time.monotonic() + 5
    while m.stats()["loading_blocks"] and time.monotonic() < deadline:
        time.sleep(0.01)
    m.acquire(0, "tiny", layer=0, wait=False)
    m.acquire(0, "tiny", layer=1)
    with pytest.raises(LimitExceeded):
        m.acquire(0, "tiny", layer=2)


def test_unload_refused_while_leased(make):
    m = make()
    m.open_model(0, "tiny")
    lease = m.acquire(0, "tiny", layer=0)
    with pytest.raises(StoreInUse):
        m.unload("tiny")
    m.release(0, lease.id)
    result = m.unload("tiny")
    assert result["freed_bytes"] == LAYER
    assert m.arena.used == 0 and m.list_models() == []


def test_plan_pins_blocks(make, tiny_store):
    m = make(arena_size=3 * LAYER + 4 * 4096)
    store = Store.open(tiny_store)
    m.open_model(0, "tiny")
    pinned = [b.id for b in store.blocks if b.layer == 0]
    m.set_plan("tiny", {"pin": pinned, "gpu": "later"})
    assert m.open_model(0, "tiny").plan == {"pin": pinned, "gpu": "later"}
    for layer in (0, 1, 2):
        m.release(0, m.acquire(0, "tiny", layer=layer).id)
    m.acquire(0, "tiny", layer=3)
    assert _layer_state(m, store, 0) == {RESIDENT}
    with pytest.raises(UnknownBlock):
        m.set_plan("tiny", {"pin": [1000]})


def test_concurrent_acquires_share_one_read(make):
    m = make()
    m.open_model(0, "tiny")
    clients = [m.connect() for _ in range(8)]
    results, errors = [], []

    def worker(cid):
        try:
            for layer in range(4):
                lease = m.acquire(cid, "tiny", layer=layer)
                results.append(lease.blocks)
                m.release(cid, lease.id)
        except Exception as exc:  # noqa: BLE001 -- surfaced by the assertion below
            errors.append(exc)
    threads = [threading.Thread(target=worker, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    s = m.stats()
    assert s["misses"] + s["hits"] == 8 * 16 and s["bytes_read_nvme"] == 4 * LAYER - 4 * (4096 - 512)
    assert s["active_leases"] == 0


def test_disconnect_hooks_run_after_leases_are_released(make):
    m = make()
    m.open_model(0, "tiny")
    seen = []
    m.on_disconnect(lambda cid: seen.append((cid, m.stats()["active_leases"])))
    m.on_disconnect(lambda cid: 1 / 0)             # a failing hook does not stop the others
    m.on_disconnect(lambda cid: seen.append("after"))
    cid = m.connect()
    m.acquire(cid, "tiny", layer=0)
    m.disconnect(cid)
    assert seen == [(cid, 0), "after"]


@pytest.mark.parametrize("policy", ["lru", "access_frequency_weighted"])
def test_streaming_a_model_larger_than_the_budget(make, wide_store, policy):
    store = Store.open(wide_store)
    # The model is ~4.3 MiB; acquiring the next layer before releasing the last needs two layers
    # (~1.9 MiB) plus room for fragmentation and the prefetch window.
    budget = 3 << 20
    assert store.total_bytes > budget
    m = make(arena_size=budget, store_roots=[str(wide_store.parent)], prefetch_window=1,
             block_eviction_policy=policy)
    m.open_model(0, "wide")
    expected = {b.id: store.read_block(b.id) for b in store.blocks}
    for _ in range(3):                              # three forward passes
        held = None
        for layer in range(store.num_layers):
            lease = m.acquire(0, "wide", layer=layer)
            for bid, offset in lease.blocks.items():
                assert payload(m, offset, store.block(bid)) == expected[bid]
            if held is not None:
                m.release(0, held.id)
            held = lease
        m.release(0, held.id)
        assert m.arena.used <= budget
    s = m.stats()
    assert s["active_leases"] == 0 and s["evictions"] > 0 and s["prefetch_issued"] > 0
    assert s["prefetch_used"] > 0


def test_prefetch_without_room_is_retried_on_release(make, tiny_store):
    store = Store.open(tiny_store)
    m = make(arena_size=3 * LAYER + 4 * 4096, prefetch_window=1)
    m.open_model(0, "tiny")
    leases = [m.acquire(0, "tiny", layer=layer) for layer in range(3)]   # the arena is full
    assert _layer_state(m, store, 3) == {ABSENT}
    assert m.stats()["prefetch_dropped"] >= 3
    m.release(0, leases[0].id)                       # room again: layer 3 is read ahead now
    assert _layer_state(m, store, 3) != {ABSENT}
    m.acquire(0, "tiny", layer=3)
    assert m.stats()["prefetch_used"] >= 4 + 3


def test_access_counts_reach_the_store_and_order_defrag(tmp_path):
    """Uses counted by the manager are folded into access_freq (at unload and on demand, once),
    and defrag then puts the most used blocks first."""
    from deepseek_flash.daemon.block_manager import BlockManager
    from deepseek_flash.daemon.config import FlashConfig

    from deepseek_flash import _core
    from deepseek_flash.store import Store, pack
    from deepseek_flash.store.maintenance import lock_store
    from deepseek_flash.testing import make_tiny_model
    from deepseek_flash.tools.defrag import defrag

    store = pack(make_tiny_model(tmp_path / "src", "llama", num_layers=2), tmp_path / "store")
    arena, engine = _core.HostArena(16 << 20), _core.IOEngine()
    manager = BlockManager(FlashConfig({"host_cache_bytes": 16 << 20}), arena, engine)
    try:
        cid = manager.connect({"name": "t"})
        name = manager.open_model(cid, str(store)).name
        hot = Store.open(store).blocks[-1].id
        for _ in range(5):
            manager.release(cid, manager.acquire(cid, name, blocks=[hot]).id)
        manager.release(cid, manager.acquire(cid, name, layer=1).id)
        # Held under maintenance: nothing written, nothing lost.
        fd = lock_store(store)
        assert manager.save_access_counts(name) == 0
        os.close(fd)
        assert Store.open(store).block(hot).access_freq == 0
        assert manager.save_access_counts(name) >= 1
        assert manager.save_access_counts(name) == 0          # already folded in
        freq = {b.id: b.access_freq for b in Store.open(store).blocks}
        assert freq[hot] == 5
        assert all(freq[b.id] == 1 for b in Store.open(store).blocks if b.layer == 1 and b.id != hot)
        manager.disconnect(cid)
        manager.unload(name)
    finally:
        manager.close()
        engine.close()
    report = defrag(store)
    assert report.order_ids[0] == hot
    assert min(Store.open(store).blocks, key=lambda b: b.offset).id == hot
