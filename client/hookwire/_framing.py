"""TensorChunk messages built and read by hand, for the bytes of large tensors.

Protobuf's Python messages copy a ``bytes`` field's data at every step: into the
message when it is set, into the wire bytes when it is serialized, out of the wire
bytes when they are parsed and out of the message at every read of the field. A
chunk of a large tensor is a tiny header and its data, so both ends handle it
themselves instead: the sender writes the header and the tensor's bytes into the
message's wire bytes in one copy (``frame``), and the receiver reads the header and
keeps a view of the data in the received bytes (``read_frame``), which it copies
once, into the tensor it assembles.

The bytes are exactly those protobuf writes for the same message (``frame`` is
tested against SerializeToString), and a reader built from proto/ alone reads them
as usual. ``read_frame`` takes only a message that holds one chunk field and
nothing else, written in protobuf's canonical order; for anything else it returns
None and the caller parses the bytes with protobuf, which then decides.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Union

#: The TensorChunk field of each message that carries chunks (see proto/).
SESSION_MESSAGE_CHUNK = 6  # hookwire.v1.SessionMessage.chunk (OpenSession, Subscribe)
INFER_STREAM_CHUNK = 2  # InferStreamRequest.chunk and InferStreamResponse.chunk
GENERATE_RESPONSE_CHUNK = 4  # hookwire.v1.GenerateResponse.chunk

_LEN = 2  # wire type of length-delimited fields
_CHUNK_ID_TAG = b"\x08"  # TensorChunk.chunk_id = 1, varint
_OFFSET_TAG = b"\x10"  # TensorChunk.offset = 2, varint
_DATA_TAG = b"\x1a"  # TensorChunk.data = 3, length-delimited
_UINT32_MAX = (1 << 32) - 1
_UINT64_MAX = (1 << 64) - 1


def varint(n: int) -> bytes:
    """The minimal base-128 varint of a non-negative int, as protobuf writes it."""
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


@dataclasses.dataclass(frozen=True)
class Framing:
    """How a stream frames chunks: the field of its message type that holds a
    TensorChunk, and the most data bytes per chunk."""

    field: int
    chunk_bytes: int

    def __post_init__(self) -> None:
        if not 1 <= self.field < 16:  # one-byte tags only: every chunk field in proto/ is below 16
            raise ValueError(f"chunk field {self.field} is not in 1..15")
        if self.chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, not {self.chunk_bytes}")


def frame(field: int, chunk_id: int, offset: int, data: Any) -> bytes:
    """The wire bytes of a message whose field ``field`` (1..15) is
    TensorChunk(chunk_id, offset, data) and which holds nothing else: exactly what
    protobuf's SerializeToString writes for it. ``data`` is any buffer of bytes
    (a memoryview of a tensor's memory): it is copied once, into the result."""
    n = len(data)
    head = bytearray()
    if chunk_id:  # proto3: a field at its default is not written
        head += _CHUNK_ID_TAG + varint(chunk_id)
    if offset:
        head += _OFFSET_TAG + varint(offset)
    if n:
        head += _DATA_TAG + varint(n)
    outer = bytes(((field << 3) | _LEN,)) + varint(len(head) + n) + head
    return b"".join((outer, data)) if n else outer


class RawChunk:
    """A TensorChunk read by ``read_frame``: ``data`` is a view of the received bytes
    (which it keeps alive), not a copy. Reads like tensor_pb2.TensorChunk."""

    __slots__ = ("chunk_id", "offset", "data")

    def __init__(self, chunk_id: int, offset: int, data: memoryview) -> None:
        self.chunk_id = chunk_id
        self.offset = offset
        self.data = data

    def __repr__(self) -> str:
        return f"RawChunk(chunk_id={self.chunk_id}, offset={self.offset}, {len(self.data)} bytes)"


def _read_varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """(value, next position); (-1, pos) for a varint that is cut off or longer than 10 bytes."""
    value = 0
    shift = 0
    while pos < end and shift < 70:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    return -1, pos


def read_frame(buf: bytes, field: int) -> RawChunk | None:
    """The TensorChunk in ``buf`` when ``buf`` is the wire bytes of a message holding
    only field ``field`` (a TensorChunk) whose own fields appear at most once each, in
    field order, with values in range; else None (parse ``buf`` with protobuf then:
    it handles repeated or unknown fields, other kinds, and malformed bytes). Copies
    nothing: the chunk's data is a view of ``buf``."""
    end = len(buf)
    if end < 2 or buf[0] != ((field << 3) | _LEN):
        return None
    size, pos = _read_varint(buf, 1, end)
    if size < 0 or pos + size != end:
        return None
    chunk_id = offset = 0
    start = stop = pos  # the data, empty unless present
    last = 0  # the number of the last field read: each at most once, in order
    while pos < end:
        tag = buf[pos]
        pos += 1
        if tag == 0x08 and last < 1:
            chunk_id, pos = _read_varint(buf, pos, end)
            if not 0 <= chunk_id <= _UINT32_MAX:
                return None
            last = 1
        elif tag == 0x10 and last < 2:
            offset, pos = _read_varint(buf, pos, end)
            if not 0 <= offset <= _UINT64_MAX:
                return None
            last = 2
        elif tag == 0x1A and last < 3:
            n, pos = _read_varint(buf, pos, end)
            if n < 0 or pos + n > end:
                return None
            start, stop = pos, pos + n
            pos = stop
            last = 3
        else:
            return None
    return RawChunk(chunk_id, offset, memoryview(buf)[start:stop])


def serializer(message_class: Any) -> Callable[[Any], bytes]:
    """A gRPC serializer for ``message_class`` that passes bytes (a message ``frame``
    built) through unchanged."""
    serialize = message_class.SerializeToString

    def serialize_or_pass(msg: Any) -> bytes:
        return msg if type(msg) is bytes else serialize(msg)

    return serialize_or_pass


def deserializer(message_class: Any, field: int) -> Callable[[bytes], Union[RawChunk, Any]]:
    """A gRPC deserializer for ``message_class`` that returns a RawChunk for a message
    holding only its chunk field ``field`` (see ``read_frame``), else the parsed message."""
    parse = message_class.FromString
    tag = (field << 3) | _LEN

    def deserialize(data: bytes) -> Any:
        if data and data[0] == tag:
            chunk = read_frame(data, field)
            if chunk is not None:
                return chunk
        return parse(data)

    return deserialize
