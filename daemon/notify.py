"""Tell the service manager what the daemon is doing (the sd_notify protocol).

``Notifier`` sends ``READY=1``, ``STATUS=...``, ``RELOADING=1``, ``STOPPING=1`` and
``WATCHDOG=1`` datagrams to ``$NOTIFY_SOCKET``. It goes through systemd-python's
``systemd.daemon.notify`` (libsystemd's ``sd_notify``) when that package is installed and the
address is the process's own ``NOTIFY_SOCKET``, and through a plain ``AF_UNIX`` datagram socket
otherwise -- the protocol is one datagram of newline-separated ``KEY=value`` lines, so the
fallback is complete, not a degraded mode. Without ``NOTIFY_SOCKET`` (the daemon started by hand
or by a test) every call is a no-op that returns ``False``.

Failures to notify are logged and never raised: a daemon that serves clients must not die
because its supervisor's socket went away.
"""
from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger("deepseek_flash.notify")

BACKENDS = ("auto", "systemd", "socket")


class Notifier:
    """sd_notify sender for one daemon process.

    ``environ`` defaults to ``os.environ``; ``backend`` is ``"auto"`` (systemd-python when it can
    serve the address, else the socket), ``"systemd"`` (required; raises ``ImportError`` when
    systemd-python is missing) or ``"socket"``.
    """

    def __init__(self, environ: Mapping[str, str] | None = None, backend: str = "auto"):
        if backend not in BACKENDS:
            raise ValueError(f"notify backend {backend!r}: choose one of {', '.join(BACKENDS)}")
        env = os.environ if environ is None else environ
        self.address: str | None = env.get("NOTIFY_SOCKET") or None
        self._watchdog_usec = env.get("WATCHDOG_USEC")
        self._watchdog_pid = env.get("WATCHDOG_PID")
        self._sd_notify = None
        # libsystemd reads NOTIFY_SOCKET from the process environment, so it can only serve the
        # address this Notifier was given when the two agree.
        libsystemd_serves = self.address is not None and os.environ.get("NOTIFY_SOCKET") == self.address
        if backend == "systemd" and self.address is not None and not libsystemd_serves:
            raise ValueError(f"notify backend 'systemd' sends to the process's NOTIFY_SOCKET, "
                             f"not to {self.address!r}")
        if backend != "socket" and libsystemd_serves:
            try:
                from systemd import daemon as sd_daemon
            except ImportError:
                if backend == "systemd":
                    raise
            else:
                self._sd_notify = sd_daemon.notify
        self.backend = "none" if self.address is None else ("systemd" if self._sd_notify else "socket")

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, **fields: str | int) -> bool:
        """Send ``KEY=value`` fields in one datagram; True when it was delivered."""
        if self.address is None:
            return False
        message = "\n".join(f"{key}={_one_line(value)}" for key, value in fields.items())
        try:
            if self._sd_notify is not None:
                return bool(self._sd_notify(message))
            return self._send_datagram(message.encode())
        except OSError as exc:
            log.warning("sd_notify to %s failed: %s (message %r)", self.address, exc, message)
            return False

    def _send_datagram(self, payload: bytes) -> bool:
        address = self.address
        if address.startswith("@"):
            # Abstract namespace: the leading '@' stands for a NUL byte.
            address = "\0" + address[1:]
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(payload)
        return True

    def ready(self, status: str | None = None) -> bool:
        """Startup (or a reload) finished; the daemon serves requests."""
        fields = {"READY": 1}
        if status is not None:
            fields["STATUS"] = status
        return self.send(**fields)

    def status(self, text: str) -> bool:
        """Free-form one-line state, shown by ``systemctl status`` as ``Status:``."""
        return self.send(STATUS=text)

    def reloading(self, status: str | None = None) -> bool:
        """A configuration reload began; follow with ``ready()`` when it is done."""
        fields = {"RELOADING": 1}
        if status is not None:
            fields["STATUS"] = status
        return self.send(**fields)

    def stopping(self, status: str | None = None) -> bool:
        """Shutdown began (systemd then waits for the exit instead of calling it a crash)."""
        fields = {"STOPPING": 1}
        if status is not None:
            fields["STATUS"] = status
        return self.send(**fields)

    def watchdog(self) -> bool:
        """Keep-alive; send at least every ``watchdog_interval() / 2`` seconds."""
        return self.send(WATCHDOG=1)

    def watchdog_interval(self) -> float | None:
        """The service's ``WatchdogSec=`` in seconds, or None when this process has no watchdog.

        ``WATCHDOG_PID`` names the process the watchdog is meant for; a child that inherited the
        variables must not answer for its parent.
        """
        if not self._watchdog_usec:
            return None
        if self._watchdog_pid and self._watchdog_pid != str(os.getpid()):
            return None
        try:
            usec = int(self._watchdog_usec)
        except ValueError:
            log.warning("ignoring WATCHDOG_USEC=%r: not an integer", self._watchdog_usec)
            return None
        return usec / 1e6 if usec > 0 else None


def _one_line(value: str | int) -> str:
    # A newline would start a new KEY=value field inside the datagram.
    return str(value).replace("\n", " ")
