"""The control socket under abuse: bad frames, wrong versions, strangers, stalled clients."""
import os
import socket
import struct
import subprocess
import sys
import textwrap
import time

import msgpack
import pytest
from flashd_harness import raw_connection

from deepseek_flash import protocol
from deepseek_flash.errors import PermissionDenied


@pytest.fixture
def daemon(daemon_factory, tiny_store):
    d = daemon_factory({"host_cache_bytes": "16MiB", "store_roots": [str(tiny_store.parent)],
                        "max_frame_bytes": 8192, "socket_mode": "0666"}).start()
    yield d
    assert d.stop() == 0


def raw(daemon, hello=True):
    s, reply, fds = raw_connection(daemon.socket, hello, timeout=10)
    if hello:
        assert reply["ok"] and len(fds) == 1
        assert os.fstat(fds[0]).st_size == reply["result"]["arena_size"]
    for fd in fds:
        os.close(fd)
    return s


def reply_of(s):
    return protocol.recv_message(s, 1 << 20)


def closed(s) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def still_serves(daemon):
    with daemon.client() as c:
        return c.stats()["connected_clients"] >= 1


def test_hello_carries_the_arena_fd_and_limits(daemon):
    s = raw(daemon, hello=False)
    s.sendall(protocol.request(9, "hello", {"protocol": protocol.PROTOCOL_VERSION, "client": "t"}))
    fds = []
    reply = protocol.recv_message(s, 1 << 20, fds)
    assert reply["id"] == 9 and reply["ok"]
    result = reply["result"]
    assert result["protocol"] == protocol.PROTOCOL_VERSION and result["max_frame_bytes"] == 8192
    assert result["arena_size"] == 16 << 20 and len(fds) == 1
    os.close(fds[0])


def test_wrong_protocol_version_in_hello(daemon):
    s = raw(daemon, hello=False)
    s.sendall(protocol.request(1, "hello", {"protocol": 99}))
    reply = reply_of(s)
    assert reply["id"] == 1 and reply["error"]["code"] == 303
    assert closed(s)
    assert still_serves(daemon)


def test_wrong_frame_version(daemon):
    s = raw(daemon, hello=False)
    frame = bytearray(protocol.request(1, "hello", {"protocol": 1}))
    frame[2] = 7
    s.sendall(bytes(frame))
    header = s.recv(8)
    length = struct.unpack(">I", header[4:])[0]
    reply = msgpack.unpackb(s.recv(length), strict_map_key=False)
    assert reply["id"] is None and reply["error"]["code"] == 303
    assert closed(s)


def test_first_request_must_be_hello(daemon):
    s = raw(daemon, hello=False)
    s.sendall(protocol.request(4, "stats"))
    reply = reply_of(s)
    assert reply["id"] == 4 and reply["error"]["code"] == 300
    assert closed(s)


def test_bad_magic_closes_only_that_connection(daemon):
    s = raw(daemon)
    s.sendall(b"XX\x01\x00\x00\x00\x00\x02{}")
    reply = reply_of(s)
    assert reply["id"] is None and reply["error"]["code"] == 301
    assert closed(s)
    assert still_serves(daemon)


def test_oversized_frame(daemon):
    s = raw(daemon)
    s.sendall(protocol.HEADER.pack(b"DF", protocol.PROTOCOL_VERSION, 0, 8193))
    reply = reply_of(s)
    assert reply["error"]["code"] == 302 and reply["error"]["fields"]["limit"] == 8192
    assert closed(s)


def test_malformed_payload_keeps_the_connection(daemon):
    s = raw(daemon)
    s.sendall(protocol.encode([1, 2, 3]))
    assert reply_of(s)["error"]["code"] == 301
    bad = b"\xc1"
    s.sendall(protocol.HEADER.pack(b"DF", protocol.PROTOCOL_VERSION, 0, len(bad)) + bad)
    assert reply_of(s)["error"]["code"] == 301
    s.sendall(protocol.request(5, "acquire", {"blocks": [1]}))           # no model
    reply = reply_of(s)
    assert reply["id"] == 5 and reply["error"]["code"] == 301 and "model" in reply["error"]["message"]
    s.sendall(protocol.request(6, "frobnicate"))
    reply = reply_of(s)
    assert reply["id"] == 6 and reply["error"]["code"] == 304
    s.sendall(protocol.request(7, "stats"))
    reply = reply_of(s)
    assert reply["id"] == 7 and reply["ok"] and "active_leases" in reply["result"]


def test_every_request_gets_exactly_one_reply_pipelined(daemon):
    s = raw(daemon)
    s.sendall(protocol.request(2, "open_model", {"model": "tiny"}))
    assert reply_of(s)["ok"]
    burst = b"".join(protocol.request(100 + i, "acquire", {"model": "tiny", "layer": i % 4})
                     for i in range(40))
    s.sendall(burst)
    replies = [reply_of(s) for _ in range(40)]
    assert sorted(r["id"] for r in replies) == list(range(100, 140))
    assert all(r["ok"] for r in replies)
    leases = [r["result"]["lease"] for r in replies]
    s.sendall(b"".join(protocol.request(200 + i, "release", {"lease": lease})
                       for i, lease in enumerate(leases)))
    assert [reply_of(s)["id"] for _ in leases] == list(range(200, 240))
    s.settimeout(0.3)
    with pytest.raises(socket.timeout):
        s.recv(1)


def test_truncated_frame_then_hangup(daemon):
    s = raw(daemon)
    frame = protocol.request(3, "stats")
    s.sendall(frame[:5])
    s.close()
    s = raw(daemon)
    s.sendall(frame[:len(frame) - 2])
    time.sleep(0.1)
    s.close()
    assert still_serves(daemon)


def test_stalled_client_does_not_block_others(daemon):
    stalled = raw(daemon)
    stalled.sendall(protocol.request(3, "stats")[:6])        # half a header, then nothing
    reader = raw(daemon)                                        # never reads its replies
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    reader.sendall(b"".join(protocol.request(10 + i, "status") for i in range(200)))
    start = time.monotonic()
    with daemon.client() as c:
        info = c.open_model("tiny")
        for _ in range(50):
            c.release(c.acquire(info, layer=0))
    assert time.monotonic() - start < 10
    stalled.close()
    reader.close()


STRANGER = textwrap.dedent("""
    import os, sys
    # Import first: the interpreter's files need not be readable by nobody.
    import deepseek_flash._core
    from deepseek_flash.client import Client
    from deepseek_flash.errors import PermissionDenied
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
    try:
        Client(sys.argv[1], embedded=False)
    except PermissionDenied as exc:
        print("denied", exc.code, exc)
    else:
        print("allowed")
""")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_peer_credentials_checked(daemon):
    # nobody:nogroup is not root, not the daemon's user and not in its group.
    out = subprocess.run([sys.executable, "-c", STRANGER, str(daemon.socket)], capture_output=True,
                         timeout=60, cwd="/", check=False)
    assert out.stdout.decode().startswith(f"denied {PermissionDenied.code}"), out.stderr.decode()
    assert still_serves(daemon)
