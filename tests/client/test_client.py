"""Client: the same answers embedded and over the socket; typed errors; reconnect after a restart."""
import pytest
from deepseek_flash.client import Client, Lease, ModelInfo
from flashd_harness import assert_eventually

from deepseek_flash.errors import DaemonNotRunning, LeaseError, StoreInUse, UnknownBlock, UnknownModel
from deepseek_flash.store import Store


def config_for(store):
    return {"host_cache_bytes": "16MiB", "store_roots": [str(store.parent)], "prefetch_window": 1}


@pytest.fixture(params=["embedded", "daemon"])
def client(request, daemon_factory, tiny_store):
    if request.param == "embedded":
        c = Client(embedded=True, config=config_for(tiny_store))
    else:
        d = daemon_factory(config_for(tiny_store)).start()
        c = Client(d.socket, embedded=False)
    assert c.mode == request.param
    yield c
    c.close()


def test_same_api_both_modes(client, tiny_store):
    store = Store.open(tiny_store)
    info = client.open_model("tiny", flash_context={"prefetch_window": 0})
    assert isinstance(info, ModelInfo) and info.num_layers == 4
    assert info.flash_config["prefetch_window"] == 0 and info.config == store.config
    lease = client.acquire(info, layer=2)
    assert isinstance(lease, Lease) and sorted(lease.blocks) == [b.id for b in store.blocks if b.layer == 2]
    for bid, offset in lease.blocks.items():
        assert bytes(client.arena.view(offset, store.block(bid).length)) == store.read_block(bid)
    # per-open prefetch_window 0: nothing read ahead
    assert client.stats()["prefetch_issued"] == 0
    assert client.prefetch(info, layers=[3]) == 4
    assert_eventually(lambda: client.stats()["loading_blocks"] == 0, what="prefetch done")
    assert client.acquire(info, layer=3).blocks
    assert client.stats()["prefetch_used"] == 4
    models = client.list_models()
    assert [m["name"] for m in models] == ["tiny"] and models[0]["leased_blocks"] == 8
    status = client.status()
    assert status["stats"]["active_leases"] == 2
    assert status["status"]["controller_state"] == "ACTIVE" and status["status"]["semantic_block_count"] == 19
    with pytest.raises(StoreInUse):
        client.unload(info)
    client.release(lease)
    with pytest.raises(LeaseError):
        client.release(lease)
    client.close_model(info)
    assert client.stats()["active_leases"] == 0
    assert client.unload("tiny")["freed_bytes"] > 0
    assert client.list_models() == []


def test_typed_errors_both_modes(client):
    with pytest.raises(UnknownModel):
        client.open_model("not-there")
    info = client.open_model("tiny")
    with pytest.raises(UnknownBlock):
        client.acquire(info, blocks=[777])


def test_load_reads_every_block(client, tiny_store):
    result = client.load("tiny")
    assert result["resident_blocks"] == result["blocks"] == len(Store.open(tiny_store).blocks)
    assert client.stats()["misses"] == 0          # loads are not acquisitions


def test_reconnect_after_daemon_restart(daemon_factory, tiny_store):
    store = Store.open(tiny_store)
    d = daemon_factory(config_for(tiny_store)).start()
    c = Client(d.socket, embedded=False, reconnect_timeout=30)
    seen = []
    c.on_reconnect(lambda client: seen.append(client.generation))
    info = c.open_model("tiny")
    lease = c.acquire(info, layer=1)
    old_id = lease.id
    assert d.stop() == 0
    d.start()                                      # a new daemon, a new arena
    stats = c.stats()                              # reconnects, reopens, re-acquires
    assert c.generation == 1 and seen == [1]
    assert stats["active_leases"] == 1 and stats["open_models"] == 1
    assert lease.id == 1 and old_id == 1 and sorted(lease.blocks) == [b.id for b in store.blocks if b.layer == 1]
    for bid, offset in lease.blocks.items():
        assert bytes(c.arena.view(offset, store.block(bid).length)) == store.read_block(bid)
    c.release(lease)
    assert c.stats()["active_leases"] == 0
    c.close()


def test_reconnect_drops_the_old_daemons_mappings(daemon_factory, tiny_store, monkeypatch):
    """After a restart the host tensor, its page-locking and the GPU arenas belong to the old
    daemon: they are dropped at reconnect (the old registration undone) and remade on use."""
    import deepseek_flash.client as client_mod

    pinned, unpinned, opened = [], [], []
    monkeypatch.setattr(client_mod, "register_host_memory", lambda a, n: pinned.append(a) or True)
    monkeypatch.setattr(client_mod, "unregister_host_memory", unpinned.append)
    # The real one opens the descriptor's new segments into the process's DeviceMemory (given
    # back on later calls); a fresh one only when the process has none for this daemon.
    monkeypatch.setattr(client_mod, "open_gpu_arena", lambda desc, memory=None: memory if memory is not None
                        else opened.append(object()) or opened[-1])
    d = daemon_factory(config_for(tiny_store)).start()
    c = Client(d.socket, embedded=False, reconnect_timeout=30)
    old = c.arena.address
    assert c.host_tensor(pinned=True).data_ptr() == old and pinned == [old]
    desc = {"gpu_arena": {}, "events": []}
    first, _ = c.device_memory(0, desc)
    assert c.device_memory(0, desc)[0] is first                # opened once per daemon
    assert d.stop() == 0
    d.start()
    c.stats()                                                  # reconnects
    new = c.arena.address
    assert new != old and unpinned == [old]
    assert c.host_tensor(pinned=True).data_ptr() == new and pinned == [old, new]
    second, _ = c.device_memory(0, desc)
    assert second is not first and len(opened) == 2
    c.close()
    assert unpinned == [old, new]


def test_reconnect_gives_up_with_daemon_not_running(daemon_factory, tiny_store):
    d = daemon_factory(config_for(tiny_store)).start()
    c = Client(d.socket, embedded=False, reconnect_timeout=0.5)
    assert d.stop() == 0
    with pytest.raises(DaemonNotRunning):
        c.stats()


def test_unknown_operation_is_typed_in_embedded_mode(tiny_store):
    from deepseek_flash.errors import UnknownOperation
    c = Client(embedded=True, config=config_for(tiny_store))
    with pytest.raises(UnknownOperation) as err:
        c.call("nope")
    assert err.value.code == 304 and err.value.fields["op"] == "nope"
    c.close()


def test_attach_calls_sent_once_the_request_is_out(client, daemon_factory, tiny_store):
    """``attach(sent=...)``: over the socket, called once, after the request was written (the
    controller handles it while the callback runs: another client sees its leases); in-process,
    once, right before the controller handles it."""
    info = client.open_model("tiny")
    seen = []

    def sent():
        if client.mode == "daemon":
            with Client(client._backend.path, embedded=False) as other:
                assert_eventually(lambda: other.stats()["active_leases"] > 0, timeout=30)
        seen.append(client.mode)

    desc = client.attach(info.name, "cpu", sent=sent)
    assert seen == [client.mode]
    assert desc["control_offset"] is not None
    assert client.stats()["active_leases"] > 0


def test_sent_runs_once_across_a_reconnect(monkeypatch):
    """The socket backend retries a call after a lost connection: ``sent`` still runs once."""
    from deepseek_flash.client import _SocketBackend

    import threading

    backend = object.__new__(_SocketBackend)
    backend.sock, backend.path, backend._in_reconnect = object(), "test.sock", False
    backend._lock = threading.RLock()
    tries = []

    def roundtrip(op, args, sent=None):
        sent()
        tries.append(op)
        if len(tries) == 1:
            raise ConnectionResetError("lost after the request went out")
        return {"ok": True}

    monkeypatch.setattr(backend, "_roundtrip", roundtrip)
    monkeypatch.setattr(backend, "_reconnect", lambda: None)
    calls = []
    assert backend.call("attach", {}, sent=lambda: calls.append(1)) == {"ok": True}
    assert tries == ["attach", "attach"] and calls == [1]
