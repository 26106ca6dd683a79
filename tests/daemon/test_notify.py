"""daemon/notify.py: what arrives on a datagram socket bound in a temp dir (the python-systemd way)."""
from __future__ import annotations

import os
import socket
import sys
import uuid

import pytest
from deepseek_flash.daemon.notify import Notifier


@pytest.fixture
def listener(tmp_path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = tmp_path / "notify"
    sock.bind(str(path))
    sock.settimeout(5)
    yield str(path), sock
    sock.close()


def receive(sock) -> bytes:
    return sock.recv(4096)


def test_without_notify_socket_every_call_is_a_no_op():
    n = Notifier(environ={})
    assert not n.enabled and n.backend == "none"
    assert n.ready("x") is False
    assert n.status("x") is False
    assert n.reloading() is False
    assert n.stopping() is False
    assert n.watchdog() is False
    assert n.watchdog_interval() is None


def test_socket_backend_sends_exact_datagrams(listener):
    path, sock = listener
    n = Notifier(environ={"NOTIFY_SOCKET": path}, backend="socket")
    assert n.backend == "socket"
    assert n.ready("serving 2 models") is True
    assert receive(sock) == b"READY=1\nSTATUS=serving 2 models"
    assert n.status("loading llama") is True
    assert receive(sock) == b"STATUS=loading llama"
    assert n.reloading("reloading /etc/deepseek-flash/flash.json") is True
    assert receive(sock) == b"RELOADING=1\nSTATUS=reloading /etc/deepseek-flash/flash.json"
    assert n.watchdog() is True
    assert receive(sock) == b"WATCHDOG=1"
    assert n.stopping() is True
    assert receive(sock) == b"STOPPING=1"


def test_status_text_cannot_inject_fields(listener):
    path, sock = listener
    n = Notifier(environ={"NOTIFY_SOCKET": path}, backend="socket")
    n.status("line one\nREADY=1")
    assert receive(sock) == b"STATUS=line one READY=1"


def test_abstract_address():
    name = f"deepseek-flash-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        n = Notifier(environ={"NOTIFY_SOCKET": "@" + name}, backend="socket")
        assert n.ready() is True
        assert sock.recv(4096) == b"READY=1"


def test_systemd_python_backend(listener, monkeypatch):
    pytest.importorskip("systemd.daemon", reason="systemd-python is an optional dependency")
    path, sock = listener
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    n = Notifier()
    assert n.backend == "systemd"
    assert n.ready("up") is True
    assert receive(sock) == b"READY=1\nSTATUS=up"
    # sd_notify must not strip NOTIFY_SOCKET: the daemon notifies for its whole life.
    assert os.environ["NOTIFY_SOCKET"] == path
    assert n.stopping() is True
    assert receive(sock) == b"STOPPING=1"


def test_falls_back_to_socket_without_systemd_python(listener, monkeypatch):
    path, sock = listener
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setitem(sys.modules, "systemd", None)  # makes `from systemd import daemon` fail
    n = Notifier()
    assert n.backend == "socket"
    assert n.ready() is True
    assert receive(sock) == b"READY=1"
    with pytest.raises(ImportError):
        Notifier(backend="systemd")


def test_systemd_backend_cannot_serve_another_address(listener, monkeypatch):
    path, _ = listener
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    with pytest.raises(ValueError, match="sends to the process's NOTIFY_SOCKET"):
        Notifier(environ={"NOTIFY_SOCKET": path}, backend="systemd")


def test_explicit_address_other_than_the_environment_uses_the_socket(listener, monkeypatch):
    path, sock = listener
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    n = Notifier(environ={"NOTIFY_SOCKET": path})
    assert n.backend == "socket"
    assert n.watchdog() is True
    assert receive(sock) == b"WATCHDOG=1"


def test_unreachable_socket_is_logged_not_raised(tmp_path, caplog):
    n = Notifier(environ={"NOTIFY_SOCKET": str(tmp_path / "gone")}, backend="socket")
    assert n.ready() is False
    assert "sd_notify to" in caplog.text and "gone" in caplog.text


@pytest.mark.parametrize("env, expected", [
    ({"WATCHDOG_USEC": "30000000"}, 30.0),
    ({"WATCHDOG_USEC": "500000", "WATCHDOG_PID": str(os.getpid())}, 0.5),
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None),
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "soon"}, None),
    ({}, None),
])
def test_watchdog_interval(env, expected):
    assert Notifier(environ={"NOTIFY_SOCKET": "/nonexistent", **env}).watchdog_interval() == expected


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="notify backend 'dbus'"):
        Notifier(backend="dbus")
