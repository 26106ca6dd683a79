"""The read shape while a client imports: ``attach`` with ``importing`` makes the controller read
one 4 MiB request at a time (as dd does) until that client says ``imports_done``, detaches, leaves
or runs out of time; the bytes a load delivers are the store's either way."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from flashd_harness import assert_eventually, raw_connection

from deepseek_flash import protocol
from deepseek_flash._core import HostArena, IOEngine
from deepseek_flash.daemon import reads
from deepseek_flash.daemon.block_manager import BlockManager
from deepseek_flash.daemon.config import FlashConfig
from deepseek_flash.errors import BudgetTooSmall, MalformedFrame, UnknownModel
from deepseek_flash.store import Store
from deepseek_flash.wire import GATE_READY, control_views

FULL = {"read_depth": 8, "read_request_bytes": 4 << 20, "shallow_read_clients": 0}
SHALLOW = {"read_depth": 1, "read_request_bytes": 4 << 20}


def shape_of(stats: dict) -> dict:
    return {k: stats[k] for k in ("read_depth", "read_request_bytes", "shallow_read_clients")}


@pytest.fixture
def daemon(daemon_factory, tiny_store):
    d = daemon_factory({"host_cache_bytes": "16MiB", "store_roots": [str(tiny_store.parent)],
                        "socket_mode": "0666"}).start()
    yield d
    assert d.stop() == 0


def assert_store_bytes(client, desc, store) -> None:
    """Every block of a CPU attach's control page is open and holds the store's exact payload."""
    gates, offsets = control_views(client.arena, desc["control_offset"], desc["num_gates"],
                                   desc["num_blocks"])
    assert (gates == GATE_READY).all()
    view = memoryview(client.arena)
    for block in store.blocks:
        off = int(offsets[block.id])
        assert bytes(view[off:off + block.length]) == store.read_block(block.id), block.id


def test_an_importing_client_keeps_the_reads_shallow_until_it_says_done(daemon, tiny_store):
    store = Store.open(tiny_store)
    with daemon.client() as c, daemon.client() as other:
        assert shape_of(c.stats()) == FULL
        desc = c.attach("tiny", "cpu", importing=True)
        assert shape_of(c.stats()) == {**SHALLOW, "shallow_read_clients": 1}
        assert_store_bytes(c, desc, store)           # read at the shallow shape, byte for byte
        # A second importing client: the reads stay shallow until the last one is done.
        other.attach("tiny", "cpu", importing=True)
        assert shape_of(c.stats()) == {**SHALLOW, "shallow_read_clients": 2}
        held = c.imports_done()
        assert isinstance(held, float) and held > 0
        assert shape_of(c.stats()) == {**SHALLOW, "shallow_read_clients": 1}
        assert c.imports_done() is None              # nothing held any more: nothing to end
        other.detach("tiny")                         # a detach ends its hold too
        assert shape_of(c.stats()) == FULL
        log = daemon.log()
        assert "reads at 1 x 4096 KiB (1 clients importing): client" in log
        assert "(1 clients importing): client 1: its imports are done after" in log
        assert "reads at 8 x 4096 KiB (0 clients importing): client 2: it detached after" in log


def test_a_client_killed_mid_import_gives_the_depth_back_and_nothing_is_lost(daemon, tiny_store):
    script = textwrap.dedent(f"""
        import os, signal, sys
        from deepseek_flash.client import Client
        c = Client(socket_path={str(daemon.socket)!r}, embedded=False)
        c.attach("tiny", "cpu", importing=True)
        print(c.stats()["read_depth"], flush=True)
        os.kill(os.getpid(), signal.SIGKILL)         # dies before it could say imports_done
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == -signal.SIGKILL and out.stdout.split() == ["1"], out.stderr[-2000:]
    with daemon.client() as c:
        assert_eventually(lambda: shape_of(c.stats()) == FULL, what="full depth after the kill")
        assert_store_bytes(c, c.attach("tiny", "cpu"), Store.open(tiny_store))
    assert "it disconnected after" in daemon.log()


def test_bad_importing_arguments_and_failed_attaches_leave_the_depth_alone(daemon):
    s, _, fds = raw_connection(daemon.socket, True, timeout=10)
    for fd in fds:
        os.close(fd)
    with s:
        for bad in ("yes", 1, [True]):
            s.sendall(protocol.request(7, "attach", {"model": "tiny", "device": "cpu",
                                                     "importing": bad}))
            reply = protocol.recv_message(s, 1 << 20)
            assert reply["id"] == 7 and not reply["ok"]
            assert reply["error"]["code"] == MalformedFrame.code
            assert reply["error"]["fields"]["argument"] == "importing"
        s.sendall(protocol.request(8, "imports_done", {"unexpected": 1}))
        reply = protocol.recv_message(s, 1 << 20)
        assert reply["ok"] and reply["result"] == {"shallow_s": None}
    with daemon.client() as c:
        with pytest.raises(MalformedFrame) as exc:
            c.call("attach", {"model": "tiny", "device": "cpu", "importing": 0})
        assert exc.value.fields["argument"] == "importing"
        with pytest.raises(UnknownModel):
            c.attach("no-such-model", "cpu", importing=True)
        with pytest.raises(BudgetTooSmall):
            c.attach("tiny", "cpu", weight_budget=1, importing=True)
        assert shape_of(c.stats()) == FULL
    assert daemon.log().count("its attach failed") == 2


def test_a_hold_runs_out_and_the_engine_follows_the_holders(tiny_store):
    """Unit level: the shape follows the set of holders; a hold past its time ends at the next
    read the pipeline hands out; an engine without shapes (a test double) is left alone."""
    config = FlashConfig.from_dict({"store_roots": [str(tiny_store.parent)]})
    engine = IOEngine(queue_depth=8, request_size=256 << 10)
    manager = BlockManager(config, HostArena(8 << 20), engine)
    try:
        a, b = manager.connect({}), manager.connect({})
        manager.hold_shallow(a)
        manager.hold_shallow(b, max_s=0.05)
        assert engine.shape == reads.SHALLOW_SHAPE
        time.sleep(0.1)
        manager.open_model(a, "tiny")
        manager.acquire(a, "tiny", layer=0)          # pumps reads: b's hold has run out
        assert engine.shape == reads.SHALLOW_SHAPE and set(manager.state.shallow) == {a}
        manager.disconnect(a)
        assert engine.shape == (8, 256 << 10) and manager.state.shallow == {}
        assert manager.end_shallow(b) is None
    finally:
        manager.close()


def test_a_daemon_without_imports_done_is_not_an_error_for_the_client():
    """A daemon older than the client library answers ``imports_done`` with UnknownOperation
    (it ignored ``importing`` and read at full depth): the client goes on, nothing held."""
    from types import SimpleNamespace

    from deepseek_flash.client import Client
    from deepseek_flash.errors import UnknownOperation

    def old_daemon(op, args):
        raise UnknownOperation(f"unknown operation {op!r}", op=op)

    client = Client.__new__(Client)
    client._backend = SimpleNamespace(call=old_daemon)
    assert client.imports_done() is None
