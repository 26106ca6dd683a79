"""The control socket's wire format: frames, messages, the op list, and helpers for both ends.

A frame is a fixed 8-byte header followed by a msgpack payload::

    offset 0  2 bytes  magic  b"DF"
    offset 2  1 byte   protocol version (PROTOCOL_VERSION)
    offset 3  1 byte   flags (0; reserved, must be 0)
    offset 4  4 bytes  payload length, unsigned big-endian (<= max_frame_bytes, default 1 MiB)

Request payload: ``{"id": int, "op": str, "args": map}``. Reply payload: ``{"id": int, "ok": true,
"result": ...}`` or ``{"id": int, "ok": false, "error": {"code": int, "message": str, "fields": map}}``.
Every request gets exactly one reply; a reply whose request could not be parsed carries ``id: null``.
The first request must be ``hello``; its reply carries the host arena's fd (SCM_RIGHTS). Block
bytes never cross the socket: acquire replies carry arena offsets.
"""
from __future__ import annotations

import socket
import struct
import time
from typing import Any

import msgpack

from .errors import FlashError, FrameTooLarge, MalformedFrame, VersionMismatch, error_from_code

MAGIC = b"DF"
PROTOCOL_VERSION = 1
HEADER = struct.Struct(">2sBBI")
HEADER_SIZE = HEADER.size
DEFAULT_MAX_FRAME = 1 << 20

def pack_payload(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def encode(obj: Any, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    """One frame holding ``obj``; FrameTooLarge when the payload exceeds ``max_frame``."""
    payload = pack_payload(obj)
    if len(payload) > max_frame:
        raise FrameTooLarge(f"frame payload of {len(payload)} bytes exceeds the maximum of {max_frame}",
                            size=len(payload), limit=max_frame)
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, len(payload)) + payload


def request(req_id: int, op: str, args: dict | None = None, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    return encode({"id": req_id, "op": op, "args": args or {}}, max_frame)


def reply_ok(req_id, result, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    return encode({"id": req_id, "ok": True, "result": result}, max_frame)


def reply_error(req_id, error: FlashError) -> bytes:
    # Error replies are small by construction; never fail to report a failure for its size.
    return encode({"id": req_id, "ok": False, "error": error.to_wire()}, 1 << 31)


def parse_header(header: bytes, max_frame: int) -> int:
    """Payload length from a header; MalformedFrame / VersionMismatch / FrameTooLarge otherwise."""
    magic, version, flags, length = HEADER.unpack(header)
    if magic != MAGIC:
        raise MalformedFrame(f"bad frame magic {magic!r} (expected {MAGIC!r})", magic=magic.hex())
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(f"frame of protocol version {version}; this side speaks {PROTOCOL_VERSION}",
                              version=version, supported=PROTOCOL_VERSION)
    if flags != 0:
        raise MalformedFrame(f"frame flags {flags:#04x} set; none are defined", flags=flags)
    if length > max_frame:
        raise FrameTooLarge(f"frame payload of {length} bytes exceeds the maximum of {max_frame}",
                            size=length, limit=max_frame)
    return length


def unpack_payload(payload: bytes) -> Any:
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise MalformedFrame(f"frame payload is not msgpack: {exc}") from exc


class FrameDecoder:
    """Incremental decoder: ``feed`` bytes, get whole payloads. Header errors are fatal (the stream
    cannot be resynchronised); the decoder then stays failed."""

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME):
        self.max_frame = max_frame
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        if not self._buf and len(data) >= HEADER_SIZE:
            # The common case: exactly one whole request arrived; no buffer copies.
            length = parse_header(data[:HEADER_SIZE], self.max_frame)
            if len(data) == HEADER_SIZE + length:
                return [data[HEADER_SIZE:]]
        self._buf += data
        frames = []
        buf = self._buf
        pos = 0
        while len(buf) - pos >= HEADER_SIZE:
            length = parse_header(bytes(buf[pos:pos + HEADER_SIZE]), self.max_frame)
            end = pos + HEADER_SIZE + length
            if len(buf) < end:
                break
            frames.append(bytes(buf[pos + HEADER_SIZE:end]))
            pos = end
        if pos:
            del buf[:pos]
        return frames

    @property
    def pending(self) -> int:
        return len(self._buf)


def parse_request(payload: bytes) -> tuple[Any, str, dict]:
    """(id, op, args) of a request payload; MalformedFrame names what is wrong (with the id if any)."""
    msg = unpack_payload(payload)
    if not isinstance(msg, dict):
        raise MalformedFrame(f"request must be a map, not {type(msg).__name__}")
    req_id = msg.get("id")
    if not isinstance(req_id, int) or isinstance(req_id, bool):
        raise MalformedFrame(f"request id must be an integer, not {req_id!r}")
    op = msg.get("op")
    args = msg.get("args", {})
    if not isinstance(op, str):
        raise MalformedFrame(f"request {req_id}: op must be a string, not {op!r}", id=req_id)
    if not isinstance(args, dict):
        raise MalformedFrame(f"request {req_id}: args must be a map", id=req_id)
    return req_id, op, args


def result_of(reply: dict) -> Any:
    """The result of a reply map, or raise its error as the typed exception."""
    if reply.get("ok"):
        return reply.get("result")
    err = reply.get("error") or {}
    raise error_from_code(int(err.get("code", 1)), str(err.get("message", "error")), err.get("fields"))


# --- blocking helpers for the client side --------------------------------------------------------

def recv_exact(sock: socket.socket, n: int, fds: list | None = None) -> bytes:
    """Read exactly ``n`` bytes (collecting SCM_RIGHTS fds into ``fds`` when given)."""
    chunks = []
    remaining = n
    while remaining:
        if fds is not None:
            data, got_fds, _flags, _addr = socket.recv_fds(sock, remaining, 4)
            fds.extend(got_fds)
        else:
            data = sock.recv(remaining)
        if not data:
            raise ConnectionResetError("connection closed by the daemon")
        chunks.append(data)
        remaining -= len(data)
    return b"".join(chunks)


def recv_message(sock: socket.socket, max_frame: int, fds: list | None = None) -> Any:
    header = recv_exact(sock, HEADER_SIZE, fds)
    length = parse_header(header, max_frame)
    return unpack_payload(recv_exact(sock, length, fds) if length else b"")


class MessageReader:
    """Blocking reader of whole messages with one ``recv`` per reply in the common case (the
    round-trip latency of a small request is mostly syscalls and wake-ups)."""

    def __init__(self, sock: socket.socket, max_frame: int, spin_us: float = 0.0):
        self.sock = sock
        self.max_frame = max_frame
        self._buf = bytearray()
        # Poll this long before sleeping in recv: on VMs a cross-CPU wake-up costs tens of
        # microseconds, more than a warm reply takes to arrive.
        self.spin_ns = int(spin_us * 1000)

    def read(self) -> Any:
        buf = self._buf
        while True:
            if len(buf) >= HEADER_SIZE:
                length = parse_header(bytes(buf[:HEADER_SIZE]), self.max_frame)
                end = HEADER_SIZE + length
                if len(buf) >= end:
                    payload = bytes(buf[HEADER_SIZE:end])
                    del buf[:end]
                    return unpack_payload(payload)
            data = self._recv()
            if not data:
                raise ConnectionResetError("connection closed by the daemon")
            buf += data

    def _recv(self) -> bytes:
        if self.spin_ns:
            deadline = time.perf_counter_ns() + self.spin_ns
            while time.perf_counter_ns() < deadline:
                try:
                    return self.sock.recv(1 << 16, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    continue
        return self.sock.recv(1 << 16)
