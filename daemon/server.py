"""The control socket: a single-threaded epoll event loop serving every client.

Each connection has its own read decoder and write buffer and the loop never blocks on one client:
sockets are non-blocking, and an acquire that must wait for disk IO returns a Future that the
block manager's completion thread resolves; the done-callback queues the reply and wakes the loop
through a pipe (the same pipe ``signal.set_wakeup_fd`` writes to, so signals wake it too).

``Operations`` turns wire requests into ``BlockManager`` calls and results into wire maps; the
embedded client runs the very same object in its own process, so both modes answer alike.
Socket setup lives here as well: systemd socket activation (``LISTEN_FDS``), else binding the
path with the configured mode and group, refusing to start when another daemon serves it.
"""
from __future__ import annotations

import collections
import errno
import fcntl
import grp
import logging
import os
import select
import socket
import struct
import time
from concurrent.futures import Future
from pathlib import Path

from .. import __version__
from ..errors import (
    ConfigError,
    DaemonAlreadyRunning,
    FlashError,
    LimitExceeded,
    MalformedFrame,
    PermissionDenied,
    ProtocolError,
    ShuttingDown,
    UnknownClient,
    UnknownOperation,
    VersionMismatch,
)
from ..protocol import PROTOCOL_VERSION, FrameDecoder, parse_request, reply_error, reply_ok
from ..wire import OPS, Lease
from .block_manager import BlockManager

log = logging.getLogger("deepseek_flash.server")

# Hang-ups and errors are delivered as readable: recv then reports them.
_READABLE = select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR | select.EPOLLRDHUP

# A client that stops reading its replies is cut off past this much queued output, so its
# backlog cannot grow the daemon without bound.
MAX_WRITE_BACKLOG = 64 << 20


def _arg(op: str, args: dict, name: str, kind, required: bool = True, default=None):
    if name not in args or args[name] is None:
        if required:
            raise MalformedFrame(f"{op}: argument {name!r} is missing", op=op, argument=name)
        return default
    value = args[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise MalformedFrame(f"{op}: argument {name!r} has the wrong type ({type(value).__name__})",
                             op=op, argument=name)
    return value


class Operations:
    """The op table: ``call(client_id, op, args)`` -> a wire result, or a Future of one."""

    def __init__(self, manager: BlockManager, status=None, on_tunable=None, attachments=None):
        self.manager = manager
        self.attachments = attachments
        self._status = status or manager.snapshot
        self._on_tunable = on_tunable
        self._table = {op: getattr(self, "op_" + op) for op in OPS if op != "hello"}

    def register(self, op: str, handler) -> None:
        """Add an operation served by ``handler(client_id, args) -> result | Future`` (the tiers
        above the host tier -- GPU fabric, model attach -- plug in here; both modes see it)."""
        if op in self._table or op == "hello":
            raise ValueError(f"operation {op!r} is already defined")
        self._table[op] = handler

    def call(self, client_id: int, op: str, args: dict):
        try:
            handler = self._table[op]
        except KeyError:
            raise UnknownOperation(f"unknown operation {op!r}; known: hello, {', '.join(self._table)}",
                                   op=op) from None
        return handler(client_id, args)

    def op_list_models(self, cid, args):
        return self.manager.list_models()

    def op_open_model(self, cid, args):
        name = _arg("open_model", args, "model", str)
        context = _arg("open_model", args, "flash_context", dict, required=False, default={})
        return self.manager.open_model(cid, name, context).to_wire()

    def op_close_model(self, cid, args):
        return {"released": self.manager.close_model(cid, _arg("close_model", args, "model", str))}

    def op_acquire(self, cid, args):
        model = _arg("acquire", args, "model", str)
        blocks = _arg("acquire", args, "blocks", list, required=False)
        layer = _arg("acquire", args, "layer", int, required=False)
        priority = _arg("acquire", args, "priority", int, required=False, default=0)
        wait = _arg("acquire", args, "wait", bool, required=False, default=True)
        future = self.manager.acquire_async(cid, model, blocks, layer, priority, wait)
        if future.done():
            return future.result().to_wire()
        return _chain(future, Lease.to_wire)

    def op_release(self, cid, args):
        self.manager.release(cid, _arg("release", args, "lease", int))

    def op_prefetch(self, cid, args):
        model = _arg("prefetch", args, "model", str)
        layers = _arg("prefetch", args, "layers", list, required=False, default=[])
        blocks = _arg("prefetch", args, "blocks", list, required=False, default=[])
        return {"scheduled": self.manager.prefetch(model, layers, blocks, client_id=cid)}

    def op_status(self, cid, args):
        return self._status()

    def op_stats(self, cid, args):
        return self.manager.stats()

    def op_get_tunable(self, cid, args):
        key = _arg("get_tunable", args, "key", str, required=False)
        tunables = self.manager.config.tunables()
        if key is None:
            return tunables
        if key not in tunables:
            raise ConfigError(f"unknown tunable {key!r}; tunables: {', '.join(tunables)}", key=key,
                              value=None, allowed=list(tunables))
        return tunables[key]

    def op_set_tunable(self, cid, args):
        key = _arg("set_tunable", args, "key", str)
        if "value" not in args:
            raise MalformedFrame("set_tunable: argument 'value' is missing", op="set_tunable",
                                 argument="value")
        old, new = self.manager.set_tunable(key, args["value"])
        log.info("tunable %s: %r -> %r (client %s)", key, old, new, cid)
        if self._on_tunable:
            self._on_tunable(key, new)
        return {"key": key, "old": old, "new": new}

    def op_load(self, cid, args):
        name = _arg("load", args, "model", str)
        wait = _arg("load", args, "wait", bool, required=False, default=True)
        info = self.manager.open_model(cid, name, None)
        future = self.manager.load(info.name, client_id=cid)
        if future.done() or not wait:
            return future.result() if future.done() else {"model": info.name, "started": True}
        return future

    def op_unload(self, cid, args):
        model = _arg("unload", args, "model", str)
        tier = _arg("unload", args, "tier", str, required=False, default="all")
        if tier not in ("all", "device"):
            raise MalformedFrame(f"unload: tier must be 'all' or 'device', not {tier!r}",
                                 op="unload", argument="tier")
        freed = self.attachments.unload(model) if self.attachments is not None else 0
        if tier == "device":
            return {"model": model, "freed_device_bytes": freed}
        return {**self.manager.unload(model), "freed_device_bytes": freed}

    def op_attach(self, cid, args):
        """A model's memory on a device for this client (see ``daemon.loader.Attachments``)."""
        model = _arg("attach", args, "model", str)
        device = args.get("device", "cpu")
        if device != "cpu" and (not isinstance(device, int) or isinstance(device, bool) or device < 0):
            raise MalformedFrame(f"attach: device must be 'cpu' or a CUDA index, not {device!r}",
                                 op="attach", argument="device")
        budget = _arg("attach", args, "weight_budget", int, required=False)
        ipc = _arg("attach", args, "ipc", bool, required=False, default=True)
        if self.attachments is None:
            raise UnknownOperation("attach: this controller has no device tier", op="attach")
        return self.attachments.attach(cid, model, device, budget, ipc=ipc)

    def op_detach(self, cid, args):
        if self.attachments is not None:
            self.attachments.detach(cid, _arg("detach", args, "model", str, required=False))

    def op_profile(self, cid, args):
        """Completed block loads requested by process ``pid`` (flash-profiler): those after
        sequence ``after`` and wall time ``since``; ``require_connected`` (default true) makes a
        pid with no connected client an UnknownClient error. ``last_seq``: the newest sequence
        number recorded for anyone (where a new window starts)."""
        pid = _arg("profile", args, "pid", int)
        after = _arg("profile", args, "after", int, required=False, default=0)
        since = args.get("since", 0.0)
        if isinstance(since, bool) or not isinstance(since, (int, float)):
            raise MalformedFrame("profile: argument 'since' must be a number", op="profile",
                                 argument="since")
        limit = _arg("profile", args, "limit", int, required=False, default=10_000)
        clients = self.manager.clients_of_pid(pid)
        if not clients and _arg("profile", args, "require_connected", bool, required=False, default=True):
            raise UnknownClient(f"no client of pid {pid} is connected to this controller", pid=pid)
        fields = ("seq", "time", "client", "pid", "model", "block", "layer", "role", "latency_us",
                  "bytes")
        ring = self.manager.load_log
        return {"now": time.time(), "clients": clients, "fields": list(fields),
                "last_seq": ring[-1][0] if ring else 0,
                "samples": [list(s) for s in self.manager.load_samples(pid, after, float(since), limit)]}

    def op_report_stream(self, cid, args):
        """A streaming client's prefetch counters (hits, misses, stalls, window, decisions)."""
        model = _arg("report_stream", args, "model", str)
        stats = _arg("report_stream", args, "stats", dict)
        self.manager.report_stream(cid, model, stats)


def _chain(future: Future, convert) -> Future:
    out: Future = Future()

    def done(f):
        exc = f.exception()
        if exc is not None:
            out.set_exception(exc)
        else:
            out.set_result(convert(f.result()))
    future.add_done_callback(done)
    return out


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


# --- the event loop ---------------------------------------------------------------------------------

class _Conn:
    __slots__ = (
        "client_id",
        "closing",
        "decoder",
        "denied",
        "gid",
        "name",
        "outstanding",
        "pid",
        "sock",
        "uid",
        "want_write",
        "wbuf",
    )

    def __init__(self, sock, max_frame, creds):
        self.sock = sock
        self.decoder = FrameDecoder(max_frame)
        self.wbuf = bytearray()
        self.client_id = None
        self.pid, self.uid, self.gid = creds
        self.closing = False
        self.outstanding = 0
        self.want_write = False
        self.name = f"pid {self.pid} uid {self.uid}"
        self.denied: PermissionDenied | None = None


class Server:
    """Serve ``ops`` on ``listeners``; ``arena`` is announced (fd + size) in every hello reply."""

    def __init__(self, ops: Operations, listeners: list[socket.socket], arena, max_frame: int,
                 allowed_gid: int, max_outstanding=lambda: 64):
        self.ops = ops
        self.manager = ops.manager
        self.arena = arena
        self.max_frame = max_frame
        self.allowed_gid = allowed_gid
        self.max_outstanding = max_outstanding
        # epoll directly (not ``selectors``): the loop's per-event overhead is a visible part of a
        # ~50 us round trip. ``_fds`` maps fd -> listener socket | "wake" | _Conn.
        self.epoll = select.epoll()
        self._fds: dict = {}
        self.listeners = list(listeners)
        for lst in self.listeners:
            lst.setblocking(False)
            self._register(lst.fileno(), select.EPOLLIN, lst)
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._register(self.wake_r, select.EPOLLIN, "wake")
        self.conns: dict[int, _Conn] = {}
        self._done: collections.deque = collections.deque()
        self.draining = False

    # --- loop ---------------------------------------------------------------------------------
    def _register(self, fd: int, mask: int, data) -> None:
        self.epoll.register(fd, mask)
        self._fds[fd] = data

    def _unregister(self, fd: int) -> None:
        if self._fds.pop(fd, None) is not None:
            self.epoll.unregister(fd)

    def wake(self) -> None:
        try:
            os.write(self.wake_w, b"\0")
        except BlockingIOError:
            pass   # the pipe is full: the loop is already due to wake

    def serve_once(self, timeout: float | None) -> None:
        try:
            events = self.epoll.poll(-1 if timeout is None else timeout)
        except InterruptedError:
            events = ()
        for fd, mask in events:
            data = self._fds.get(fd)
            if data is None:
                continue
            if isinstance(data, _Conn):
                if mask & _READABLE:
                    self._readable(data)
                if mask & select.EPOLLOUT and data.sock.fileno() >= 0:
                    self._flush(data)
            elif data == "wake":
                try:
                    while os.read(self.wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            else:
                self._accept(data)
        self._finish_async()

    def stop_accepting(self) -> None:
        for lst in self.listeners:
            self._unregister(lst.fileno())
            lst.close()
        self.listeners = []

    def drain(self, timeout: float = 5.0) -> None:
        """Finish in-flight replies (up to ``timeout``), then close every client."""
        self.stop_accepting()
        self.draining = True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            busy = [c for c in self.conns.values() if c.outstanding or c.wbuf]
            if not busy:
                break
            self.serve_once(0.05)
        for conn in list(self.conns.values()):
            self._close(conn)

    def close(self) -> None:
        self.epoll.close()
        os.close(self.wake_r)
        os.close(self.wake_w)

    # --- connections --------------------------------------------------------------------------
    def _accept(self, listener) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("accept failed: %s", exc)
                return
            sock.setblocking(False)
            try:
                creds = peer_credentials(sock)
            except OSError:
                sock.close()
                continue
            conn = _Conn(sock, self.max_frame, creds)
            self.conns[sock.fileno()] = conn
            self._register(sock.fileno(), select.EPOLLIN, conn)
            if not peer_allowed(conn.pid, conn.uid, conn.gid, self.allowed_gid):
                log.warning("refusing %s: not root, not the daemon's user, not in group %d",
                            conn.name, self.allowed_gid)
                # Answered at its first request, so the refusal is the reply to its hello (closing
                # now, with its hello unread, would reset the connection and lose the reason).
                conn.denied = PermissionDenied(
                    f"uid {conn.uid} (gid {conn.gid}) may not use this daemon: not in group "
                    f"{self.allowed_gid} (socket_group)", uid=conn.uid, gid=conn.gid)

    def _close(self, conn: _Conn) -> None:
        if conn.sock.fileno() < 0:
            return
        self.conns.pop(conn.sock.fileno(), None)
        self._unregister(conn.sock.fileno())
        conn.sock.close()
        if conn.client_id is not None:
            self.manager.disconnect(conn.client_id)
            conn.client_id = None

    def _readable(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        if conn.closing:
            return   # a refused or failed connection: ignore what it still sends
        try:
            payloads = conn.decoder.feed(data)
        except FlashError as exc:
            # The header is unreadable: the stream cannot be re-synchronised.
            self._fail(conn, None, exc)
            return
        for payload in payloads:
            self._request(conn, payload)
            if conn.closing or conn.sock.fileno() < 0:
                return

    def _request(self, conn: _Conn, payload: bytes) -> None:
        if conn.denied is not None:
            try:
                req_id = parse_request(payload)[0]
            except MalformedFrame:
                req_id = None
            self._fail(conn, req_id, conn.denied)
            return
        try:
            req_id, op, args = parse_request(payload)
        except MalformedFrame as exc:
            self._send(conn, reply_error(exc.fields.get("id"), exc))
            return
        if conn.client_id is None:
            self._hello(conn, req_id, op, args)
            return
        if op == "hello":
            self._send(conn, reply_error(req_id, ProtocolError("hello was already done on this connection")))
            return
        if self.draining:
            self._send(conn, reply_error(req_id, ShuttingDown("the daemon is stopping; reconnect to its "
                                                              "successor")))
            return
        if conn.outstanding >= self.max_outstanding():
            self._send(conn, reply_error(req_id, LimitExceeded(
                f"{conn.outstanding} requests in flight, the maximum "
                f"(max_outstanding_requests_per_client)", limit=self.max_outstanding())))
            return
        try:
            result = self.ops.call(conn.client_id, op, args)
        except FlashError as exc:
            self._send(conn, reply_error(req_id, exc))
            return
        except Exception as exc:
            log.exception("%s from %s failed", op, conn.name)
            self._send(conn, reply_error(req_id, FlashError(f"{op}: internal error: {exc!r}")))
            return
        if isinstance(result, Future) or (hasattr(result, "add_done_callback") and not result.done()):
            conn.outstanding += 1
            result.add_done_callback(lambda f, c=conn, r=req_id: self._async_done(c, r, f))
            return
        self._reply(conn, req_id, result)

    def _reply(self, conn: _Conn, req_id, result) -> None:
        try:
            frame = reply_ok(req_id, result, self.max_frame)
        except FlashError as exc:
            frame = reply_error(req_id, exc)
        self._send(conn, frame)

    def _async_done(self, conn, req_id, future) -> None:
        # On the IO completion thread: hand over to the loop.
        self._done.append((conn, req_id, future))
        self.wake()

    def _finish_async(self) -> None:
        while self._done:
            conn, req_id, future = self._done.popleft()
            conn.outstanding -= 1
            if conn.sock.fileno() < 0:
                continue
            exc = future.exception()
            if exc is None:
                self._reply(conn, req_id, future.result())
            elif isinstance(exc, FlashError):
                self._send(conn, reply_error(req_id, exc))
            else:
                log.error("request %s of %s failed: %r", req_id, conn.name, exc)
                self._send(conn, reply_error(req_id, FlashError(f"internal error: {exc!r}")))

    def _hello(self, conn: _Conn, req_id, op, args) -> None:
        if op != "hello":
            self._fail(conn, req_id, ProtocolError(f"the first request must be 'hello', not {op!r}"))
            return
        version = args.get("protocol")
        if version != PROTOCOL_VERSION:
            self._fail(conn, req_id, VersionMismatch(
                f"client speaks protocol {version!r}; this daemon speaks {PROTOCOL_VERSION}",
                version=version if isinstance(version, int) else str(version), supported=PROTOCOL_VERSION))
            return
        name = args.get("client")
        conn.client_id = self.manager.connect({"pid": conn.pid, "uid": conn.uid,
                                               "name": name if isinstance(name, str) else None})
        if isinstance(name, str):
            conn.name = f"{name} (pid {conn.pid})"
        frame = reply_ok(req_id, {"protocol": PROTOCOL_VERSION, "version": __version__,
                                  "client_id": conn.client_id, "pid": os.getpid(),
                                  "arena_size": self.arena.size, "max_frame_bytes": self.max_frame})
        if conn.wbuf:
            self._flush(conn)
        if conn.wbuf:
            self._fail(conn, req_id, ProtocolError("cannot attach the arena fd: replies are backed up"))
            return
        try:
            sent = socket.send_fds(conn.sock, [frame], [self.arena.fd])
        except BlockingIOError:
            self._fail(conn, req_id, ProtocolError("cannot send the arena fd now; reconnect"))
            return
        except OSError:
            self._close(conn)
            return
        if sent < len(frame):
            self._queue(conn, frame[sent:])

    def _fail(self, conn: _Conn, req_id, exc: FlashError) -> None:
        """Reply with ``exc`` and close the connection once the reply is out."""
        conn.closing = True
        self._send(conn, reply_error(req_id, exc))

    def _send(self, conn: _Conn, frame: bytes) -> None:
        if not conn.wbuf:
            try:
                sent = conn.sock.send(frame)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._close(conn)
                return
            if sent == len(frame):
                if conn.closing:
                    self._close(conn)
                return
            frame = frame[sent:]
        self._queue(conn, frame)

    def _queue(self, conn: _Conn, data: bytes) -> None:
        conn.wbuf += data
        if len(conn.wbuf) > MAX_WRITE_BACKLOG:
            log.warning("closing %s: %d bytes of replies unread", conn.name, len(conn.wbuf))
            self._close(conn)
            return
        if not conn.want_write:
            conn.want_write = True
            self.epoll.modify(conn.sock.fileno(), select.EPOLLIN | select.EPOLLOUT)

    def _flush(self, conn: _Conn) -> None:
        while conn.wbuf:
            try:
                sent = conn.sock.send(conn.wbuf)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._close(conn)
                return
            del conn.wbuf[:sent]
        if conn.want_write and conn.sock.fileno() >= 0:
            conn.want_write = False
            self.epoll.modify(conn.sock.fileno(), select.EPOLLIN)
        if conn.closing:
            self._close(conn)
