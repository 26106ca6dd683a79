"""Start the real ``deepseek-flashd`` against a temp tree (the fwupd way) and watch sd_notify.

Every root goes through environment variables (``DEEPSEEK_FLASH_RUNTIME_DIR``, ``_SOCKET``,
``_CONFIG``); ``NOTIFY_SOCKET`` is a datagram socket bound here, so the test sees exactly what
systemd would. On teardown the daemon's log is printed, which pytest shows for failing tests.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from deepseek_flash.ops.install_units import daemon_argv


def packed_model(root: Path, name: str, **kwargs) -> Path:
    from deepseek_flash.store import pack
    from deepseek_flash.testing import make_tiny_model

    src = make_tiny_model(root / f"{name}-src", **kwargs)
    (root / "stores").mkdir(exist_ok=True)
    return pack(src, root / "stores" / name)


def assert_eventually(predicate, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def raw_connection(socket_path, hello: bool = True, timeout: float = 10.0):
    """A bare socket to the daemon, after the versioned hello when ``hello``:
    (socket, hello reply or None, fds passed with it -- the caller closes them)."""
    from deepseek_flash import protocol

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(str(socket_path))
    reply, fds = None, []
    if hello:
        s.sendall(protocol.request(1, "hello", {"protocol": protocol.PROTOCOL_VERSION}))
        reply = protocol.recv_message(s, 1 << 20, fds)
    return s, reply, fds


def daemon_command() -> list[str]:
    return daemon_argv()


class Daemon:
    def __init__(self, workdir: Path, config: dict | None, *, env: dict | None = None):
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        # AF_UNIX paths are limited to 108 bytes: keep sockets in a short temp dir.
        self.short = Path(tempfile.mkdtemp(prefix="dfd-", dir="/tmp"))
        self.short.chmod(0o755)     # other users reach the socket only through a searchable dir
        self.runtime = self.short / "rt"
        self.socket = self.runtime / "control.sock"
        self.config_path = workdir / "flash.json"
        if config is not None:
            self.write_config(config)
        self.log_path = workdir / "daemon.log"
        self.notify_path = self.short / "notify.sock"
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(self.notify_path))
        self.notify.settimeout(0.05)
        self.messages: list[str] = []
        self.extra_env = env or {}
        self.proc: subprocess.Popen | None = None

    def write_config(self, config) -> None:
        text = config if isinstance(config, str) else json.dumps(config)
        self.config_path.write_text(text)

    @property
    def env(self) -> dict:
        env = dict(os.environ)
        for key in ("LISTEN_FDS", "LISTEN_PID", "WATCHDOG_USEC", "WATCHDOG_PID", "JOURNAL_STREAM"):
            env.pop(key, None)
        env.update(DEEPSEEK_FLASH_RUNTIME_DIR=str(self.runtime), DEEPSEEK_FLASH_SOCKET=str(self.socket),
                   DEEPSEEK_FLASH_CONFIG=str(self.config_path), NOTIFY_SOCKET=str(self.notify_path),
                   # Its own state (the learned import files, shards): kept across its restarts.
                   DEEPSEEK_FLASH_STATE_DIR=str(self.runtime / "state"), PYTHONUNBUFFERED="1",
                   # No package read ahead at each test daemon's start (tests/daemon/test_imports_ahead.py).
                   DEEPSEEK_FLASH_IMPORT_PACKAGES="")
        env.update(self.extra_env)
        return env

    def start(self, wait_ready: bool = True, args: list[str] = ()) -> Daemon:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 -- open for the daemon's life
        self.proc = subprocess.Popen([*daemon_command(), "--log-level", "debug", *args], env=self.env,
                                     stdout=self._log, stderr=subprocess.STDOUT)
        if wait_ready:
            self.wait_message("READY=1", timeout=30)
        return self

    def drain_notify(self) -> list[str]:
        while True:
            try:
                data = self.notify.recv(4096)
            except (TimeoutError, BlockingIOError):
                return self.messages
            self.messages.append(data.decode())

    def wait_message(self, needle: str, timeout: float = 10.0, after: int = 0) -> str:
        def found():
            self.drain_notify()
            if self.proc is not None and self.proc.poll() is not None and not any(
                    needle in m for m in self.messages[after:]):
                raise AssertionError(f"deepseek-flashd exited ({self.proc.returncode}) before sending "
                                     f"{needle!r}; log:\n{self.log()}")
            return next((m for m in self.messages[after:] if needle in m), None)
        return assert_eventually(found, timeout, f"sd_notify {needle!r}")

    def signal(self, sig) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 20.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def status_file(self, name: str = "status") -> dict:
        out = {}
        for line in (self.runtime / name).read_text().splitlines():
            key, _, value = line.partition(": ")
            out[key] = value
        return out

    def client(self, **kw):
        from deepseek_flash.client import Client

        return Client(self.socket, embedded=False, **kw)

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc is not None:
            self._log.close()
            print(f"--- deepseek-flashd log ({self.log_path}) ---\n{self.log()}")
        self.notify.close()
        shutil.rmtree(self.short, ignore_errors=True)


# --- fixtures (imported by the conftest files of tests/daemon and tests/client) ---------------

@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory):
    """4 decoder layers of ~148 KiB (norms 4 KiB, attn 48 KiB, gate_up 64 KiB, down 32 KiB)."""
    return packed_model(tmp_path_factory.mktemp("tiny"), "tiny", num_layers=4)


@pytest.fixture(scope="session")
def big_store(tmp_path_factory):
    """Layers of ~3.8 MiB: larger than a 1 MiB host budget."""
    return packed_model(tmp_path_factory.mktemp("big"), "big", num_layers=2, hidden_size=256,
                        intermediate_size=1024)


@pytest.fixture(scope="session")
def wide_store(tmp_path_factory):
    """4 decoder layers of ~964 KiB: two fit in a 2 MiB host budget."""
    return packed_model(tmp_path_factory.mktemp("wide"), "wide", num_layers=4, hidden_size=128,
                        intermediate_size=512)


@pytest.fixture
def daemon_factory(tmp_path):
    started = []

    def make(config: dict | None = None, **kw):
        d = Daemon(tmp_path / f"d{len(started)}", config, **kw)
        started.append(d)
        return d
    yield make
    for d in started:
        d.cleanup()
