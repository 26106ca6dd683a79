"""Frame format: header fields, incremental decoding, and every way a frame can be wrong."""
import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepseek_flash import protocol
from deepseek_flash.errors import FrameTooLarge, LeaseError, MalformedFrame, UnknownBlock, VersionMismatch


def test_header_layout_is_big_endian_magic_version_flags_length():
    frame = protocol.request(7, "stats", {})
    assert frame[:2] == b"DF"
    assert frame[2] == protocol.PROTOCOL_VERSION
    assert frame[3] == 0
    (length,) = struct.unpack(">I", frame[4:8])
    assert length == len(frame) - 8
    assert msgpack.unpackb(frame[8:]) == {"id": 7, "op": "stats", "args": {}}


def test_decoder_reassembles_byte_by_byte_and_batches():
    frames = [protocol.request(i, "acquire", {"model": "m", "blocks": list(range(i))}) for i in range(5)]
    stream = b"".join(frames)
    dec = protocol.FrameDecoder()
    got = []
    for i in range(len(stream)):
        got += dec.feed(stream[i:i + 1])
    assert [protocol.parse_request(p) for p in got] == [
        (i, "acquire", {"model": "m", "blocks": list(range(i))}) for i in range(5)]
    assert dec.pending == 0
    assert len(protocol.FrameDecoder().feed(stream)) == 5


@settings(max_examples=50, deadline=None)
@given(st.lists(st.binary(max_size=300), min_size=1, max_size=8), st.data())
def test_decoder_any_chunking(payloads, data):
    stream = b"".join(protocol.encode(p) for p in payloads)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    dec = protocol.FrameDecoder()
    out, start = [], 0
    for cut in [*cuts, len(stream)]:
        out += dec.feed(stream[start:cut])
        start = cut
    assert [protocol.unpack_payload(p) for p in out] == payloads


def test_bad_magic():
    frame = bytearray(protocol.request(1, "stats"))
    frame[:2] = b"XX"
    with pytest.raises(MalformedFrame, match="magic"):
        protocol.FrameDecoder().feed(bytes(frame))


def test_wrong_version():
    frame = bytearray(protocol.request(1, "stats"))
    frame[2] = protocol.PROTOCOL_VERSION + 1
    with pytest.raises(VersionMismatch) as info:
        protocol.FrameDecoder().feed(bytes(frame))
    assert info.value.code == 303 and info.value.supported == protocol.PROTOCOL_VERSION


def test_flags_must_be_zero():
    frame = bytearray(protocol.request(1, "stats"))
    frame[3] = 1
    with pytest.raises(MalformedFrame, match="flags"):
        protocol.FrameDecoder().feed(bytes(frame))


def test_oversized_frame_rejected_from_header_alone():
    header = protocol.HEADER.pack(b"DF", protocol.PROTOCOL_VERSION, 0, 4097)
    with pytest.raises(FrameTooLarge) as info:
        protocol.FrameDecoder(max_frame=4096).feed(header)
    assert info.value.size == 4097 and info.value.limit == 4096
    with pytest.raises(FrameTooLarge):
        protocol.encode(b"x" * 5000, max_frame=4096)


@pytest.mark.parametrize("payload, match", [
    (b"\xc1", "not msgpack"),
    (msgpack.packb([1, 2]), "must be a map"),
    (msgpack.packb({"op": "stats"}), "id must be an integer"),
    (msgpack.packb({"id": 3, "op": 5}), "op must be a string"),
    (msgpack.packb({"id": 3, "op": "x", "args": [1]}), "args must be a map"),
])
def test_malformed_requests(payload, match):
    with pytest.raises(MalformedFrame, match=match):
        protocol.parse_request(payload)


def test_reply_roundtrip_reraises_typed_error():
    err = UnknownBlock("model m: no block 99", model="m", block_id=99)
    reply = protocol.unpack_payload(protocol.reply_error(5, err)[8:])
    assert reply["id"] == 5 and reply["ok"] is False and reply["error"]["code"] == 401
    with pytest.raises(UnknownBlock) as info:
        protocol.result_of(reply)
    assert info.value.block_id == 99 and "no block 99" in str(info.value)
    ok = protocol.unpack_payload(protocol.reply_ok(6, {"blocks": {3: 4096}})[8:])
    assert protocol.result_of(ok) == {"blocks": {3: 4096}}     # int map keys survive


def test_unknown_error_code_becomes_base_error():
    with pytest.raises(Exception) as info:
        protocol.result_of({"id": 1, "ok": False, "error": {"code": 9999, "message": "new", "fields": {}}})
    assert info.value.code == 9999
    assert not isinstance(info.value, LeaseError)
