"""Values and tensors between Python and the wire (hookwire.v1.Value / Tensor).

One codec serves the SDK and the server. Decoding yields torch tensors when
torch is importable (always on the server), else numpy arrays; torch is imported
by the first tensor decoded, not with this module. Nothing here
unpickles or evaluates anything: a Tensor is dtype + shape + raw bytes.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from typing import Any, Iterator, Mapping, cast

import numpy as np
from google.protobuf import struct_pb2

from hookwire.v1 import tensor_pb2

from .framing import Framing, RawChunk, Splicer, frame, read_frame

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for
    raise ImportError("hookwire's tensor codec assumes a little-endian host")

#: How deep Values may nest. Each list level is two protobuf message levels and
#: each map level three, and protobuf parsers stop at 100: deeper values could be
#: encoded but not parsed by the receiver.
MAX_DEPTH = 30

_NUMPY_DTYPES: dict[int, np.dtype] = {
    tensor_pb2.DTYPE_FLOAT32: np.dtype("<f4"),
    tensor_pb2.DTYPE_FLOAT64: np.dtype("<f8"),
    tensor_pb2.DTYPE_FLOAT16: np.dtype("<f2"),
    tensor_pb2.DTYPE_BFLOAT16: np.dtype("<u2"),  # raw bits; widened on decode without torch
    tensor_pb2.DTYPE_INT8: np.dtype("i1"),
    tensor_pb2.DTYPE_INT16: np.dtype("<i2"),
    tensor_pb2.DTYPE_INT32: np.dtype("<i4"),
    tensor_pb2.DTYPE_INT64: np.dtype("<i8"),
    tensor_pb2.DTYPE_UINT8: np.dtype("u1"),
    tensor_pb2.DTYPE_BOOL: np.dtype("?"),
}
_NUMPY_TO_WIRE: dict[np.dtype, int] = {dt: code for code, dt in _NUMPY_DTYPES.items() if code != tensor_pb2.DTYPE_BFLOAT16}

ITEMSIZE: dict[int, int] = {code: dt.itemsize for code, dt in _NUMPY_DTYPES.items()}


class CodecError(ValueError):
    """A value that cannot be encoded or decoded; the message names where."""


# torch is imported lazily: importing it takes seconds, and the SDK's users that never
# touch a tensor (the ``hookwire`` command's health, models, inspect, hooks) should not
# pay for it. Encoding needs torch only for a torch tensor, which cannot exist unless
# torch was imported already (``sys.modules``); decoding imports it on its first tensor
# when it is installed (find_spec: decided without importing). Either way the module and
# its dtype tables are looked up once, then read from these globals.

#: The torch module once the codec has adopted it (None: not yet, or not installed).
_torch_mod: Any = None
#: Whether torch is importable; None until first asked (see torch_importable).
_torch_found: bool | None = None
#: torch dtype -> DType code, and the reverse; filled in place when torch is adopted.
_TORCH_TO_WIRE: dict[Any, int] = {}
_TORCH_DTYPES: dict[int, Any] = {}


def torch_importable() -> bool:
    """Whether torch is installed (decoding then yields torch tensors), decided without
    importing it: its import takes seconds. Cached after the first call."""
    global _torch_found
    if _torch_found is None:
        if "torch" in sys.modules:
            _torch_found = sys.modules["torch"] is not None
        else:
            try:
                _torch_found = importlib.util.find_spec("torch") is not None
            except (ImportError, ValueError):  # an import hook that refuses it; a broken entry
                _torch_found = False
    return _torch_found


def _adopt(torch: Any) -> Any:
    """Fills the dtype tables from ``torch`` and makes it the codec's torch; returns it.
    Idempotent, and safe from several threads: the tables are filled before _torch_mod
    is set, so a reader that sees the module sees the tables."""
    global _torch_mod
    if _torch_mod is None:
        to_wire = {
            torch.float32: tensor_pb2.DTYPE_FLOAT32,
            torch.float64: tensor_pb2.DTYPE_FLOAT64,
            torch.float16: tensor_pb2.DTYPE_FLOAT16,
            torch.bfloat16: tensor_pb2.DTYPE_BFLOAT16,
            torch.int8: tensor_pb2.DTYPE_INT8,
            torch.int16: tensor_pb2.DTYPE_INT16,
            torch.int32: tensor_pb2.DTYPE_INT32,
            torch.int64: tensor_pb2.DTYPE_INT64,
            torch.uint8: tensor_pb2.DTYPE_UINT8,
            torch.bool: tensor_pb2.DTYPE_BOOL,
        }
        _TORCH_TO_WIRE.update(to_wire)
        _TORCH_DTYPES.update({code: dt for dt, code in to_wire.items()})
        _torch_mod = torch
    return _torch_mod


def _torch_loaded() -> Any:
    """torch if something imported it already, else None; never imports it. What
    encoding needs: a torch tensor implies an imported torch."""
    if _torch_mod is not None:
        return _torch_mod
    torch = sys.modules.get("torch")
    # A module object without Tensor is torch half-way through its own import: leave it.
    if torch is None or not hasattr(torch, "Tensor"):
        return None
    return _adopt(torch)


def _torch() -> Any:
    """torch, imported now if it is installed and not imported yet (seconds, once), else
    None. What decoding needs: results are torch tensors when torch is importable."""
    if _torch_mod is not None:
        return _torch_mod
    if not torch_importable():
        return None
    try:
        import torch
    except ImportError:  # found but broken: decode to numpy, as without torch
        global _torch_found
        _torch_found = False
        return None
    return _adopt(torch)


def __getattr__(name: str) -> Any:
    # TORCH_DTYPES: DType code -> torch dtype ({} without torch). Reading it imports
    # torch when it is installed, as decoding does.
    if name == "TORCH_DTYPES":
        _torch()
        return _TORCH_DTYPES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtype_name(code: int) -> str:
    """The DType's wire name, or a description of an unknown code."""
    try:
        return tensor_pb2.DType.Name(code)
    except ValueError:
        return f"unknown dtype {code}"


def wire_dtype_of(dtype: Any) -> tensor_pb2.DType:
    """The DType code of a torch or numpy dtype; raises CodecError if it has none."""
    code: int | None = _TORCH_TO_WIRE.get(dtype)
    if code is None and _torch_mod is None and _torch_loaded() is not None:
        code = _TORCH_TO_WIRE.get(dtype)  # a torch dtype seen before the codec adopted torch
    if code is None:
        try:
            code = _NUMPY_TO_WIRE.get(np.dtype(dtype))
        except TypeError:
            code = None
    if code is None:
        raise CodecError(f"dtype {dtype} has no wire form")
    return cast("tensor_pb2.DType", code)


# --------------------------------------------------------------------------- encode


class Chunker:
    """Collects the tensors of one message that are too large to travel inline.

    They are sent after the message as TensorChunk messages (``frames()``, or
    ``chunks()`` as protobuf messages). Small tensors stay inline until the message's
    inline bytes reach ``inline_total_max``, so the message itself stays well under
    any peer's limit (>= 1 MiB).

    A ``snapshot`` chunker copies each tensor as it is added, since the tensor may
    change before it is sent (a capture inside a pass). With a ``framing`` it copies
    it straight into its chunk messages' wire bytes (see framing), on the thread that
    adds it: that copy is the snapshot, and the event loop that later sends the
    messages only hands them to gRPC. Without a snapshot, chunk messages are built one
    at a time as they are sent (memory: the tensors plus one chunk).
    """

    INLINE_TENSOR_MAX = 256 * 1024
    INLINE_TOTAL_MAX = 512 * 1024

    def __init__(self, *, snapshot: bool, framing: Framing | None = None) -> None:
        #: Copy tensors that may change before they are sent (captures inside a pass).
        self.snapshot = snapshot
        #: How the chunk messages of snapshots are framed (None: snapshots are tensors).
        self.framing = framing
        #: The kept tensors, in chunk id order.
        self.tensors: list[_Kept] = []
        self._inline = 0

    def keeps(self, nbytes: int) -> bool:
        """Whether a tensor of ``nbytes`` goes out in chunks (else it is counted inline)."""
        if nbytes > self.INLINE_TENSOR_MAX or self._inline + nbytes > self.INLINE_TOTAL_MAX:
            return True
        self._inline += nbytes
        return False

    def add(self, flat_bytes: Any) -> int:
        """Keeps a flat uint8 array (numpy); returns its chunk id. With ``snapshot`` and a
        ``framing``, its chunk messages are built now (the one copy of its bytes);
        otherwise the array itself is kept (the caller snapshots it when it must)."""
        chunk_id = len(self.tensors) + 1
        nbytes = int(flat_bytes.nbytes)
        if self.snapshot and self.framing is not None:
            frames = list(_frames(self.framing, chunk_id, flat_bytes))
            self.tensors.append(_Kept(chunk_id, nbytes, None, frames, self.framing))
        else:
            self.tensors.append(_Kept(chunk_id, nbytes, flat_bytes, None, None))
        return chunk_id

    def place(self, out: tensor_pb2.Tensor, flat_bytes: Any) -> None:
        """Keeps ``flat_bytes`` (see ``add``) for Tensor message ``out``: sets its chunk_id."""
        out.chunk_id = self.add(flat_bytes)

    @property
    def nbytes(self) -> int:
        """Bytes kept for chunks."""
        return sum(kept.nbytes for kept in self.tensors)

    def frames(self, field: int, chunk_bytes: int) -> Iterator[bytes]:
        """The wire bytes of the chunk messages, each a message whose field ``field`` is
        a TensorChunk of at most ``chunk_bytes`` data bytes (lazy). Snapshots framed
        when they were added are yielded as they are: their framing must have the same
        field and no larger chunks (ValueError otherwise)."""
        for kept in self.tensors:
            if kept.frames is not None:
                assert kept.framing is not None
                if kept.framing.field != field or kept.framing.chunk_bytes > chunk_bytes:
                    raise ValueError(f"chunks framed as {kept.framing}, asked for field {field}, {chunk_bytes} bytes")
                yield from kept.frames
            else:
                yield from _frames(Framing(field, chunk_bytes), kept.chunk_id, kept.data)

    def chunks(self, chunk_bytes: int) -> Iterator[tensor_pb2.TensorChunk]:
        """The TensorChunk messages, one ``chunk_bytes`` slice at a time (lazy)."""
        for kept in self.tensors:
            if kept.frames is not None:
                assert kept.framing is not None
                for data in kept.frames:
                    raw = read_frame(data, kept.framing.field)
                    assert raw is not None
                    yield tensor_pb2.TensorChunk(chunk_id=raw.chunk_id, offset=raw.offset, data=bytes(raw.data))
                continue
            view = memoryview(kept.data)
            for offset in range(0, len(view), chunk_bytes):
                yield tensor_pb2.TensorChunk(
                    chunk_id=kept.chunk_id, offset=offset, data=view[offset : offset + chunk_bytes].tobytes()
                )


@dataclasses.dataclass
class _Kept:
    """A tensor a Chunker keeps: its flat bytes, or the chunk messages built from them."""

    chunk_id: int
    nbytes: int
    data: Any  # flat uint8 numpy array, or None when framed
    frames: list[bytes] | None
    framing: Framing | None


def _frames(framing: Framing, chunk_id: int, flat_bytes: Any) -> Iterator[bytes]:
    view = memoryview(flat_bytes)
    step = framing.chunk_bytes
    for offset in range(0, len(view), step):
        yield frame(framing.field, chunk_id, offset, view[offset : offset + step])


def encode_tensor_into(tensor: Any, out: tensor_pb2.Tensor, chunker: Chunker | Splicer | None = None) -> int:
    """Writes a torch tensor or numpy array into ``out``; returns the data size.

    The only copy is the one into the ``bytes`` that protobuf needs (or, for a
    tensor the ``chunker`` keeps, the snapshot it asks for: a Chunker sends it in
    chunks, a Splicer writes it into the message's wire bytes). CUDA tensors are
    copied to the host first; the caller decides where that happens.
    """
    torch = _torch_mod or _torch_loaded()
    code: int | None
    if torch is not None and isinstance(tensor, torch.Tensor):
        code = _TORCH_TO_WIRE.get(tensor.dtype)
        if code is None:
            raise CodecError(f"tensor dtype {tensor.dtype} has no wire form")
        t = tensor.detach()
        copied = False
        if t.device.type != "cpu":
            t, copied = t.cpu(), True
        if t.is_conj() or t.is_neg():
            t, copied = t.resolve_conj().resolve_neg(), True
        shape = tuple(t.shape)
        if not t.is_contiguous():
            t, copied = t.contiguous(), True
        flat = t.reshape(-1).view(torch.uint8) if t.numel() else None
        nbytes = t.numel() * t.element_size()
        if chunker is not None and flat is not None and chunker.keeps(nbytes):
            if chunker.snapshot and not copied and chunker.framing is None:
                flat = flat.clone()  # (a framing chunker copies it into its chunk messages)
            chunker.place(out, flat.numpy())
            data = b""
        else:
            data = flat.numpy().tobytes() if flat is not None else b""
    elif isinstance(tensor, np.ndarray):
        code = wire_dtype_of(tensor.dtype)
        shape = tensor.shape
        arr = np.ascontiguousarray(tensor, dtype=_NUMPY_DTYPES[code])
        nbytes = arr.nbytes
        if chunker is not None and nbytes and chunker.keeps(nbytes):
            flat_np = arr.reshape(-1).view(np.uint8)
            if chunker.snapshot and chunker.framing is None and np.shares_memory(flat_np, tensor):
                flat_np = flat_np.copy()
            chunker.place(out, flat_np)
            data = b""
        else:
            data = arr.tobytes()
    else:
        raise CodecError(f"expected a tensor, got {type(tensor).__name__}")
    out.dtype = code  # type: ignore[assignment]  # an int of the DType enum
    out.shape.extend(shape)
    if data:
        out.data = data
    return nbytes


def _copy_value(msg: tensor_pb2.Value, out: tensor_pb2.Value, chunker: Chunker | Splicer | None,
                opaque_caches: bool) -> int:
    """A value already in its wire form (a capture a vLLM worker encoded): a tensor is
    copied as it is (never decoded and encoded again), its data through ``chunker``
    when it keeps tensors of that size; anything else is decoded and encoded."""
    if msg.WhichOneof("kind") == "tensor" and not msg.tensor.chunk_id and not msg.tensor.operand:
        tensor = msg.tensor
        data = tensor.data  # a copy of the message's bytes: read once
        check_tensor(tensor, "value", data=data)  # as decoding it would: bytes that fit dtype and shape
        nbytes = len(data)
        if chunker is not None and nbytes and chunker.keeps(nbytes):
            out.tensor.dtype = tensor.dtype
            out.tensor.shape.extend(tensor.shape)
            chunker.place(out.tensor, np.frombuffer(data, dtype=np.uint8))
        else:
            out.CopyFrom(msg)
        return nbytes
    return encode_value_into(decode_value(msg, where="value"), out, chunker=chunker, opaque_caches=opaque_caches)


def is_opaque_cache(obj: Any) -> bool:
    """Whether ``obj`` is a transformers KV cache (``transformers.cache_utils.Cache``
    and its subclasses, e.g. DynamicCache): state a causal LM passes between its
    modules, with no wire form. Checked by class name, without importing transformers."""
    return any(cls.__name__ == "Cache" and cls.__module__.startswith("transformers.") for cls in type(obj).__mro__)


def encode_value_into(
    obj: Any, out: tensor_pb2.Value, _depth: int = 0, *, chunker: Chunker | Splicer | None = None,
    opaque_caches: bool = False,
) -> int:
    """Writes a Python object into ``out``; returns the tensor bytes written (inline or chunked).

    Tensors, tuples, lists, str-keyed mappings, float, int, bool, str, None and
    TensorSummary messages have a wire form; anything else raises CodecError, except
    that with ``opaque_caches`` (the server's outputs and captures) a transformers
    Cache becomes null with its class name in ``Value.opaque_type``.
    """
    if _depth > MAX_DEPTH:
        raise CodecError(f"value nests deeper than {MAX_DEPTH} levels")
    torch = _torch_mod or _torch_loaded()
    if (torch is not None and isinstance(obj, torch.Tensor)) or isinstance(obj, np.ndarray):
        return encode_tensor_into(obj, out.tensor, chunker)
    if isinstance(obj, tensor_pb2.Value):
        return _copy_value(obj, out, chunker, opaque_caches)
    if isinstance(obj, tensor_pb2.TensorSummary):
        out.summary.CopyFrom(obj)
        return 0
    if obj is None:
        out.null_value = struct_pb2.NULL_VALUE
        return 0
    if isinstance(obj, (bool, np.bool_)):
        out.bool_value = bool(obj)
        return 0
    if isinstance(obj, (int, np.integer)):
        if not -(2**63) <= int(obj) < 2**63:
            raise CodecError(f"int {obj} does not fit in int64")
        out.int_value = int(obj)
        return 0
    if isinstance(obj, (float, np.floating)):
        out.float_value = float(obj)
        return 0
    if isinstance(obj, str):
        out.string_value = obj
        return 0
    if isinstance(obj, (tuple, list)):
        seq = out.list
        seq.SetInParent()
        seq.is_list = isinstance(obj, list)
        total = 0
        for item in obj:
            total += encode_value_into(item, seq.items.add(), _depth + 1, chunker=chunker, opaque_caches=opaque_caches)
        return total
    if isinstance(obj, Mapping):
        mapping = out.map
        mapping.SetInParent()
        total = 0
        for key, item in obj.items():
            if not isinstance(key, str):
                raise CodecError(f"mapping key {key!r} is not a string")
            mapping.keys.append(key)
            total += encode_value_into(item, mapping.entries[key], _depth + 1, chunker=chunker,
                                       opaque_caches=opaque_caches)
        return total
    if opaque_caches and is_opaque_cache(obj):
        out.null_value = struct_pb2.NULL_VALUE
        out.opaque_type = type(obj).__name__
        return 0
    raise CodecError(f"a value of type {type(obj).__name__} has no wire form")


def encode_value(obj: Any) -> tensor_pb2.Value:
    """A new Value holding ``obj`` (see encode_value_into)."""
    out = tensor_pb2.Value()
    encode_value_into(obj, out)
    return out


def encode_tensor(tensor: Any) -> tensor_pb2.Tensor:
    """A new Tensor holding ``tensor`` (torch or numpy)."""
    out = tensor_pb2.Tensor()
    encode_tensor_into(tensor, out)
    return out


# --------------------------------------------------------------------------- decode


def check_tensor(msg: tensor_pb2.Tensor, where: str = "tensor", *, data: bytes | None = None) -> int:
    """Validates dtype, shape and byte length (none for a chunked tensor); returns the element count.
    ``data``: ``msg.data`` when the caller has read it already (each read copies it)."""
    itemsize = ITEMSIZE.get(msg.dtype)
    if itemsize is None:
        raise CodecError(f"{where}: {dtype_name(msg.dtype)} is not a valid dtype")
    count = 1
    nonzero = 1
    for dim in msg.shape:
        if dim < 0:
            raise CodecError(f"{where}: shape {list(msg.shape)} has a negative dimension")
        count *= dim
        nonzero *= max(dim, 1)
        if nonzero * itemsize >= 2**62:  # no real tensor is this large, even with a zero dimension
            raise CodecError(f"{where}: shape {list(msg.shape)} is too large")
    if data is None:
        data = msg.data
    if msg.chunk_id:
        if data:
            raise CodecError(f"{where}: a chunked tensor (chunk_id {msg.chunk_id}) carries inline data")
        return count
    expected = count * itemsize
    if len(data) != expected:
        raise CodecError(
            f"{where}: {len(data)} bytes of data, but shape {list(msg.shape)} of "
            f"{dtype_name(msg.dtype)} needs {expected}"
        )
    return count


def decode_tensor(
    msg: tensor_pb2.Tensor, *, where: str = "tensor", as_numpy: bool = False, chunked: Mapping[int, Any] | None = None
) -> Any:
    """A torch tensor (numpy array when torch is missing or ``as_numpy``).

    The result owns writable memory: one copy of the bytes, besides the one that
    reading a protobuf ``bytes`` field makes. Without torch, a bfloat16 tensor is
    widened to float32, which represents it exactly. A chunked tensor is taken from
    ``chunked`` (see ChunkAssembler). Raises CodecError when the bytes do not match
    dtype and shape.
    """
    if msg.operand:
        raise CodecError(f"{where}: names an operand ({msg.operand!r}); only rule and readout operands may")
    data = msg.data  # a copy of the message's bytes: read once
    check_tensor(msg, where, data=data)
    if msg.chunk_id:
        if chunked is None or msg.chunk_id not in chunked:
            raise CodecError(f"{where}: the data of chunk {msg.chunk_id} did not arrive")
        return chunked[msg.chunk_id]
    shape = tuple(msg.shape)
    torch = None if as_numpy else (_torch_mod or _torch())
    if torch is not None:
        if not data:
            return torch.empty(shape, dtype=_TORCH_DTYPES[msg.dtype])
        flat = torch.frombuffer(bytearray(data), dtype=_TORCH_DTYPES[msg.dtype])
        return flat.reshape(shape)
    arr = np.frombuffer(data, dtype=_NUMPY_DTYPES[msg.dtype]).reshape(shape)
    if msg.dtype == tensor_pb2.DTYPE_BFLOAT16:
        widened = arr.astype(np.uint32)
        widened <<= 16  # in place: a 0-d array stays an array
        return widened.view(np.float32)
    return arr.copy()


def decode_value(
    msg: tensor_pb2.Value, *, where: str = "value", as_numpy: bool = False, _depth: int = 0,
    chunked: Mapping[int, Any] | None = None, on_summary: Any = None,
) -> Any:
    """The Python object a Value holds; raises CodecError naming the bad part.

    A summary (Value.summary) decodes to ``on_summary(message)``, or the
    TensorSummary message itself.
    """
    if _depth > MAX_DEPTH:
        raise CodecError(f"{where}: nests deeper than {MAX_DEPTH} levels")
    kind = msg.WhichOneof("kind")
    if kind == "tensor":
        return decode_tensor(msg.tensor, where=where, as_numpy=as_numpy, chunked=chunked)
    if kind == "summary":
        return on_summary(msg.summary) if on_summary is not None else msg.summary
    if kind == "list":
        items = [
            decode_value(item, where=f"{where}[{i}]", as_numpy=as_numpy, _depth=_depth + 1, chunked=chunked,
                         on_summary=on_summary)
            for i, item in enumerate(msg.list.items)
        ]
        return items if msg.list.is_list else tuple(items)
    if kind == "map":
        entries = msg.map.entries
        order = list(msg.map.keys) if set(msg.map.keys) == set(entries.keys()) else sorted(entries.keys())
        return {
            key: decode_value(entries[key], where=f"{where}[{key!r}]", as_numpy=as_numpy, _depth=_depth + 1,
                              chunked=chunked, on_summary=on_summary)
            for key in order
        }
    if kind == "float_value":
        return msg.float_value
    if kind == "int_value":
        return msg.int_value
    if kind == "bool_value":
        return msg.bool_value
    if kind == "string_value":
        return msg.string_value
    if kind == "null_value" or kind is None:
        return None  # also a value sent as null with an opaque_type marker (see encode_value_into)
    raise CodecError(f"{where}: unknown value kind {kind}")  # pragma: no cover


# --------------------------------------------------------------------------- chunk reassembly


def iter_tensors(msg: Any, where: str = "") -> Iterator[tuple[str, tensor_pb2.Tensor]]:
    """(where, tensor) for every Tensor inside a message (any type), depth first;
    ``where`` reads like "args[0]" or "kwargs['mask'][1]"."""
    for field, value in msg.ListFields():
        if field.type != field.TYPE_MESSAGE:
            continue
        name = "" if field.name in ("tensor", "list", "items", "map", "entries") else field.name
        prefix = f"{where}.{name}" if where and name else where or name
        if field.message_type.GetOptions().map_entry:
            items: Any = ((f"{prefix}[{key!r}]", item) for key, item in value.items())
        elif field.is_repeated:
            items = ((f"{prefix}[{i}]", item) for i, item in enumerate(value))
        else:
            items = [(prefix, value)]
        for path, item in items:
            if isinstance(item, tensor_pb2.Tensor):
                yield path or "tensor", item
            else:
                yield from iter_tensors(item, path)


def chunked_tensors(msg: Any) -> Iterator[tensor_pb2.Tensor]:
    """Every Tensor with a chunk_id inside a message."""
    return (t for _, t in iter_tensors(msg) if t.chunk_id)


class ChunkAssembler:
    """Receives the TensorChunks that follow a message into preallocated tensors.

    Memory: the tensors themselves plus the chunk being copied. Raises
    CodecError for a chunk that does not fit (unknown id, out of order, too long)
    and when the tensors claim more than ``max_bytes``.
    """

    def __init__(self, msg: Any, *, as_numpy: bool = False, max_bytes: int | None = None) -> None:
        self.tensors: dict[int, Any] = {}
        self._views: dict[int, memoryview] = {}
        self._filled: dict[int, int] = {}
        total = 0
        chunked = list(chunked_tensors(msg))
        # torch only when there is a tensor to make: most messages have none, and a
        # stream of summaries (hookwire tap) never needs to import it.
        torch = None if as_numpy or not chunked else (_torch_mod or _torch())
        for tensor in chunked:
            if tensor.chunk_id in self.tensors:
                raise CodecError(f"chunk id {tensor.chunk_id} is used twice in one message")
            count = check_tensor(tensor, f"chunked tensor {tensor.chunk_id}")
            nbytes = count * ITEMSIZE[tensor.dtype]
            total += nbytes
            if max_bytes is not None and total > max_bytes:
                raise CodecError(f"chunked tensors claim {total} bytes, over the limit of {max_bytes}")
            if torch is not None:
                value = torch.empty(tuple(tensor.shape), dtype=_TORCH_DTYPES[tensor.dtype])
                view = memoryview(value.reshape(-1).view(torch.uint8).numpy()) if nbytes else memoryview(b"")
            else:
                value = np.empty(tuple(tensor.shape), dtype=_NUMPY_DTYPES[tensor.dtype])
                view = memoryview(cast(Any, value.reshape(-1).view(np.uint8)))
            self.tensors[tensor.chunk_id] = value
            self._views[tensor.chunk_id] = view
            self._filled[tensor.chunk_id] = 0
        self._pending = {cid for cid, view in self._views.items() if len(view)}
        self._nbytes = total
        #: Bytes copied into place so far, of ``nbytes`` (what a progress bar shows).
        self.received = 0
        self._as_numpy = torch is None
        self._bf16 = {t.chunk_id for t in chunked if t.dtype == tensor_pb2.DTYPE_BFLOAT16}

    @property
    def nbytes(self) -> int:
        """Bytes of the chunked tensors."""
        return self._nbytes

    def take(self, views: Mapping[int, Any]) -> None:
        """Copies whole tensors' data into place: ``views`` maps chunk ids to their bytes
        (the data framing.cut_tensors cut out of a message). An id the message does not
        hold is skipped (its part was replaced by a later one of its oneof). CodecError
        when the bytes do not match the tensor's shape and dtype."""
        for chunk_id, data in views.items():
            view = self._views.get(chunk_id)
            if view is None:
                continue
            if len(data) != len(view):
                raise CodecError(f"a tensor has {len(data)} bytes of data, but its shape and dtype need {len(view)}")
            self.feed(RawChunk(chunk_id, 0, data))

    @property
    def done(self) -> bool:
        """Whether every chunked tensor is complete."""
        return not self._pending

    def feed(self, chunk: tensor_pb2.TensorChunk | RawChunk) -> None:
        """Copies one chunk into place: a TensorChunk, or a RawChunk (see framing),
        whose data is a view of the received bytes: then this is the only copy."""
        view = self._views.get(chunk.chunk_id)
        if view is None or chunk.chunk_id not in self._pending:
            raise CodecError(f"chunk for unknown or complete tensor {chunk.chunk_id}")
        filled = self._filled[chunk.chunk_id]
        if chunk.offset != filled:
            raise CodecError(f"chunk of tensor {chunk.chunk_id} at offset {chunk.offset}, expected {filled}")
        data = chunk.data  # each read of a TensorChunk's field copies it: read once
        end = filled + len(data)
        if end > len(view) or not len(data):
            raise CodecError(f"chunk of tensor {chunk.chunk_id} overruns its {len(view)} bytes")
        view[filled:end] = data
        self._filled[chunk.chunk_id] = end
        self.received += end - filled
        if end == len(view):
            self._pending.discard(chunk.chunk_id)

    def result(self) -> dict[int, Any]:
        """The complete tensors by chunk id (bfloat16 widened to float32 without torch)."""
        if not self._as_numpy:
            return self.tensors
        out = {}
        for cid, arr in self.tensors.items():
            if cid in self._bf16:
                widened = arr.astype(np.uint32)
                widened <<= 16
                arr = widened.view(np.float32)
            out[cid] = arr
        return out
