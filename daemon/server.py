"""The control socket: a single-threaded epoll event loop serving every client.

Each connection has its own read decoder and write buffer and the loop never blocks on one client:
sockets are non-blocking, and an acquire that must wait for disk IO returns a Future that the
block manager's completion thread resolves; the done-callback queues the reply and wakes the loop
through a pipe (the same pipe ``signal.set_wakeup_fd`` writes to, so signals wake it too).

Requests go to the op table (``daemon.operations``); socket setup and peer credentials live in
``daemon.sockets``.
"""
from __future__ import annotations

import collections
import logging
import os
import select
import socket
import time
from concurrent.futures import Future

from .. import __version__
from ..errors import (
    FlashError,
    LimitExceeded,
    MalformedFrame,
    PermissionDenied,
    ProtocolError,
    ShuttingDown,
    VersionMismatch,
)
from ..protocol import PROTOCOL_VERSION, FrameDecoder, parse_request, reply_error, reply_ok
from .operations import Operations
from .sockets import peer_allowed, peer_credentials

log = logging.getLogger("deepseek_flash.server")

# Hang-ups and errors are delivered as readable: recv then reports them.
_READABLE = select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR | select.EPOLLRDHUP

# A client that stops reading its replies is cut off past this much queued output, so its
# backlog cannot grow the daemon without bound.
MAX_WRITE_BACKLOG = 64 << 20


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
        hello = {"protocol": PROTOCOL_VERSION, "version": __version__, "client_id": conn.client_id,
                 "pid": os.getpid(), "arena_size": self.arena.size, "max_frame_bytes": self.max_frame}
        cache = getattr(getattr(self.ops, "imports_ahead", None), "bytecode_dir", None)
        if cache is not None:
            hello["bytecode_cache"] = cache     # compiled modules a client may read (deepseek_flash.bytecode)
        frame = reply_ok(req_id, hello)
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
