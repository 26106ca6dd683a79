"""The client as an operator's users meet it: the system daemon's socket for members of its group,
a WARNING when it runs the controller in-process, timeouts that name the socket, and a closing
client that never starts a stopped daemon."""
from __future__ import annotations

import grp
import logging
import os
import pickle
import socket
import time

import pytest
from flashd_harness import packed_model

from deepseek_flash import paths
from deepseek_flash.client import Client
from deepseek_flash.errors import DaemonNotRunning

NOBODY = 65534


def shared_group() -> grp.struct_group:
    for name in ("users", "nogroup", "daemon"):
        try:
            return grp.getgrnam(name)
        except KeyError:
            continue
    pytest.fail("none of the groups users, nogroup, daemon exists to test group access with")


def as_user(groups: list[int], fn):
    """``fn()``'s result (or the exception it raised), run in a forked child as uid/gid 65534
    with the supplementary ``groups``: a real non-root member (or not) of the socket's group."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(r)
            os.setgroups(groups)
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                result = ("ok", fn())
            except Exception as exc:   # noqa: BLE001 -- handed to the parent as it is
                result = ("raised", exc)
            os.write(w, pickle.dumps(result))
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and data, "the child as uid 65534 failed"
    kind, value = pickle.loads(data)
    if kind == "raised":
        raise value
    return value


@pytest.fixture
def system_daemon(daemon_factory, tmp_path, monkeypatch):
    """A daemon standing in for the system one: its tree is /run/deepseek_flash for paths.py,
    its socket 0660 in a group a test user may or may not belong to."""
    if os.geteuid() != 0:
        pytest.skip("switches to uid 65534: root only")
    group = shared_group()
    store = packed_model(tmp_path, "tiny", num_layers=1)
    d = daemon_factory({"host_cache_bytes": "16MiB", "socket_group": group.gr_name,
                        "models": {"tiny": str(store)}}).start()
    monkeypatch.setattr(paths, "SYSTEM_RUNTIME_DIR", d.runtime)
    for name in ("DEEPSEEK_FLASH_RUNTIME_DIR", "DEEPSEEK_FLASH_SOCKET", "RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(name, raising=False)
    return d, group


def test_a_group_member_reaches_the_system_daemon_by_default(system_daemon):
    d, group = system_daemon

    def connect():
        with Client(embedded=False) as client:
            return str(paths.client_socket_path()), client.mode, client.status()["status"]["pid"]
    where, mode, pid = as_user([group.gr_gid], connect)
    assert (where, mode, pid) == (str(d.socket), "daemon", d.proc.pid)
    assert as_user([group.gr_gid], lambda: str(paths.client_runtime_dir())) == str(d.runtime)
    assert d.stop() == 0


def test_a_user_outside_the_group_keeps_the_per_user_socket(system_daemon):
    d, _ = system_daemon

    def connect():
        try:
            Client(embedded=False)
        except DaemonNotRunning as exc:
            return str(paths.client_socket_path()), exc.message
        return None
    where, message = as_user([], connect)
    assert where == f"/tmp/deepseek_flash-{NOBODY}/control.sock"
    assert message.startswith(f"no deepseek-flashd at {where}")
    assert d.stop() == 0


def test_falling_back_to_embedded_says_so_at_warning(tmp_path, monkeypatch, caplog):
    missing = tmp_path / "none.sock"
    monkeypatch.setenv("DEEPSEEK_FLASH_SOCKET", str(missing))
    with caplog.at_level(logging.INFO, logger="deepseek_flash.client"):
        with Client(config={"host_cache_bytes": "4MiB"}) as client:
            assert client.mode == "embedded"
    records = [r for r in caplog.records if r.name == "deepseek_flash.client"]
    assert [r.levelno for r in records] == [logging.WARNING]
    assert records[0].getMessage().startswith(f"no deepseek-flashd answered at {missing} (")
    assert "running the controller in this process (embedded)" in records[0].getMessage()


def silent_listener(path):
    """A listening socket nobody accepts on -- what systemd's socket unit is while the service it
    should start keeps failing."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(8)
    return sock


def test_handshake_timeout_names_the_socket_and_what_was_waited_for(tmp_path):
    path = tmp_path / "s.sock"
    with silent_listener(path):
        start = time.monotonic()
        with pytest.raises(DaemonNotRunning) as info:
            Client(path, embedded=False, handshake_timeout=0.5)
        waited = time.monotonic() - start
    assert 0.5 <= waited < 5
    assert info.value.message.startswith(f"no answer from deepseek-flashd at {path}: waited 0.5 s for "
                                         f"its hello reply")
    assert (info.value.socket, info.value.waited_for, info.value.timeout) == (str(path), "hello reply", 0.5)
    assert info.value.code == 600


def test_cli_status_times_out_instead_of_hanging(tmp_path, capsys):
    from deepseek_flash.cli import main

    path = tmp_path / "s.sock"
    with silent_listener(path):
        rc = main(["status", "--runtime-dir", str(tmp_path / "no-tree"), "--socket", str(path),
                   "--timeout", "0.5"])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.startswith(f"deepseek-flash status: no answer from deepseek-flashd at {path}: waited 0.5 s "
                          f"for its hello reply")


def test_a_closing_client_does_not_reconnect(daemon_factory, tmp_path):
    store = packed_model(tmp_path, "tiny", num_layers=1)
    d = daemon_factory({"host_cache_bytes": "16MiB"}).start()
    client = d.client()
    info = client.open_model(str(store))
    lease = client.acquire(info, layer=0)
    assert d.stop() == 0
    # Stand in for systemd's socket unit: anything connecting now would "start the daemon".
    listener = silent_listener(d.socket)
    start = time.monotonic()
    client.release(lease)
    client.close_model(info)
    client.detach(info)
    client.close()
    assert time.monotonic() - start < 2
    listener.setblocking(False)
    with pytest.raises(BlockingIOError):
        listener.accept()           # nobody knocked
    listener.close()
