"""Reading a model's parameters (GetParameters) into tensors."""

from __future__ import annotations

from typing import Any, Sequence

import grpc

from .wire import codec
from ._errors import HookwireError, from_rpc_error
from .wire.framing import RawChunk
from ._progress import TransferProgress
from ._session import kind_of, uncut
from ._specs import _CASTS, CastName
from .v1 import model_service_pb2, tensor_pb2


def parameters_request(
    model: str, names: Sequence[str], dtype: CastName | None, max_response_message_bytes: int,
) -> model_service_pb2.GetParametersRequest:
    """The GetParametersRequest for ``names`` (exact names or globs); ValueError for no
    names or an unknown ``dtype``, TypeError for a name that is not a string."""
    if not names:
        raise ValueError("name at least one parameter: exact names, or globs ('**' for every parameter)")
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"parameter names are strings (pass several as separate arguments), not {name!r}")
    if dtype is not None and dtype not in _CASTS:
        raise ValueError(f"dtype must be one of {sorted(_CASTS)} or None, not {dtype!r}")
    return model_service_pb2.GetParametersRequest(
        model=model, names=list(names), dtype=_CASTS[dtype] if dtype is not None else tensor_pb2.DTYPE_UNSPECIFIED,
        max_response_message_bytes=min(max_response_message_bytes, 2**32 - 1),
    )


async def read_parameters(
    call: grpc.aio.UnaryStreamCall, *, target: str = "", progress: TransferProgress | None = None,
) -> dict[str, Any]:
    """The parameters a GetParameters ``call`` (made with Client.tensor_calls, so chunk
    messages arrive as RawChunks) streams, by name, in the order they arrive (the
    model's named_parameters order). Each chunked tensor is allocated once and every
    chunk copied into it as it arrives: memory is the tensors plus one message. Raises
    the SDK's error for the call's status, HookwireError (DATA_LOSS) for a stream that
    breaks the protocol; cancels the call on the way out, whatever happened. ``progress``
    is fed the bytes received so far (the total is not known before the end)."""
    out: dict[str, Any] = {}
    before = 0  # bytes of the parameters already complete
    try:
        while (msg := await call.read()) is not grpc.aio.EOF:
            if kind_of(msg) != "parameter":
                if kind_of(msg) == "chunk":
                    raise HookwireError("GetParameters: a chunk arrived without its parameter", code="DATA_LOSS")
                continue  # a kind this SDK does not know yet
            msg, views = uncut(msg)
            parameter = msg.parameter
            assembler = codec.ChunkAssembler(parameter)
            assembler.take(views)
            if progress is not None:
                progress.update(before + assembler.received)
            while not assembler.done:
                chunk = await call.read()
                if type(chunk) is RawChunk:  # read by hand: its data is a view of the message, copied once
                    assembler.feed(chunk)
                elif chunk is not grpc.aio.EOF and kind_of(chunk) == "chunk":
                    assembler.feed(chunk.chunk)
                else:
                    raise HookwireError(f"GetParameters: the stream ended before the chunks of {parameter.name!r} "
                                        "were complete", code="DATA_LOSS")
                if progress is not None:
                    progress.update(before + assembler.received)
            before += assembler.received
            out[parameter.name] = codec.decode_tensor(parameter.tensor, where=parameter.name,
                                                       chunked=assembler.result())
    except grpc.RpcError as exc:
        raise from_rpc_error(exc, target=target) from None
    except codec.CodecError as exc:
        raise HookwireError(f"GetParameters: {exc}", code="DATA_LOSS") from None
    finally:
        call.cancel()  # a no-op once it has finished
    return out
