"""hookwire._framing: TensorChunk messages built and read by hand are protobuf's own bytes."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from google.protobuf import unknown_fields

from hookwire import _codec, _framing
from hookwire.v1 import hook_service_pb2, model_service_pb2, tensor_pb2

# (message class, its TensorChunk field): every message of proto/ that carries chunks.
CARRIERS = [
    (hook_service_pb2.SessionMessage, _framing.SESSION_MESSAGE_CHUNK),
    (model_service_pb2.InferStreamResponse, _framing.INFER_STREAM_CHUNK),
    (model_service_pb2.InferStreamRequest, _framing.INFER_STREAM_CHUNK),
    (model_service_pb2.GenerateResponse, _framing.GENERATE_RESPONSE_CHUNK),
]
CARRIER_IDS = [cls.DESCRIPTOR.name for cls, _ in CARRIERS]
SIZES = [0, 1, 2, 3, 127, 128, 129, 16383, 16384, 65535, 65537, (1 << 20) - 1, 1 << 20, (1 << 20) + 3]
CHUNK_IDS = [0, 1, 127, 128, 300, (1 << 32) - 1]
OFFSETS = [0, 1, 127, 128, 1 << 20, 3 << 30, (1 << 64) - 1]


def _protobuf(cls, chunk_id: int, offset: int, data: bytes) -> bytes:  # type: ignore[no-untyped-def]
    return cls(chunk=tensor_pb2.TensorChunk(chunk_id=chunk_id, offset=offset, data=data)).SerializeToString()


@pytest.mark.parametrize(("cls", "field"), CARRIERS, ids=CARRIER_IDS)
@pytest.mark.parametrize("size", SIZES)
def test_frame_is_protobufs_bytes_for_every_size(cls, field, size) -> None:  # type: ignore[no-untyped-def]
    data = bytes(random.Random(size).randbytes(size))
    for chunk_id in (1, 300):
        for offset in (0, 1 << 20):
            built = _framing.frame(field, chunk_id, offset, memoryview(data))
            assert type(built) is bytes
            assert built == _protobuf(cls, chunk_id, offset, data)


@pytest.mark.parametrize(("cls", "field"), CARRIERS, ids=CARRIER_IDS)
def test_frame_is_protobufs_bytes_for_every_header_value(cls, field) -> None:  # type: ignore[no-untyped-def]
    for chunk_id in CHUNK_IDS:
        for offset in OFFSETS:
            for data in (b"", b"\x00", b"abc"):
                assert _framing.frame(field, chunk_id, offset, data) == _protobuf(cls, chunk_id, offset, data)


def test_frame_takes_any_buffer_and_copies_it() -> None:
    arr = np.arange(1000, dtype=np.float32)
    built = _framing.frame(6, 1, 0, memoryview(arr.view(np.uint8)))
    expected = _protobuf(hook_service_pb2.SessionMessage, 1, 0, arr.tobytes())
    assert built == expected
    arr[:] = 0  # the frame holds its own copy
    assert built == expected


@pytest.mark.parametrize(("cls", "field"), CARRIERS, ids=CARRIER_IDS)
def test_read_frame_reads_protobufs_bytes_without_copying(cls, field) -> None:  # type: ignore[no-untyped-def]
    for size in (1, 3, 128, 65537):
        data = random.Random(size).randbytes(size)
        for chunk_id in CHUNK_IDS:
            for offset in OFFSETS:
                wire = _protobuf(cls, chunk_id, offset, data)
                raw = _framing.read_frame(wire, field)
                assert raw is not None
                assert (raw.chunk_id, raw.offset, bytes(raw.data)) == (chunk_id, offset, data)
                assert raw.data.obj is wire  # a view of the received bytes
                parsed = _framing.deserializer(cls, field)(wire)
                assert type(parsed) is _framing.RawChunk


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
    return _framing.varint(number << 3 | wire_type) + payload


def test_read_frame_leaves_everything_else_to_protobuf() -> None:
    cls, field = hook_service_pb2.SessionMessage, _framing.SESSION_MESSAGE_CHUNK
    good = _protobuf(cls, 2, 5, b"xyz")
    inner = good[2:]
    others = {
        "another kind": cls(notice=hook_service_pb2.Notice(message="m")).SerializeToString(),
        "empty": b"",
        "the chunk field twice (merged)": good + good,
        "a field after the chunk": good + cls(notice=hook_service_pb2.Notice(message="m")).SerializeToString(),
        "chunk_id twice (last wins)": _field(6, 2, _framing.varint(len(inner) + 2) + inner + b"\x08\x07"),
        "fields out of order": _field(6, 2, _framing.varint(7) + b"\x10\x05\x08\x02\x1a\x01z"),
        "an unknown field": _field(6, 2, _framing.varint(len(inner) + 2) + inner + b"\x20\x01"),
        "chunk_id above uint32 (truncated)": _field(6, 2, _framing.varint(8) + b"\x08" + _framing.varint(1 << 33) + b"\x1a\x00"),
        "data as a varint": _field(6, 2, b"\x02\x18\x01"),
    }
    for name, wire in others.items():
        assert _framing.read_frame(wire, field) is None, name
        assert type(_framing.deserializer(cls, field)(wire)) is cls, name  # protobuf parsed it
    malformed = {
        "cut off": good[:-1],
        "length past the end": _field(6, 2, _framing.varint(len(inner) + 5) + inner),
        "data past the end": _field(6, 2, _framing.varint(4) + b"\x08\x02\x1a\x09"),
    }
    for name, wire in malformed.items():
        assert _framing.read_frame(wire, field) is None, name
        with pytest.raises(Exception):
            cls.FromString(wire)  # and protobuf refuses it (so does the deserializer)


def test_read_frame_agrees_with_protobuf_on_random_bytes() -> None:
    """Whenever read_frame takes a message, protobuf reads the same chunk from it, and
    nothing else: exactness, on random mutations of chunk messages."""
    cls, field = hook_service_pb2.SessionMessage, _framing.SESSION_MESSAGE_CHUNK
    rng = random.Random(7)
    taken = 0
    for _ in range(20000):
        wire = bytearray(_protobuf(cls, rng.choice(CHUNK_IDS), rng.choice(OFFSETS), rng.randbytes(rng.randrange(4))))
        for _ in range(rng.randrange(1, 3)):
            op = rng.randrange(3)
            pos = rng.randrange(len(wire) + 1)
            if op == 0 and pos < len(wire):
                wire[pos] = rng.randrange(256)
            elif op == 1:
                wire[pos:pos] = bytes([rng.randrange(256)])
            elif pos < len(wire):
                del wire[pos]
        data = bytes(wire)
        raw = _framing.read_frame(data, field)
        if raw is None:
            continue
        taken += 1
        msg = cls.FromString(data)
        assert msg.WhichOneof("kind") == "chunk"
        assert [f.name for f, _ in msg.ListFields()] == ["chunk"]
        assert (msg.chunk.chunk_id, msg.chunk.offset, msg.chunk.data) == (raw.chunk_id, raw.offset, bytes(raw.data))
        assert not len(unknown_fields.UnknownFieldSet(msg)) and not len(unknown_fields.UnknownFieldSet(msg.chunk))
    assert taken > 1000  # the property was exercised


def test_framing_rejects_fields_with_longer_tags() -> None:
    with pytest.raises(ValueError):
        _framing.Framing(16, 1024)
    with pytest.raises(ValueError):
        _framing.Framing(6, 0)


# ------------------------------------------------------------------ Chunker and ChunkAssembler


def _captured(t: torch.Tensor, chunker: _codec.Chunker) -> tensor_pb2.Value:
    out = tensor_pb2.Value()
    _codec.encode_value_into(t, out, chunker=chunker)
    return out


@pytest.mark.parametrize("numel", [65537, 300001, 1 << 20])
def test_framed_snapshot_chunks_are_protobufs_and_a_snapshot(numel: int) -> None:
    t = torch.randn(numel)
    expected = t.clone()
    framed = _codec.Chunker(snapshot=True, framing=_framing.Framing(_framing.SESSION_MESSAGE_CHUNK, 100_000))
    plain = _codec.Chunker(snapshot=True)
    header = _captured(t, framed)
    _captured(t, plain)
    t.mul_(2)  # the pass changes it after the capture
    frames = list(framed.frames(_framing.SESSION_MESSAGE_CHUNK, 100_000))
    assert frames == [hook_service_pb2.SessionMessage(chunk=c).SerializeToString() for c in plain.chunks(100_000)]
    assert [c.SerializeToString() for c in framed.chunks(100_000)] == [c.SerializeToString() for c in plain.chunks(100_000)]
    assembler = _codec.ChunkAssembler(header)
    deserialize = _framing.deserializer(hook_service_pb2.SessionMessage, _framing.SESSION_MESSAGE_CHUNK)
    for wire in frames:
        assembler.feed(deserialize(wire))
    assert assembler.done
    got = _codec.decode_value(header, chunked=assembler.result())
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))  # bit-identical


def test_framed_chunks_refuse_another_framing() -> None:
    framed = _codec.Chunker(snapshot=True, framing=_framing.Framing(_framing.SESSION_MESSAGE_CHUNK, 1 << 20))
    _captured(torch.zeros(1 << 20), framed)
    with pytest.raises(ValueError):
        list(framed.frames(_framing.GENERATE_RESPONSE_CHUNK, 1 << 20))
    with pytest.raises(ValueError):
        list(framed.frames(_framing.SESSION_MESSAGE_CHUNK, 1 << 19))  # larger than the stream allows
    assert len(list(framed.frames(_framing.SESSION_MESSAGE_CHUNK, 4 << 20))) == 4  # smaller chunks fit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8])
def test_unframed_chunks_are_built_when_sent_and_read_back_exactly(dtype: torch.dtype) -> None:
    t = (torch.rand(3, 70001) * 100).to(dtype)  # an odd byte count for one-byte dtypes
    chunker = _codec.Chunker(snapshot=False)
    header = _captured(t, chunker)
    frames = list(chunker.frames(_framing.INFER_STREAM_CHUNK, 65536))
    assert frames == [model_service_pb2.InferStreamRequest(chunk=c).SerializeToString() for c in chunker.chunks(65536)]
    assembler = _codec.ChunkAssembler(header)
    for wire in frames:
        chunk = _framing.read_frame(wire, _framing.INFER_STREAM_CHUNK)
        assert chunk is not None
        assembler.feed(chunk)
    got = _codec.decode_value(header, chunked=assembler.result())
    assert got.dtype == dtype and torch.equal(got, t)


def test_empty_tensors_are_never_chunked() -> None:
    chunker = _codec.Chunker(snapshot=True, framing=_framing.Framing(_framing.SESSION_MESSAGE_CHUNK, 1 << 20))
    header = _captured(torch.zeros(0, 1 << 20), chunker)
    assert not chunker.tensors and header.tensor.chunk_id == 0
    assert list(chunker.frames(_framing.SESSION_MESSAGE_CHUNK, 1 << 20)) == []
