"""The real ``deepseek-flashd``: readiness, serving, reload, shutdown, crashes of clients."""
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from flashd_harness import assert_eventually, daemon_command
from safetensors.torch import load_file

from deepseek_flash.errors import (
    BudgetTooSmall,
    ConfigError,
    DaemonNotRunning,
    OutOfMemory,
    UnknownBlock,
    UnknownModel,
)
from deepseek_flash.store import Store
from deepseek_flash.store.views import block_tensors


def base_config(store, **extra):
    return {"host_cache_bytes": "16MiB", "store_roots": [str(store.parent)], **extra}


def test_lifecycle_ready_serve_stop(daemon_factory, tiny_store):
    d = daemon_factory(base_config(tiny_store)).start()
    ready = d.wait_message("READY=1")
    assert "STATUS=" in ready
    assert d.socket.exists() and oct(d.socket.stat().st_mode & 0o777) == "0o660"
    status = d.status_file()
    assert status["controller_state"] == "ACTIVE" and status["unified_memory_fabric"] == "HOST_ONLY"
    store = Store.open(tiny_store)
    with d.client() as c:
        assert c.mode == "daemon"
        info = c.open_model("tiny")
        assert [b.to_dict() for b in info.blocks] == [b.to_dict() for b in store.blocks]
        lease = c.acquire(info, blocks=[b.id for b in store.blocks])
        for bid, offset in lease.blocks.items():
            assert bytes(c.arena.view(offset, store.block(bid).length)) == store.read_block(bid)
        # ... and, seen as tensors through the client's mapping, equal the checkpoint's exactly.
        original = load_file(str(tiny_store.parent.parent / "tiny-src" / "model.safetensors"))
        served = {}
        for block in info.blocks:
            served.update(block_tensors(block, c.arena.view(lease.blocks[block.id], block.length)))
        assert set(original) <= set(served)
        for name, tensor in original.items():
            assert served[name].dtype == tensor.dtype and torch.equal(served[name], tensor), name
        stats = c.stats()
        assert stats["active_leases"] == 1 and stats["connected_clients"] == 1
        assert stats["bytes_read_nvme"] == store.total_bytes
        assert_eventually(lambda: d.status_file("stats").get("active_leases") == "1", what="stats file")
        assert c.list_models()[0]["resident_blocks"] == len(store.blocks)
        assert_eventually(lambda: (d.runtime / "models" / "tiny" / "info").exists(), what="model dir")
    assert d.stop() == 0
    assert any("STOPPING=1" in m for m in d.drain_notify())
    assert not d.socket.exists()
    assert "stopped" in d.log()


def test_sighup_good_and_bad_config(daemon_factory, tiny_store):
    d = daemon_factory(base_config(tiny_store)).start()
    with d.client() as c:
        assert c.get_tunable("prefetch_window") == "auto"
        d.write_config(base_config(tiny_store, prefetch_window=7))
        mark = len(d.drain_notify())
        d.signal(signal.SIGHUP)
        d.wait_message("RELOADING=1", after=mark)
        d.wait_message("READY=1", after=mark + 1)
        assert c.get_tunable("prefetch_window") == 7
        assert d.status_file()["config_state"] == "ok"

        d.write_config(base_config(tiny_store, prefetch_window=99))
        mark = len(d.drain_notify())
        d.signal(signal.SIGHUP)
        msg = d.wait_message("READY=1", after=mark)
        assert "reload failed" in msg and "prefetch_window" in msg
        assert c.get_tunable("prefetch_window") == 7            # old config kept
        status = d.status_file()
        assert status["config_state"] == "reload_failed" and "prefetch_window" in status["last_reload_error"]

        d.write_config("{broken")
        d.signal(signal.SIGHUP)
        assert_eventually(lambda: "not valid JSON" in d.status_file().get("last_reload_error", ""),
                          what="reload error in status")
        assert c.stats()["connected_clients"] == 1
    assert d.stop() == 0


def test_tunables_over_the_socket(daemon_factory, tiny_store):
    d = daemon_factory(base_config(tiny_store)).start()
    with d.client() as c:
        assert c.set_tunable("block_eviction_policy", "access_frequency_weighted") == {
            "key": "block_eviction_policy", "old": "lru", "new": "access_frequency_weighted"}
        assert c.get_tunable()["block_eviction_policy"] == "access_frequency_weighted"
        with pytest.raises(ConfigError) as info:
            c.set_tunable("host_cache_bytes", "1GiB")
        assert info.value.key == "host_cache_bytes"
        with pytest.raises(ConfigError):
            c.set_tunable("eviction_threshold", 3)
    assert d.stop() == 0


CHILD = textwrap.dedent("""
    import sys, time
    from deepseek_flash.client import Client
    c = Client(sys.argv[1], embedded=False)
    info = c.open_model("wide")
    for layer in range(2):
        c.acquire(info, layer=layer)
    print("held", flush=True)
    time.sleep(60)
""")


def test_killed_client_releases_leases_and_memory(daemon_factory, wide_store):
    # 2 MiB holds two ~964 KiB layers: the killed client holds both.
    d = daemon_factory(base_config(wide_store, host_cache_bytes="2MiB", prefetch_window=0)).start()
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(d.socket)], stdout=subprocess.PIPE)
    assert child.stdout.readline().strip() == b"held"
    with d.client() as c:
        info = c.open_model("wide")
        assert c.stats()["active_leases"] == 2
        with pytest.raises(OutOfMemory):
            c.acquire(info, layer=2)
        child.send_signal(signal.SIGKILL)
        child.wait()
        assert_eventually(lambda: c.stats()["active_leases"] == 0, what="leases released")
        assert c.stats()["connected_clients"] == 1
        # The dead client's memory is reused for two other layers.
        leases = [c.acquire(info, layer=layer) for layer in (2, 3)]
        assert c.stats()["active_leases"] == 2 and all(len(l.blocks) == 4 for l in leases)
        assert c.stats()["block_eviction_count"] >= 6
    assert d.stop() == 0


MANY = textwrap.dedent("""
    import sys
    from deepseek_flash.client import Client
    from deepseek_flash.store import Store
    store = Store.open(sys.argv[2])
    with Client(sys.argv[1], embedded=False) as c:
        info = c.open_model("tiny")
        for rnd in range(20):
            lease = c.acquire(info, layer=rnd % 4)
            for bid, off in lease.blocks.items():
                assert bytes(c.arena.view(off, store.block(bid).length)) == store.read_block(bid)
            c.release(lease)
    print("ok", flush=True)
""")


def test_many_clients_at_once(daemon_factory, tiny_store):
    d = daemon_factory(base_config(tiny_store)).start()
    procs = [subprocess.Popen([sys.executable, "-c", MANY, str(d.socket), str(tiny_store)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(12)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()
        assert out.strip() == b"ok"
    with d.client() as c:
        stats = c.stats()
        assert stats["active_leases"] == 0 and stats["leases_granted"] == 240
        assert stats["connected_clients"] == 1
    assert d.stop() == 0


def test_errors_come_back_typed(daemon_factory, tiny_store, big_store):
    d = daemon_factory({"host_cache_bytes": "1MiB",
                        "store_roots": [str(tiny_store.parent), str(big_store.parent)]}).start()
    with d.client() as c:
        with pytest.raises(UnknownModel):
            c.open_model("missing")
        with pytest.raises(UnknownModel):
            c.open_model("../tiny")
        with pytest.raises(BudgetTooSmall) as info:
            c.open_model("big")
        assert info.value.budget == 1 << 20 and info.value.needed > 1 << 20
        info = c.open_model("tiny")
        with pytest.raises(UnknownBlock) as err:
            c.acquire(info, blocks=[12345])
        assert err.value.block_id == 12345
        assert c.acquire(info, layer=0).blocks            # the connection still serves
    assert d.stop() == 0


def test_second_daemon_refused(daemon_factory, tiny_store):
    d = daemon_factory(base_config(tiny_store)).start()
    second = subprocess.run([*daemon_command()], env=d.env, capture_output=True, timeout=60, check=False)
    assert second.returncode == 3
    assert b"another deepseek-flashd" in second.stderr
    assert d.socket.exists()
    with d.client() as c:
        assert c.stats()["connected_clients"] == 1
    assert d.stop() == 0


def test_stale_socket_is_replaced(daemon_factory, tiny_store):
    d = daemon_factory(base_config(tiny_store))
    d.runtime.mkdir(parents=True)
    import socket as socketlib
    s = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    s.bind(str(d.socket))
    s.close()                                       # a socket file nobody listens on
    d.start()
    with d.client() as c:
        assert c.list_models() == []
    assert d.stop() == 0


def test_invalid_config_at_start_exits_with_message(daemon_factory):
    d = daemon_factory({"prefetch_window": 1000})
    result = subprocess.run(daemon_command(), env=d.env, capture_output=True, timeout=60, check=False)
    assert result.returncode == 2
    assert b"prefetch_window" in result.stderr and b"0..64" in result.stderr


def test_client_falls_back_or_refuses_without_daemon(tmp_path):
    from deepseek_flash.client import Client
    with pytest.raises(DaemonNotRunning):
        Client(tmp_path / "none.sock", embedded=False)
    with Client(tmp_path / "none.sock", config={"host_cache_bytes": "4MiB"}) as c:
        assert c.mode == "embedded"


def test_sigint_also_stops_cleanly(daemon_factory, tiny_store):
    d = daemon_factory(base_config(tiny_store)).start()
    d.signal(signal.SIGINT)
    assert d.proc.wait(20) == 0
    assert not d.socket.exists()


def test_watchdog_pings(daemon_factory, tiny_store):
    d = daemon_factory(base_config(tiny_store), env={"WATCHDOG_USEC": "400000"}).start()
    first = d.wait_message("WATCHDOG=1", timeout=5)
    mark = d.messages.index(first) + 1
    d.wait_message("WATCHDOG=1", timeout=5, after=mark)
    assert d.stop() == 0


def test_socket_activation_uses_the_passed_fd(daemon_factory, tiny_store):
    import socket as socketlib
    d = daemon_factory(base_config(tiny_store))
    d.runtime.mkdir(parents=True)
    listener = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    listener.bind(str(d.socket))
    listener.listen(16)
    fd = listener.fileno()
    # As systemd does: the socket is fd 3, LISTEN_PID names the daemon's own pid.
    wrapper = ["sh", "-c", 'LISTEN_PID=$$ LISTEN_FDS=1 exec "$@"', "sh", *daemon_command(),
               "--log-level", "debug"]
    log = open(d.log_path, "ab")  # noqa: SIM115 -- the daemon's log for its whole life
    d.proc = subprocess.Popen(wrapper, env=d.env, stdout=log, stderr=subprocess.STDOUT, pass_fds=(3,),
                              preexec_fn=lambda: os.dup2(fd, 3))  # noqa: PLW1509 -- dup2 only
    d._log = log
    d.wait_message("READY=1", timeout=30)
    listener.close()                                  # the daemon holds its own copy
    assert "systemd-activated socket" in d.log()
    with d.client() as c:
        assert c.open_model("tiny").num_layers == 4
    assert d.stop() == 0
    assert d.socket.exists()                          # systemd's socket stays for the next start
