"""error_recovery_mode on real reads: strict and graceful, checksum and IO failures, quarantine,
copies from another tier, and never a wrong byte served -- in-process and over the daemon."""
import errno
import os
import time

import pytest
from deepseek_flash.daemon.block_manager import BlockManager
from deepseek_flash.daemon.config import FlashConfig
from faults import FaultyEngine, block_of, copy_store, corrupt_block
from flashd_harness import assert_eventually

from deepseek_flash._core import HostArena, IOEngine
from deepseek_flash.errors import BlockChecksumError, DeviceError, FlashIOError
from deepseek_flash.store import Store


@pytest.fixture
def make():
    made = []

    def factory(root, mode, arena_size=8 << 20, copy_sources=(), engine=None):
        cfg = FlashConfig.from_dict({"prefetch_window": 0, "eviction_threshold": 1.0,
                                     "store_roots": [str(root)], "error_recovery_mode": mode})
        m = BlockManager(cfg, HostArena(arena_size), engine or IOEngine())
        for source in copy_sources:
            m.add_copy_source(source)
        made.append(m)
        return m
    yield factory
    for m in made:
        m.close()


def served(m, lease, store):
    return {bid: bytes(m.arena.view(off, store.block(bid).length)) for bid, off in lease.blocks.items()}


def test_strict_checksum_fails_the_model_and_quarantines(make, tiny_store, tmp_path):
    path = copy_store(tiny_store, tmp_path, "bad")
    victim = block_of(path, "attn", 2)
    corrupt_block(path, victim.id)
    m = make(path.parent, "strict")
    m.open_model(0, "bad")
    with pytest.raises(BlockChecksumError) as info:
        m.acquire(0, "bad", blocks=[victim.id])
    assert info.value.code == 107 and info.value.block_id == victim.id
    assert f"block {victim.id}" in str(info.value)
    with pytest.raises(BlockChecksumError):          # strict: the whole model fails
        m.acquire(0, "bad", layer=0)
    stats = m.stats()
    assert stats["checksum_errors"] == 1 and stats["quarantined_blocks"] == 1
    snap = m.snapshot()
    assert snap["models"]["bad"]["quarantined_blocks"] == [victim.id]
    assert snap["status"]["controller_state"] == "DEGRADED"
    assert f"quarantined block(s) [{victim.id}]" in snap["status"]["degraded_reason"]


def test_graceful_checksum_rereads_once_then_fails_typed_and_keeps_serving(make, tiny_store, tmp_path):
    path = copy_store(tiny_store, tmp_path, "bad")
    store = Store.open(path)
    victim = block_of(path, "mlp_down", 1)
    bad_payload = corrupt_block(path, victim.id)
    m = make(path.parent, "graceful")
    m.open_model(0, "bad")
    with pytest.raises(BlockChecksumError) as info:
        m.acquire(0, "bad", blocks=[victim.id])
    assert info.value.block_id == victim.id
    assert m.stats()["checksum_errors"] == 2            # the read and one re-read
    read_before = m.stats()["bytes_read_nvme"]
    # Quarantined: the next acquire fails at once, without touching the disk.
    with pytest.raises(BlockChecksumError, match="quarantined"):
        m.acquire(0, "bad", layer=1)
    assert m.stats()["checksum_errors"] == 2 and m.stats()["bytes_read_nvme"] == read_before
    # Everything else serves, byte-exact.
    lease = m.acquire(0, "bad", layer=3)
    assert served(m, lease, store) == {b: store.read_block(b) for b in lease.blocks}
    assert m.stats()["quarantined_blocks"] == 1 and m.stats()["failed_requests"] == 2
    assert m.snapshot()["status"]["controller_state"] == "DEGRADED"
    # The bad bytes that landed were wiped: no client can read them from the shared arena.
    assert bytes(m.arena.view(0, m.arena.size)).find(bad_payload[:4096]) == -1
    # Unloading forgets the quarantine (a repaired store is read afresh).
    m.release(0, lease.id)
    m.unload("bad")
    assert m.stats()["quarantined_blocks"] == 0
    assert m.snapshot()["status"]["controller_state"] == "ACTIVE"


def test_graceful_serves_another_tiers_good_copy(make, tiny_store, tmp_path):
    path = copy_store(tiny_store, tmp_path, "bad")
    pristine = Store.open(tiny_store)
    victim = block_of(path, "attn", 1)
    corrupt_block(path, victim.id)
    asked = []

    def device_copy(model, info, dest):         # stands in for the GPU tier's copy of the block
        asked.append((model, info.id))
        dest[:] = pristine.read_block(info.id)
        return True

    m = make(path.parent, "graceful", copy_sources=[device_copy])
    m.open_model(0, "bad")
    lease = m.acquire(0, "bad", layer=1)
    assert served(m, lease, pristine) == {b: pristine.read_block(b) for b in lease.blocks}
    assert asked == [("bad", victim.id)]
    stats = m.stats()
    assert stats["recovered_blocks"] == 1 and stats["quarantined_blocks"] == 1
    assert stats["checksum_errors"] == 2
    # Evicted and asked again: still never from the disk, again from the copy.
    m.release(0, lease.id)
    m.unload("bad")


def test_a_bad_copy_is_never_served(make, tiny_store, tmp_path):
    path = copy_store(tiny_store, tmp_path, "bad")
    victim = block_of(path, "attn", 1)
    corrupt_block(path, victim.id)

    def wrong_copy(model, info, dest):
        dest[:] = b"\x5a" * len(dest)
        return True

    m = make(path.parent, "graceful", copy_sources=[wrong_copy])
    m.open_model(0, "bad")
    with pytest.raises(BlockChecksumError):
        m.acquire(0, "bad", blocks=[victim.id])
    assert m.stats()["recovered_blocks"] == 0
    assert bytes(m.arena.view(0, m.arena.size)).find(b"\x5a" * 4096) == -1


def test_strict_io_error_names_the_block(make, tiny_store, tmp_path):
    path = copy_store(tiny_store, tmp_path, "eio")
    store = Store.open(path)
    victim = block_of(path, "mlp_gate_up", 2)
    engine = FaultyEngine(IOEngine())
    engine.fail(store.data_path(victim), victim.offset, errno.EIO)
    m = make(path.parent, "strict", engine=engine)
    m.open_model(0, "eio")
    with pytest.raises(FlashIOError) as info:
        m.acquire(0, "eio", layer=2)
    err = info.value
    assert err.code == 200 and err.block_id == victim.id and err.errno == errno.EIO
    assert f"block {victim.id}" in str(err) and engine.injected == 1
    with pytest.raises(FlashIOError):
        m.acquire(0, "eio", layer=0)
    assert m.list_models()[0]["state"] == "failed"


def test_graceful_io_error_rereads_then_goes_host_only(make, tiny_store, tmp_path):
    path = copy_store(tiny_store, tmp_path, "eio")
    store = Store.open(path)
    victim = block_of(path, "mlp_gate_up", 2)
    engine = FaultyEngine(IOEngine())
    m = make(path.parent, "graceful", engine=engine)
    m.open_model(0, "eio")
    warm = m.acquire(0, "eio", layer=0)
    # A transient error: the re-read succeeds, nothing is degraded.
    engine.fail(store.data_path(victim), victim.offset, errno.EIO)
    lease = m.acquire(0, "eio", layer=2)
    assert engine.injected == 1 and m.stats()["load_errors"] == 1
    assert served(m, lease, store) == {b: store.read_block(b) for b in lease.blocks}
    assert m.snapshot()["status"]["controller_state"] == "ACTIVE"
    m.release(0, lease.id)
    # A persistent one: read and re-read fail, then the model goes host-only.
    victim3 = block_of(path, "mlp_gate_up", 3)
    engine.fail(store.data_path(victim3), victim3.offset, errno.EIO, times=2)
    with pytest.raises(FlashIOError) as info:
        m.acquire(0, "eio", layer=3)
    assert info.value.block_id == victim3.id and engine.injected == 3
    snap = m.snapshot()
    assert snap["models"]["eio"]["unified_memory_fabric"] == "HOST_ONLY"
    assert snap["status"]["controller_state"] == "DEGRADED" and snap["status"]["host_only_models"] == 1
    assert m.stats()["device_errors"] == 1
    # Resident blocks keep serving; a block that needs the disk fails fast, typed.
    again = m.acquire(0, "eio", layer=0)
    assert served(m, again, store) == {b: store.read_block(b) for b in again.blocks}
    start = time.monotonic()
    with pytest.raises(DeviceError) as info:
        m.acquire(0, "eio", layer=1)
    assert time.monotonic() - start < 0.5 and info.value.code == 220
    assert "block" in str(info.value) and info.value.block_id in {b.id for b in store.blocks if b.layer == 1}
    m.release(0, warm.id)
    m.release(0, again.id)
    # Back (what DeviceWatch does when the device returns): disk reads resume.
    assert m.set_host_only("eio", None)
    lease = m.acquire(0, "eio", layer=3)
    assert served(m, lease, store) == {b: store.read_block(b) for b in lease.blocks}
    assert m.snapshot()["status"]["controller_state"] == "ACTIVE"


def test_a_short_data_file_is_a_corrupt_store_not_a_dead_device(make, tiny_store, tmp_path):
    from deepseek_flash.errors import StoreTruncated

    path = copy_store(tiny_store, tmp_path, "cut")
    store = Store.open(path)
    last = max(store.blocks, key=lambda b: b.offset)         # the block at the end of the file
    data = store.data_path(last)
    os.truncate(data, last.offset + 4096)                    # one 4 KiB page of it is left
    m = make(path.parent, "graceful")
    m.open_model(0, "cut")
    with pytest.raises(StoreTruncated) as info:
        m.acquire(0, "cut", blocks=[last.id])
    err = info.value
    assert err.code == 112 and err.block_id == last.id and err.path == str(data)
    assert str(data) in str(err) and "shorter than" in str(err)
    snap = m.snapshot()
    # One bad file is not a device loss: the model stays on its device, the block is quarantined.
    assert snap["models"]["cut"]["unified_memory_fabric"] == "ENABLED"
    assert snap["status"]["host_only_models"] == 0 and m.stats()["device_errors"] == 0
    assert snap["models"]["cut"]["quarantined_blocks"] == [last.id]
    lease = m.acquire(0, "cut", layer=2)                     # other blocks still read from disk
    assert served(m, lease, store) == {b: store.read_block(b) for b in lease.blocks}
    with pytest.raises(StoreTruncated):                      # quarantined: typed at once
        m.acquire(0, "cut", blocks=[last.id])


# --- over the real daemon -----------------------------------------------------------------------------

def test_daemon_graceful_degraded_status_notify_and_log(daemon_factory, tiny_store, tmp_path):
    path = copy_store(tiny_store, tmp_path, "bad")
    store = Store.open(path)
    victim = block_of(path, "attn", 3)
    corrupt_block(path, victim.id)
    d = daemon_factory({"host_cache_bytes": "8MiB", "store_roots": [str(path.parent)],
                        "error_recovery_mode": "graceful", "prefetch_window": 0}).start()
    with d.client() as c:
        info = c.open_model("bad")
        with pytest.raises(BlockChecksumError) as err:
            c.acquire(info, layer=3)
        assert err.value.block_id == victim.id and f"block {victim.id}" in str(err.value)
        lease = c.acquire(info, layer=0)                 # keeps serving
        for bid, off in lease.blocks.items():
            assert bytes(c.arena.view(off, store.block(bid).length)) == store.read_block(bid)
        stats = c.stats()
        assert stats["quarantined_blocks"] == 1 and stats["checksum_errors"] == 2
        d.wait_message("STATUS=DEGRADED", timeout=10)
        # The status thread replaces the tree's files one after another, after the notify.
        assert_eventually(lambda: d.status_file().get("controller_state") == "DEGRADED",
                          what="DEGRADED in status")
        assert f"[{victim.id}]" in d.status_file()["degraded_reason"]
        info_path = d.runtime / "models" / "bad" / "info"
        assert_eventually(lambda: "quarantined_blocks" in info_path.read_text()
                          and str(victim.id) in info_path.read_text(), what="quarantine in info")
        assert "controller DEGRADED" in d.log()
        c.release(lease)
    assert d.stop() == 0
