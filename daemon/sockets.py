"""The control socket's edges: systemd socket activation, binding with mode and group, the
lock against a second daemon, and peer credentials (SO_PEERCRED) checked against the group.
"""
from __future__ import annotations

import errno
import fcntl
import grp
import logging
import os
import socket
import struct
from pathlib import Path

from ..errors import ConfigError, DaemonAlreadyRunning

log = logging.getLogger("deepseek_flash.server")


# --- peer credentials ------------------------------------------------------------------------------

def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


def resolve_group(group) -> int:
    """The gid of ``socket_group`` (name or number); the daemon's own gid when null."""
    if group is None:
        return os.getgid()
    if isinstance(group, int):
        return group
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"socket_group: no group named {group!r} on this system", key="socket_group",
                          value=group, allowed="an existing group") from None


def _supplementary_groups(pid: int) -> set[int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except OSError:
        pass
    return set()


def peer_allowed(pid: int, uid: int, gid: int, allowed_gid: int) -> bool:
    """Root and the daemon's own user always; others when the configured group is theirs
    (primary, or supplementary as the kernel reports it for that process)."""
    if uid == 0 or uid == os.getuid():
        return True
    return gid == allowed_gid or allowed_gid in _supplementary_groups(pid)


# --- listening sockets ------------------------------------------------------------------------------

def activation_sockets(environ=os.environ) -> list[socket.socket]:
    """Sockets passed by systemd (``LISTEN_FDS`` for this pid), or an empty list."""
    if environ.get("LISTEN_PID") != str(os.getpid()):
        return []
    count = int(environ.get("LISTEN_FDS", "0") or 0)
    socks = []
    for fd in range(3, 3 + count):
        os.set_inheritable(fd, False)
        sock = socket.socket(fileno=fd)
        sock.setblocking(False)
        socks.append(sock)
    for key in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        environ.pop(key, None)
    return socks


class SocketLock:
    """An flock beside the socket path: held for the daemon's life, so two daemons starting at
    once cannot both decide the socket is stale."""

    def __init__(self, socket_path: Path):
        self.path = Path(str(socket_path) + ".lock")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise DaemonAlreadyRunning(f"another deepseek-flashd holds {self.path} (it serves "
                                       f"{socket_path})", socket=str(socket_path)) from None

    def release(self):
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self.fd)


def bind_socket(path: Path, mode: int, gid: int | None) -> socket.socket:
    """Bind the control socket at ``path``; DaemonAlreadyRunning if a live daemon answers there,
    a stale socket file is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        if not path.is_socket():
            raise DaemonAlreadyRunning(f"{path} exists and is not a socket; refusing to replace it",
                                       socket=str(path))
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(1.0)
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            log.info("removing stale socket %s", path)
            path.unlink(missing_ok=True)
        except OSError as exc:
            raise DaemonAlreadyRunning(f"{path}: cannot tell whether a daemon serves it ({exc})",
                                       socket=str(path)) from None
        else:
            raise DaemonAlreadyRunning(f"another deepseek-flashd is serving {path}", socket=str(path))
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
    old = os.umask(0o177)   # no window in which the socket is wider than its final mode
    try:
        sock.bind(str(path))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise DaemonAlreadyRunning(f"another deepseek-flashd is serving {path}", socket=str(path)) from None
        raise
    finally:
        os.umask(old)
    if gid is not None and gid != os.getgid():
        os.chown(path, -1, gid)
    os.chmod(path, mode)
    sock.listen(256)
    return sock
