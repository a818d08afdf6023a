"""hookwire.wire.framing: TensorChunk messages built and read by hand are protobuf's own bytes."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from google.protobuf import unknown_fields

from hookwire.wire import codec, framing
from hookwire.v1 import hook_service_pb2, model_service_pb2, operand_service_pb2, tensor_pb2

# (message class, its TensorChunk field): every message of proto/ that carries chunks.
CARRIERS = [
    (hook_service_pb2.SessionMessage, framing.SESSION_MESSAGE_CHUNK),
    (model_service_pb2.InferStreamResponse, framing.INFER_STREAM_CHUNK),
    (model_service_pb2.InferStreamRequest, framing.INFER_STREAM_CHUNK),
    (model_service_pb2.GenerateResponse, framing.GENERATE_RESPONSE_CHUNK),
    (model_service_pb2.GetParametersResponse, framing.GET_PARAMETERS_CHUNK),
    (operand_service_pb2.UploadOperandRequest, framing.UPLOAD_OPERAND_CHUNK),
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
            built = framing.frame(field, chunk_id, offset, memoryview(data))
            assert type(built) is bytes
            assert built == _protobuf(cls, chunk_id, offset, data)


@pytest.mark.parametrize(("cls", "field"), CARRIERS, ids=CARRIER_IDS)
def test_frame_is_protobufs_bytes_for_every_header_value(cls, field) -> None:  # type: ignore[no-untyped-def]
    for chunk_id in CHUNK_IDS:
        for offset in OFFSETS:
            for data in (b"", b"\x00", b"abc"):
                assert framing.frame(field, chunk_id, offset, data) == _protobuf(cls, chunk_id, offset, data)


def test_frame_takes_any_buffer_and_copies_it() -> None:
    arr = np.arange(1000, dtype=np.float32)
    built = framing.frame(6, 1, 0, memoryview(arr.view(np.uint8)))
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
                raw = framing.read_frame(wire, field)
                assert raw is not None
                assert (raw.chunk_id, raw.offset, bytes(raw.data)) == (chunk_id, offset, data)
                assert raw.data.obj is wire  # a view of the received bytes
                parsed = framing.deserializer(cls, field)(wire)
                assert type(parsed) is framing.RawChunk


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
    return framing.varint(number << 3 | wire_type) + payload


def test_read_frame_leaves_everything_else_to_protobuf() -> None:
    cls, field = hook_service_pb2.SessionMessage, framing.SESSION_MESSAGE_CHUNK
    good = _protobuf(cls, 2, 5, b"xyz")
    inner = good[2:]
    others = {
        "another kind": cls(notice=hook_service_pb2.Notice(message="m")).SerializeToString(),
        "empty": b"",
        "the chunk field twice (merged)": good + good,
        "a field after the chunk": good + cls(notice=hook_service_pb2.Notice(message="m")).SerializeToString(),
        "chunk_id twice (last wins)": _field(6, 2, framing.varint(len(inner) + 2) + inner + b"\x08\x07"),
        "fields out of order": _field(6, 2, framing.varint(7) + b"\x10\x05\x08\x02\x1a\x01z"),
        "an unknown field": _field(6, 2, framing.varint(len(inner) + 2) + inner + b"\x20\x01"),
        "chunk_id above uint32 (truncated)": _field(6, 2, framing.varint(8) + b"\x08" + framing.varint(1 << 33) + b"\x1a\x00"),
        "data as a varint": _field(6, 2, b"\x02\x18\x01"),
    }
    for name, wire in others.items():
        assert framing.read_frame(wire, field) is None, name
        assert type(framing.deserializer(cls, field)(wire)) is cls, name  # protobuf parsed it
    malformed = {
        "cut off": good[:-1],
        "length past the end": _field(6, 2, framing.varint(len(inner) + 5) + inner),
        "data past the end": _field(6, 2, framing.varint(4) + b"\x08\x02\x1a\x09"),
    }
    for name, wire in malformed.items():
        assert framing.read_frame(wire, field) is None, name
        with pytest.raises(Exception):
            cls.FromString(wire)  # and protobuf refuses it (so does the deserializer)


def test_read_frame_agrees_with_protobuf_on_random_bytes() -> None:
    """Whenever read_frame takes a message, protobuf reads the same chunk from it, and
    nothing else: exactness, on random mutations of chunk messages."""
    cls, field = hook_service_pb2.SessionMessage, framing.SESSION_MESSAGE_CHUNK
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
        raw = framing.read_frame(data, field)
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
        framing.Framing(16, 1024)
    with pytest.raises(ValueError):
        framing.Framing(6, 0)


# ------------------------------------------------------------------ Chunker and ChunkAssembler


def _captured(t: torch.Tensor, chunker: codec.Chunker) -> tensor_pb2.Value:
    out = tensor_pb2.Value()
    codec.encode_value_into(t, out, chunker=chunker)
    return out


@pytest.mark.parametrize("numel", [65537, 300001, 1 << 20])
def test_framed_snapshot_chunks_are_protobufs_and_a_snapshot(numel: int) -> None:
    t = torch.randn(numel)
    expected = t.clone()
    framed = codec.Chunker(snapshot=True, framing=framing.Framing(framing.SESSION_MESSAGE_CHUNK, 100_000))
    plain = codec.Chunker(snapshot=True)
    header = _captured(t, framed)
    _captured(t, plain)
    t.mul_(2)  # the pass changes it after the capture
    frames = list(framed.frames(framing.SESSION_MESSAGE_CHUNK, 100_000))
    assert frames == [hook_service_pb2.SessionMessage(chunk=c).SerializeToString() for c in plain.chunks(100_000)]
    assert [c.SerializeToString() for c in framed.chunks(100_000)] == [c.SerializeToString() for c in plain.chunks(100_000)]
    assembler = codec.ChunkAssembler(header)
    deserialize = framing.deserializer(hook_service_pb2.SessionMessage, framing.SESSION_MESSAGE_CHUNK)
    for wire in frames:
        assembler.feed(deserialize(wire))
    assert assembler.done
    got = codec.decode_value(header, chunked=assembler.result())
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))  # bit-identical


def test_framed_chunks_refuse_another_framing() -> None:
    framed = codec.Chunker(snapshot=True, framing=framing.Framing(framing.SESSION_MESSAGE_CHUNK, 1 << 20))
    _captured(torch.zeros(1 << 20), framed)
    with pytest.raises(ValueError):
        list(framed.frames(framing.GENERATE_RESPONSE_CHUNK, 1 << 20))
    with pytest.raises(ValueError):
        list(framed.frames(framing.SESSION_MESSAGE_CHUNK, 1 << 19))  # larger than the stream allows
    assert len(list(framed.frames(framing.SESSION_MESSAGE_CHUNK, 4 << 20))) == 4  # smaller chunks fit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8])
def test_unframed_chunks_are_built_when_sent_and_read_back_exactly(dtype: torch.dtype) -> None:
    t = (torch.rand(3, 70001) * 100).to(dtype)  # an odd byte count for one-byte dtypes
    chunker = codec.Chunker(snapshot=False)
    header = _captured(t, chunker)
    frames = list(chunker.frames(framing.INFER_STREAM_CHUNK, 65536))
    assert frames == [model_service_pb2.InferStreamRequest(chunk=c).SerializeToString() for c in chunker.chunks(65536)]
    assembler = codec.ChunkAssembler(header)
    for wire in frames:
        chunk = framing.read_frame(wire, framing.INFER_STREAM_CHUNK)
        assert chunk is not None
        assembler.feed(chunk)
    got = codec.decode_value(header, chunked=assembler.result())
    assert got.dtype == dtype and torch.equal(got, t)


def test_empty_tensors_are_never_chunked() -> None:
    chunker = codec.Chunker(snapshot=True, framing=framing.Framing(framing.SESSION_MESSAGE_CHUNK, 1 << 20))
    header = _captured(torch.zeros(0, 1 << 20), chunker)
    assert not chunker.tensors and header.tensor.chunk_id == 0
    assert list(chunker.frames(framing.SESSION_MESSAGE_CHUNK, 1 << 20)) == []


# ------------------------------------------------------------------ Splicer


def _reply(splicer: framing.Splicer | None) -> model_service_pb2.InferResponse:
    """An InferResponse with tensors of many sizes at many depths (outputs, events, grads)."""
    g = torch.Generator().manual_seed(11)
    msg = model_service_pb2.InferResponse(request_id="req_1", hook_ids=["hk_1", "hk_2"])
    output = ({"logits": torch.randn(3, 700, generator=g), "small": torch.arange(5)},
              [torch.randn(0, 4), torch.randint(0, 9, (333,), generator=g, dtype=torch.uint8), 2.5, "text"])
    codec.encode_value_into(output, msg.output, chunker=splicer)
    for i in range(3):
        event = msg.events.add(hook_id=f"hk_{i}", module="layers.0", seq=i + 1)
        codec.encode_value_into(torch.randn(40 + 300 * i, generator=g), event.args.add(), chunker=splicer)
        codec.encode_value_into(torch.randn(2, 2, generator=g), event.kwargs["mask"], chunker=splicer)
        codec.encode_value_into(torch.randn(500, generator=g).to(torch.bfloat16), event.output, chunker=splicer)
    codec.encode_value_into(torch.randn(1000, generator=g), msg.input_grads.add(), chunker=splicer)
    codec.encode_value_into({"b": torch.randn(64, generator=g)}, msg.input_kwargs_grads["x"], chunker=splicer)
    return msg


def _filled(splicer: framing.Splicer, msg: model_service_pb2.InferResponse) -> bytes:
    """What protobuf writes for ``msg`` with the tensors' data set (the same message: same map order)."""
    for out, _, data in splicer.kept:
        out.data = memoryview(data).tobytes()
    return msg.SerializeToString()


@pytest.mark.parametrize("min_bytes", [1, 100, 1000, 4000, 1 << 20])
def test_spliced_bytes_are_protobufs(min_bytes: int) -> None:
    splicer = framing.Splicer(snapshot=False, min_bytes=min_bytes)
    msg = _reply(splicer)
    assert bool(splicer.kept) == (min_bytes < 1 << 20)
    spliced = splicer.serialize(msg)
    assert spliced == _filled(splicer, msg)
    assert spliced == _reply(None).SerializeToString()  # and what an unspliced encode of the same values writes


def test_spliced_reply_decodes_bit_identically() -> None:
    splicer = framing.Splicer(snapshot=False, min_bytes=100)
    got = model_service_pb2.InferResponse.FromString(splicer.serialize(_reply(splicer)))
    want = _reply(None)
    assert got == want


def test_splicer_snapshots_and_skips_removed_parts() -> None:
    splicer = framing.Splicer(snapshot=True, min_bytes=100)
    msg = model_service_pb2.InferResponse()
    t = torch.randn(1000)
    kept = t.clone()
    codec.encode_value_into(t, msg.events.add().output, chunker=splicer)
    codec.encode_value_into(t, msg.events.add().output, chunker=splicer)
    t.zero_()  # the pass changes it after the captures
    del msg.events[1:]  # a part removed after its tensor was placed (a rolled-back shared pass)
    spliced = model_service_pb2.InferResponse.FromString(splicer.serialize(msg))
    assert len(spliced.events) == 1
    assert torch.equal(codec.decode_value(spliced.events[0].output), kept)


def test_a_marker_found_twice_falls_back_to_protobuf(monkeypatch: pytest.MonkeyPatch) -> None:
    splicer = framing.Splicer(snapshot=False, min_bytes=100)
    whole = []
    monkeypatch.setattr(splicer, "_serialize_whole", lambda msg: whole.append(msg) or framing.Splicer._serialize_whole(splicer, msg))
    msg = model_service_pb2.InferResponse()
    codec.encode_value_into(torch.randn(1000), msg.output, chunker=splicer)
    marker = splicer.kept[0][1]
    msg.events.add().module = "x" + marker.decode("latin-1")  # the marker's bytes elsewhere too (UTF-8 differs) ...
    msg.events.add().output.tensor.data = marker  # ... and verbatim
    spliced = splicer.serialize(msg)
    assert whole == [msg]
    assert spliced == _filled(splicer, msg)


# ------------------------------------------------------------------ cut_tensors


@pytest.mark.parametrize("min_bytes", [1, 100, 1000, 4000])
def test_cut_tensors_parse_like_protobuf_with_the_data_moved_out(min_bytes: int) -> None:
    wire = _reply(None).SerializeToString()
    cut = framing.cut_tensors(wire, model_service_pb2.InferResponse, min_bytes)
    assert cut is not None
    msg, views = cut
    assert all(view.obj is wire for view in views.values())  # views, not copies
    # Putting each cut tensor's data back gives protobuf's own parse.
    expected = model_service_pb2.InferResponse.FromString(wire)
    tensors = [t for _, t in codec.iter_tensors(msg) if t.chunk_id]
    assert sorted(t.chunk_id for t in tensors) == sorted(views) == list(range(2**32 - len(views), 2**32))
    for t in tensors:
        assert len(views[t.chunk_id]) >= min_bytes
        t.data = bytes(views[t.chunk_id])
        t.chunk_id = 0
    assert msg == expected
    # And it decodes bit-identically through the chunk path.
    msg2, views2 = framing.cut_tensors(wire, model_service_pb2.InferResponse, min_bytes)  # type: ignore[misc]
    assembler = codec.ChunkAssembler(msg2)
    for chunk_id, view in views2.items():
        assembler.feed(framing.RawChunk(chunk_id, 0, view))
    got = codec.decode_value(msg2.output, chunked=assembler.result())
    want = codec.decode_value(expected.output)
    assert torch.equal(got[0]["logits"], want[0]["logits"]) and torch.equal(got[1][1], want[1][1])


def test_cut_tensors_leaves_small_and_odd_messages_to_protobuf() -> None:
    cls = model_service_pb2.InferResponse
    assert framing.cut_tensors(_reply(None).SerializeToString(), cls, 1 << 20) is None  # nothing that large
    big = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_UINT8, shape=[5000], data=bytes(5000))
    one = cls(output=tensor_pb2.Value(tensor=big)).SerializeToString()
    assert framing.cut_tensors(one, cls, 100) is not None
    odd = {
        "the output twice (merged)": one + one,
        "a chunk_id": cls(output=tensor_pb2.Value(tensor=tensor_pb2.Tensor(
            dtype=tensor_pb2.DTYPE_UINT8, shape=[5000], data=bytes(5000), chunk_id=1))).SerializeToString(),
    }
    twice_data = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_UINT8, shape=[5000], data=bytes(5000)).SerializeToString()
    twice_data += b"\x1a" + framing.varint(5000) + b"\x01" * 5000
    value = b"\x0a" + framing.varint(len(twice_data)) + twice_data
    odd["Tensor.data twice (last wins)"] = b"\x12" + framing.varint(len(value)) + value
    for name, wire in odd.items():
        cls.FromString(wire)  # valid protobuf ...
        assert framing.cut_tensors(wire, cls, 100) is None, name  # ... left to protobuf
    with pytest.raises(Exception):
        cls.FromString(one[:-1])
    assert framing.cut_tensors(one[:-1], cls, 100) is None  # malformed: protobuf raises


N_CUT = 5000


def test_cut_tensors_agrees_with_protobuf_on_random_bytes() -> None:
    """Whenever cut_tensors parses a message, putting the cut data back gives exactly
    protobuf's parse of the same bytes; when it raises, so does protobuf."""
    cls = model_service_pb2.InferResponse
    msg = cls()
    g = torch.Generator().manual_seed(2)
    codec.encode_value_into((torch.randn(40, generator=g), [torch.randn(30, generator=g)]), msg.output)
    codec.encode_value_into(torch.randn(50, generator=g), msg.events.add(seq=1).kwargs["x"])
    original = msg.SerializeToString()
    rng = random.Random(3)
    cut_count = 0
    for _ in range(N_CUT):
        wire = bytearray(original)
        for _ in range(rng.randrange(1, 3)):
            pos = rng.randrange(len(wire))
            if rng.randrange(2):
                wire[pos] = rng.randrange(256)
            else:
                del wire[pos]
        data = bytes(wire)
        try:
            cut = framing.cut_tensors(data, cls, 100)
        except Exception:
            with pytest.raises(Exception):
                cls.FromString(data)
            continue
        if cut is None:
            continue
        cut_count += 1
        got, views = cut
        for _, t in codec.iter_tensors(got):
            if t.chunk_id in views:
                t.data = bytes(views[t.chunk_id])
                t.chunk_id = 0
        assert got == cls.FromString(data)
    assert cut_count > 500
