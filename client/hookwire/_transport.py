"""What the SDK's calls need of a client, below the Client class: the callables of the
RPCs that carry large tensors (TensorCalls), a unary call with its error translated
(``unary``), and the protocols that _generation and _harvest type their client with.
_client implements them; nothing here imports _client (or any module that does), so
_client imports _generation and _harvest without an import cycle.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import grpc

from ._errors import from_rpc_error
from .v1 import harvest_service_pb2_grpc, hook_service_pb2, model_service_pb2, operand_service_pb2
from .wire.framing import (
    GENERATE_RESPONSE_CHUNK, GET_PARAMETERS_CHUNK, INFER_STREAM_CHUNK, SESSION_MESSAGE_CHUNK, deserializer, serializer,
)

#: Tensors of an Infer reply this large are read without protobuf (see TensorCalls).
CUT_TENSOR_BYTES = 64 * 1024


class _Options(Protocol):
    @property
    def timeout(self) -> float | None: ...


class Transport(Protocol):
    """A connected client, as the calls below it use one (hookwire.Client is one)."""

    @property
    def target(self) -> str: ...

    @property
    def options(self) -> _Options: ...

    @property
    def tensor_calls(self) -> TensorCalls: ...

    @property
    def harvest_stub(self) -> harvest_service_pb2_grpc.HarvestServiceStub: ...

    def model(self, name: str) -> Any: ...

    def own_call(self, session_id: str) -> Callable[[], None]:
        """Counts a call made in session ``session_id`` as in flight on that session's
        stream until the returned function is called (see EventRouter.own_call)."""


async def unary(client: Transport, method: Any, request: Any) -> Any:
    """``method(request)`` with the client's timeout; a gRPC error becomes a HookwireError."""
    try:
        return await method(request, timeout=client.options.timeout)
    except grpc.RpcError as exc:
        raise from_rpc_error(exc, target=client.target) from None


class TensorCalls:
    """The SDK's own callables for the RPCs that carry large tensors. They differ from
    the generated stubs' only in how tensor bytes are read and written (see hookwire.wire.framing):
    a stream message that holds only a TensorChunk is read as a RawChunk, whose data
    is a view of the received bytes (copied once, into its tensor); any other message
    holding tensors of at least CUT_TENSOR_BYTES is parsed with their data cut out (a
    CutReply: views of the received bytes, copied once each into their tensors);
    InferStream sends its chunks as wire bytes built by hand. Everything else is
    parsed and serialized by protobuf, as the stubs do."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.infer = channel.unary_unary(
            "/hookwire.v1.ModelService/Infer",
            request_serializer=model_service_pb2.InferRequest.SerializeToString,
            response_deserializer=deserializer(model_service_pb2.InferResponse, None, CUT_TENSOR_BYTES),
            _registered_method=True,
        )
        self.open_session = channel.unary_stream(
            "/hookwire.v1.HookService/OpenSession",
            request_serializer=hook_service_pb2.OpenSessionRequest.SerializeToString,
            response_deserializer=deserializer(hook_service_pb2.SessionMessage, SESSION_MESSAGE_CHUNK, CUT_TENSOR_BYTES),
            _registered_method=True,
        )
        self.subscribe = channel.unary_stream(
            "/hookwire.v1.HookService/Subscribe",
            request_serializer=hook_service_pb2.SubscribeRequest.SerializeToString,
            response_deserializer=deserializer(hook_service_pb2.SessionMessage, SESSION_MESSAGE_CHUNK, CUT_TENSOR_BYTES),
            _registered_method=True,
        )
        self.infer_stream = channel.stream_stream(
            "/hookwire.v1.ModelService/InferStream",
            request_serializer=serializer(model_service_pb2.InferStreamRequest),
            response_deserializer=deserializer(model_service_pb2.InferStreamResponse, INFER_STREAM_CHUNK, CUT_TENSOR_BYTES),
            _registered_method=True,
        )
        self.generate = channel.unary_stream(
            "/hookwire.v1.ModelService/Generate",
            request_serializer=model_service_pb2.GenerateRequest.SerializeToString,
            response_deserializer=deserializer(model_service_pb2.GenerateResponse, GENERATE_RESPONSE_CHUNK, CUT_TENSOR_BYTES),
            _registered_method=True,
        )
        # Its chunks are wire bytes built by hand, as InferStream's (see hookwire.wire.framing).
        self.upload_operand = channel.stream_unary(
            "/hookwire.v1.OperandService/UploadOperand",
            request_serializer=serializer(operand_service_pb2.UploadOperandRequest),
            response_deserializer=operand_service_pb2.NamedOperand.FromString,
            _registered_method=True,
        )
        self.get_parameters = channel.unary_stream(
            "/hookwire.v1.ModelService/GetParameters",
            request_serializer=model_service_pb2.GetParametersRequest.SerializeToString,
            response_deserializer=deserializer(model_service_pb2.GetParametersResponse, GET_PARAMETERS_CHUNK, CUT_TENSOR_BYTES),
            _registered_method=True,
        )
