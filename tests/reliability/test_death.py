"""Death: clients SIGKILLed at several points release everything; a daemon SIGKILLed and
restarted leaves every store valid and its clients carry on."""
import random
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

from faults import DEATH_DAEMON_KILLS, DEATH_KILLS_COLD_ACQUIRE
from flashd_harness import assert_eventually

from deepseek_flash.store import Store
from deepseek_flash.store.verify import verify_store

LOOPER = textwrap.dedent("""
    import sys
    from deepseek_flash.client import Client
    c = Client(sys.argv[1], embedded=False)
    info = c.open_model("wide")
    print("open", flush=True)
    n = 0
    while True:                  # 2 MiB holds two layers: every acquire is a cold read
        lease = c.acquire(info, layer=n % 4)
        c.release(lease)
        n += 1
""")

HOLDER = textwrap.dedent("""
    import sys, time
    from deepseek_flash.client import Client
    c = Client(sys.argv[1], embedded=False)
    info = c.open_model("wide")
    leases = [c.acquire(info, layer=layer) for layer in range(2)]
    print("held", flush=True)
    time.sleep(60)
""")


def restart(d):
    """Start the killed daemon again and wait for *its* READY=1."""
    d._log.close()
    seen = len(d.drain_notify())
    d.start(wait_ready=False)
    d.wait_message("READY=1", timeout=30, after=seen)


def config(store, **kw):
    return {"host_cache_bytes": "2MiB", "store_roots": [str(store.parent)], "prefetch_window": 0, **kw}


def memory_is_reusable(c, info):
    # Both layers fit only if nothing else holds host memory.
    leases = [c.acquire(info, layer=layer) for layer in (2, 3)]
    for lease in leases:
        c.release(lease)
    return True


def clean(c):
    s = c.stats()
    return s["active_leases"] == 0 and s["connected_clients"] == 1 and s["loading_blocks"] == 0


def test_client_killed_during_cold_acquires_and_while_holding(daemon_factory, wide_store):
    d = daemon_factory(config(wide_store)).start()
    rnd = random.Random(7)
    with d.client() as c:
        info = c.open_model("wide")
        for _ in range(DEATH_KILLS_COLD_ACQUIRE):
            child = subprocess.Popen([sys.executable, "-c", LOOPER, str(d.socket)], stdout=subprocess.PIPE)
            assert child.stdout.readline().strip() == b"open"
            time.sleep(rnd.uniform(0.01, 0.3))       # somewhere inside its acquire/release loop
            child.send_signal(signal.SIGKILL)
            child.wait()
            assert_eventually(lambda: clean(c), what="leases released after SIGKILL")
            assert memory_is_reusable(c, info)
        child = subprocess.Popen([sys.executable, "-c", HOLDER, str(d.socket)], stdout=subprocess.PIPE)
        assert child.stdout.readline().strip() == b"held"
        assert c.stats()["active_leases"] == 2
        child.send_signal(signal.SIGKILL)
        child.wait()
        assert_eventually(lambda: clean(c), what="held leases released")
        assert memory_is_reusable(c, info)
        assert c.stats()["misses"] > DEATH_KILLS_COLD_ACQUIRE * 4    # the loops really read cold
    assert d.stop() == 0


MIDFRAME = textwrap.dedent("""
    import os, socket, sys
    from deepseek_flash import protocol
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sys.argv[1])
    s.sendall(protocol.request(1, "hello", {"protocol": 1}))
    fds = []
    protocol.recv_message(s, 1 << 20, fds)
    s.sendall(protocol.request(2, "open_model", {"model": "wide"}))
    protocol.recv_message(s, 1 << 20)
    s.sendall(protocol.request(3, "acquire", {"model": "wide", "layer": 0}))
    protocol.recv_message(s, 1 << 20)
    # Cold acquires pipelined and never read, then half a frame: killed in the middle of it all.
    s.sendall(b"".join(protocol.request(10 + i, "acquire", {"model": "wide", "layer": 1}) for i in range(5)))
    s.sendall(protocol.request(20, "acquire", {"model": "wide", "layer": 2})[:11])
    print("mid", flush=True)
    import time; time.sleep(60)
""")


def test_client_killed_mid_frame(daemon_factory, wide_store):
    d = daemon_factory(config(wide_store)).start()
    with d.client() as c:
        info = c.open_model("wide")
        for _ in range(3):
            child = subprocess.Popen([sys.executable, "-c", MIDFRAME, str(d.socket)], stdout=subprocess.PIPE)
            assert child.stdout.readline().strip() == b"mid"
            child.send_signal(signal.SIGKILL)
            child.wait()
            assert_eventually(lambda: clean(c), what="mid-frame client cleaned up")
            assert memory_is_reusable(c, info)
    assert d.stop() == 0


def test_daemon_sigkill_restart_stores_valid_client_continues(daemon_factory, tiny_store):
    store = Store.open(tiny_store)
    expected = {b.id: store.read_block(b.id) for b in store.blocks}
    d = daemon_factory({"host_cache_bytes": "1MiB", "store_roots": [str(tiny_store.parent)],
                        "prefetch_window": 1}).start()
    c = d.client(reconnect_timeout=60)
    info = c.open_model("tiny")
    done, errors, rounds = threading.Event(), [], [0]

    def loop():
        try:
            n = 0
            while not done.is_set():
                lease = c.acquire(info, layer=n % 4)
                for bid, off in lease.blocks.items():     # the bytes of whichever daemon answered
                    if bytes(c.arena.view(off, len(expected[bid]))) != expected[bid]:
                        errors.append(f"block {bid} wrong after generation {c.generation}")
                c.release(lease)
                n += 1
                rounds[0] = n
        except Exception as exc:   # noqa: BLE001 -- reported by the assertion below
            errors.append(repr(exc))
    worker = threading.Thread(target=loop)
    worker.start()
    try:
        for kill in range(DEATH_DAEMON_KILLS):
            before = rounds[0]
            assert_eventually(lambda b=before: rounds[0] > b + 50 or errors, what="client progress")
            d.proc.send_signal(signal.SIGKILL)
            d.proc.wait()
            report = verify_store(Store.open(tiny_store))
            assert report.ok, report.bad
            restart(d)
            at_restart = rounds[0]
            assert_eventually(lambda a=at_restart: rounds[0] > a + 50 or errors, timeout=30,
                              what="client continues after restart")
            assert not errors, errors
        assert c.generation == DEATH_DAEMON_KILLS
    finally:
        done.set()
        worker.join(30)
    assert not errors, errors
    stats = c.stats()
    assert stats["active_leases"] == 0 and stats["connected_clients"] == 1
    c.close()
    assert d.stop() == 0


def test_a_dead_daemons_socket_is_taken_over(daemon_factory, tiny_store):
    d = daemon_factory({"store_roots": [str(tiny_store.parent)], "host_cache_bytes": "4MiB"}).start()
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()
    assert d.socket.exists()                    # left behind by the killed daemon
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(d.socket))
        raise AssertionError("a dead daemon's socket answered")
    except ConnectionRefusedError:
        pass
    finally:
        probe.close()
    restart(d)
    with d.client() as c:
        c.release(c.acquire(c.open_model("tiny"), layer=0))
    assert d.stop() == 0
