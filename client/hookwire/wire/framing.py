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
import os
from typing import Any, Callable

from google.protobuf.descriptor import FieldDescriptor

#: The TensorChunk field of each message that carries chunks (see proto/).
SESSION_MESSAGE_CHUNK = 6  # hookwire.v1.SessionMessage.chunk (OpenSession, Subscribe)
INFER_STREAM_CHUNK = 2  # InferStreamRequest.chunk and InferStreamResponse.chunk
GENERATE_RESPONSE_CHUNK = 4  # hookwire.v1.GenerateResponse.chunk
GET_PARAMETERS_CHUNK = 2  # hookwire.v1.GetParametersResponse.chunk
UPLOAD_OPERAND_CHUNK = 2  # hookwire.v1.UploadOperandRequest.chunk

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


def read_varint(buf: bytes | memoryview, pos: int, end: int) -> tuple[int, int]:
    """The base-128 varint at ``buf[pos:end]``: (value, next position); (-1, pos) for a
    varint that is cut off or longer than 10 bytes. The one varint reader of hookwire
    (chunk frames here, the request bounds check of raw request bytes on the server)."""
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
    size, pos = read_varint(buf, 1, end)
    if size < 0 or pos + size != end:
        return None
    chunk_id = offset = 0
    start = stop = pos  # the data, empty unless present
    last = 0  # the number of the last field read: each at most once, in order
    while pos < end:
        tag = buf[pos]
        pos += 1
        if tag == 0x08 and last < 1:
            chunk_id, pos = read_varint(buf, pos, end)
            if not 0 <= chunk_id <= _UINT32_MAX:
                return None
            last = 1
        elif tag == 0x10 and last < 2:
            offset, pos = read_varint(buf, pos, end)
            if not 0 <= offset <= _UINT64_MAX:
                return None
            last = 2
        elif tag == 0x1A and last < 3:
            n, pos = read_varint(buf, pos, end)
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


def deserializer(message_class: Any, field: int | None, cut_bytes: int | None = None) -> Callable[[bytes], Any]:
    """A gRPC deserializer for ``message_class`` that returns a RawChunk for a message
    holding only its chunk field ``field`` (see ``read_frame``; None: no such field);
    with ``cut_bytes``, a CutReply for a message holding tensors of at least that many
    bytes (see ``cut_tensors``); else the parsed message."""
    parse = message_class.FromString
    tag = -1 if field is None else (field << 3) | _LEN

    def deserialize(data: bytes) -> Any:
        if data and data[0] == tag:
            assert field is not None
            chunk = read_frame(data, field)
            if chunk is not None:
                return chunk
        if cut_bytes is not None and len(data) >= cut_bytes:
            cut = cut_tensors(data, message_class, cut_bytes)
            if cut is not None:
                return CutReply(*cut)
        return parse(data)

    return deserialize


# --------------------------------------------------------------------------- spliced messages


class Splicer:
    """Large tensors of one message, kept out of it until its wire bytes are built.

    Each tensor over ``min_bytes`` is placed in its Tensor message as a 16-byte marker
    instead of its data (``place``); ``serialize`` has protobuf serialize the message
    with the markers, then writes its wire bytes again with each marker replaced by
    the tensor's bytes and the lengths of the enclosing messages updated: one copy of
    each tensor, where setting ``Tensor.data`` and serializing copies it twice more
    (and a ``bytes`` to set it from, once more). The result is exactly what protobuf
    writes for the message holding the data (tested).

    Markers are random per message: tensor data cannot plant one. Should a marker
    still occur more than once in the serialized message, ``serialize`` sets the data
    and lets protobuf write it all.
    """

    #: Smaller tensors are set inline as usual: for them a marker costs more than a copy.
    MIN_BYTES = 64 * 1024

    def __init__(self, *, snapshot: bool, min_bytes: int = MIN_BYTES) -> None:
        #: Copy tensors that may change before the message is sent (captures inside a pass).
        self.snapshot = snapshot
        #: A Splicer copies nothing as it places a tensor (see Chunker.framing).
        self.framing: Framing | None = None
        self.min_bytes = min_bytes
        #: (Tensor message, marker, flat bytes) of each placed tensor, in order.
        self.kept: list[tuple[Any, bytes, Any]] = []
        self._prefix = os.urandom(12)

    def keeps(self, nbytes: int) -> bool:
        """Whether a tensor of ``nbytes`` is placed as a marker (else set inline)."""
        return nbytes >= self.min_bytes

    def place(self, out: Any, flat_bytes: Any) -> None:
        """Puts a marker in Tensor message ``out`` for ``flat_bytes`` (a flat uint8
        buffer, kept as it is: the caller snapshots it when it must)."""
        marker = self._prefix + len(self.kept).to_bytes(4, "little")
        out.data = marker
        self.kept.append((out, marker, flat_bytes))

    def forget_after(self, count: int) -> None:
        """Drops the tensors placed after the first ``count`` (their messages were removed)."""
        del self.kept[count:]

    def serialize(self, msg: Any) -> bytes:
        """The wire bytes of ``msg`` with every placed tensor's data in place of its marker.
        A marker no longer in the message (its part was removed) is skipped."""
        wire = msg.SerializeToString()
        holes: list[tuple[int, int, Any]] = []
        for _, marker, data in self.kept:
            at = wire.find(marker)
            if at < 0:
                continue
            if wire.find(marker, at + 1) >= 0:
                return self._serialize_whole(msg)
            holes.append((at, at + len(marker), data))
        if not holes:
            return wire
        holes.sort(key=lambda hole: hole[0])
        pieces: list[Any] = []
        _respliced(memoryview(wire), 0, len(wire), holes, 0, pieces)
        return b"".join(pieces)

    def _serialize_whole(self, msg: Any) -> bytes:
        for out, _, data in self.kept:
            out.data = memoryview(data).tobytes()
        return msg.SerializeToString()


def _respliced(wire: memoryview, start: int, end: int, holes: list[tuple[int, int, Any]], h: int,
               pieces: list[Any]) -> tuple[int, int]:
    """Appends to ``pieces`` the fields of ``wire[start:end]`` (a message's fields) with
    the holes from index ``h`` on that lie in it filled; returns (bytes appended, index
    of the first hole past ``end``). A hole is a length-delimited field's whole content
    (a marker in Tensor.data); every field around one is a message, whose length is
    written again."""
    total = 0
    copied_from = start  # fields before a hole's field go out as one slice
    pos = start
    while h < len(holes) and holes[h][0] < end:
        at = holes[h][0]
        field_start = pos
        tag, pos = read_varint(wire, pos, end)
        tag_end = pos
        wire_type = tag & 7
        if wire_type == 0:
            _, pos = read_varint(wire, pos, end)
            continue
        if wire_type == 1:
            pos += 8
            continue
        if wire_type == 5:
            pos += 4
            continue
        if wire_type != _LEN or tag < 0:  # groups never occur in proto3; nor do bad tags in protobuf's output
            raise ValueError("unexpected wire type while splicing")
        size, content = read_varint(wire, pos, end)
        pos = content + size
        if pos <= at:
            continue  # the hole lies further on
        if copied_from < field_start:
            pieces.append(wire[copied_from:field_start])
            total += field_start - copied_from
        head = wire[field_start:tag_end].tobytes()
        if content == at and pos == holes[h][1]:  # the marker itself: Tensor.data
            data = holes[h][2]
            n = memoryview(data).nbytes
            pieces += [head + varint(n), data]
            total += len(head) + len(varint(n)) + n
            h += 1
        else:  # a message around holes: its fields again, then its new length in front
            inner: list[Any] = []
            n, h = _respliced(wire, content, pos, holes, h, inner)
            prefix = head + varint(n)
            pieces.append(prefix)
            pieces += inner
            total += len(prefix) + n
        copied_from = pos
    if copied_from < end:
        pieces.append(wire[copied_from:end])
        total += end - copied_from
    return total, h


# --------------------------------------------------------------------------- cut messages

_TENSOR = "hookwire.v1.Tensor"
_TENSOR_DATA = 3
_TENSOR_CHUNK_ID = 4
#: The chunk id of the first cut tensor; the next ones count down. (A message that has
#: chunk ids of its own is not cut where the walk sees them: in a unary reply they break
#: the protocol, and they are small numbers.)
_CUT_IDS = (1 << 32) - 1
#: Per message type: its fields that hold a Tensor at some depth, by number, each with
#: its message type and whether it repeats (a map is repeated entries).
_PATHS: dict[str, dict[int, tuple[Any, bool]]] = {}
#: Per message type: the wire types each of its fields may arrive with, by number.
_WIRE_TYPES: dict[str, dict[int, tuple[int, ...]]] = {}
_DELIMITED = frozenset({FieldDescriptor.TYPE_MESSAGE, FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES})
_FIXED64 = frozenset({FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64})
_FIXED32 = frozenset({FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_FIXED32, FieldDescriptor.TYPE_SFIXED32})


def _wire_types(field: Any) -> tuple[int, ...]:
    if field.type in _DELIMITED:
        return (_LEN,)
    scalar = 1 if field.type in _FIXED64 else 5 if field.type in _FIXED32 else 0
    return (scalar, _LEN) if field.is_repeated else (scalar,)  # packed or not


def _paths(descriptor: Any) -> dict[int, tuple[Any, bool]]:
    """For a message type: its fields that hold a Tensor at some depth, by number, each
    with its message type and whether it repeats (a map is repeated entries). Memoized
    for every type it reaches (with their fields' wire types)."""
    found = _PATHS.get(descriptor.full_name)
    if found is not None:
        return found
    reachable: dict[str, Any] = {}
    stack = [descriptor]
    while stack:
        d = stack.pop()
        if d.full_name not in reachable:
            reachable[d.full_name] = d
            stack += [f.message_type for f in d.fields if f.message_type is not None]
    holders = {_TENSOR} & reachable.keys()
    grown = True
    while grown:  # Value holds ValueList holds Value: a fixed point, not a recursion
        grown = False
        for name, d in reachable.items():
            if name not in holders and any(
                f.message_type is not None and f.message_type.full_name in holders for f in d.fields
            ):
                holders.add(name)
                grown = True
    for name, d in reachable.items():
        _WIRE_TYPES[name] = {f.number: _wire_types(f) for f in d.fields}
        _PATHS[name] = {
            f.number: (f.message_type, f.is_repeated)
            for f in d.fields if f.message_type is not None and f.message_type.full_name in holders
        }
    return _PATHS[descriptor.full_name]


class _NotCanonical(Exception):
    """The bytes are not written the way protobuf writes them: leave them to protobuf."""


def cut_tensors(data: bytes, message_class: Any, min_bytes: int) -> tuple[Any, dict[int, memoryview]] | None:
    """Parses ``data`` (a serialized ``message_class``) without copying the data of its
    Tensors of at least ``min_bytes``: such a Tensor is parsed with its data taken out
    and its ``chunk_id`` set to a new id, as InferStream would have sent it, and the
    data is returned as a view of ``data`` under that id (see ChunkAssembler).

    None when ``data`` holds no such tensor, or when a message on the way to one holds
    a Tensor.chunk_id, a field that holds tensors (or Tensor.data) twice, which protobuf
    would merge, or a field protobuf would keep as unknown (an unknown number, a wire
    type that does not fit: a map entry holding one is itself kept as unknown): parse
    it with protobuf then, which decides. Costs a walk of
    the fields on the way to each large tensor (in Python) and one copy of everything
    but the cut data."""
    cuts: list[tuple[int, int]] = []  # where each cut Tensor.data's content lies
    pieces: list[Any] = []
    view = memoryview(data)
    try:
        _cut(view, 0, len(data), message_class.DESCRIPTOR, min_bytes, cuts, pieces)
    except _NotCanonical:
        return None
    if not cuts:
        return None
    msg = message_class.FromString(b"".join(pieces))
    return msg, {_CUT_IDS - i: view[start:end] for i, (start, end) in enumerate(cuts)}


def _cut(wire: memoryview, start: int, end: int, descriptor: Any, min_bytes: int,
         cuts: list[tuple[int, int]], pieces: list[Any]) -> int:
    """Appends the fields of ``wire[start:end]`` (a ``descriptor`` message) to ``pieces``,
    with the cuts made; returns the bytes appended."""
    paths = _paths(descriptor)
    wire_types = _WIRE_TYPES[descriptor.full_name]
    tensor = descriptor.full_name == _TENSOR
    once: set[int] = set()  # singular fields seen that hold tensors (and Tensor.data)
    total = 0
    copied_from = start  # fields before a cut go out as one slice
    pos = start
    while pos < end:
        field_start = pos
        tag, pos = read_varint(wire, pos, end)
        if tag < 0:
            raise _NotCanonical
        number, wire_type = tag >> 3, tag & 7
        tag_end = pos
        if wire_type not in wire_types.get(number, ()):
            raise _NotCanonical  # an unknown field (see above)
        path = paths.get(number)
        if tensor and number == _TENSOR_CHUNK_ID:
            raise _NotCanonical  # the chunk ids are the cut's to give
        if (path is not None and not path[1]) or (tensor and number == _TENSOR_DATA):
            if number in once:
                raise _NotCanonical
            once.add(number)
        if wire_type == 0:
            value, pos = read_varint(wire, pos, end)
            if value < 0:
                raise _NotCanonical
            continue
        if wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
            continue
        if wire_type != _LEN:
            raise _NotCanonical
        size, content = read_varint(wire, pos, end)
        if size < 0 or content + size > end:
            raise _NotCanonical
        pos = content + size
        if tensor and number == _TENSOR_DATA:
            if size < min_bytes:
                continue
            inner: list[Any] = [bytes((_TENSOR_CHUNK_ID << 3,)) + varint(_CUT_IDS - len(cuts))]  # chunk_id for data
            cuts.append((content, pos))
            n = len(inner[0])
            head = b""  # replaces the whole field
        elif path is not None and size >= min_bytes:  # it may hold a large tensor: look inside
            inner = []
            found = len(cuts)
            n = _cut(wire, content, pos, path[0], min_bytes, cuts, inner)
            if len(cuts) == found:
                continue  # nothing cut: the field goes out as it is
            head = wire[field_start:tag_end].tobytes() + varint(n)
        else:
            continue
        if copied_from < field_start:
            pieces.append(wire[copied_from:field_start])
            total += field_start - copied_from
        pieces.append(head)
        pieces += inner
        total += len(head) + n
        copied_from = pos
    if pos != end:
        raise _NotCanonical
    if copied_from < end:
        pieces.append(wire[copied_from:end])
        total += end - copied_from
    return total


class CutReply:
    """A message parsed with its large tensors cut out (see ``cut_tensors``): ``msg``
    (their Tensor messages carry chunk ids) and ``views`` (their data, views of the
    received bytes, by chunk id; see ChunkAssembler.take)."""

    __slots__ = ("msg", "views")

    def __init__(self, msg: Any, views: dict[int, memoryview]) -> None:
        self.msg = msg
        self.views = views
