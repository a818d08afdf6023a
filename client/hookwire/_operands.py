"""Named operands on the client side: what the server says about one (OperandInfo) and
the messages of an upload (header, then chunks as wire bytes). Client implements the
calls (upload_operand, ...); nothing here imports _client."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any, Iterator

import numpy as np

from .rules import Operand, Sae
from .v1 import operand_service_pb2, rule_pb2
from .wire import codec
from .wire.framing import UPLOAD_OPERAND_CHUNK

#: Data bytes per chunk message of an upload (well under any peer's 4 MiB receive limit).
UPLOAD_CHUNK_BYTES = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class OperandInfo:
    """An operand kept on the server (``client.list_operands()``, ``upload_operand``)."""

    name: str
    #: "tensor" or "sae".
    kind: str
    #: A tensor's dtype ("float32", ...) and shape; an SAE's W_enc dtype and (d_in, d_sae).
    dtype: str
    shape: tuple[int, ...]
    #: Bytes it takes on the server (once).
    nbytes: int
    #: Who uploaded it ("" for a published operand).
    owner: str
    #: The session it lives with ("" for a TTL or a published one).
    session_id: str
    #: When its TTL ends, if it has one.
    expires: datetime.datetime | None
    #: Published by the server's operator: read-only, everyone's.
    published: bool
    #: Its session or TTL is over; it lives on for ``used_by`` only.
    ended: bool
    #: The hooks and harvest jobs that use it (yours; an operator sees all).
    used_by: tuple[str, ...]
    #: The wire message.
    raw: operand_service_pb2.NamedOperand = dataclasses.field(repr=False, compare=False)

    @classmethod
    def from_proto(cls, msg: operand_service_pb2.NamedOperand) -> OperandInfo:
        """Builds it from the wire message."""
        sae = msg.kind == operand_service_pb2.OPERAND_KIND_SAE
        tensor = msg.sae.w_enc if sae else msg.tensor
        return cls(
            name=msg.name, kind="sae" if sae else "tensor",
            dtype=codec.dtype_name(tensor.dtype).removeprefix("DTYPE_").lower(), shape=tuple(tensor.shape),
            nbytes=msg.nbytes, owner=msg.owner, session_id=msg.session_id,
            expires=msg.expires.ToDatetime(tzinfo=datetime.timezone.utc) if msg.HasField("expires") else None,
            published=msg.published, ended=msg.ended, used_by=tuple(msg.used_by), raw=msg,
        )

    @property
    def ref(self) -> Operand | Sae:
        """What a rule takes to use it: ``rules.operand(name)`` or ``rules.Sae.named(name)``."""
        return Sae.named(self.name) if self.kind == "sae" else Operand(self.name)


def upload_messages(
    name: str, value: Any, *, session_id: str = "", ttl_seconds: int = 0, chunk_bytes: int = UPLOAD_CHUNK_BYTES,
) -> Iterator[operand_service_pb2.UploadOperandRequest | bytes]:
    """The messages of UploadOperand: the header, then each chunked tensor's data as
    wire bytes (one copy each, made as they are sent). ``value``: a tensor (torch,
    numpy) or an ``Sae`` with its tensors (not ``Sae.named``). Raises ValueError for
    anything else."""
    header = operand_service_pb2.OperandUpload(name=name, session_id=session_id, ttl_seconds=ttl_seconds)
    chunker = codec.Chunker(snapshot=False)  # the upload is awaited: the tensors do not change meanwhile
    if isinstance(value, Sae):
        if value.is_named:
            raise ValueError(f"Sae.named({value.message.operand!r}) is a reference; upload an Sae with its tensors")
        _sae_into(value.message, header.sae, chunker)
    elif isinstance(value, Operand):
        raise ValueError(f"operand({value.name!r}) is a reference; upload a tensor")
    else:
        codec.encode_tensor_into(value, header.tensor, chunker)
    yield operand_service_pb2.UploadOperandRequest(operand=header)
    yield from chunker.frames(UPLOAD_OPERAND_CHUNK, chunk_bytes)


def _sae_into(msg: rule_pb2.Sae, out: rule_pb2.Sae, chunker: codec.Chunker) -> None:
    """``msg``'s configuration into ``out``, its large tensors' bytes moved to ``chunker``
    (as they are: no decoding, so every dtype keeps its exact bytes)."""
    out.CopyFrom(msg)
    for field in ("w_enc", "b_enc", "w_dec", "b_dec", "threshold"):
        if out.HasField(field):
            tensor = getattr(out, field)
            raw = tensor.data  # one copy, which the chunk messages are cut from
            if chunker.keeps(len(raw)):
                tensor.data = b""
                chunker.place(tensor, np.frombuffer(raw, dtype=np.uint8))
