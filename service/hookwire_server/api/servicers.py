"""gRPC servicers: decode the request, call the domain, encode the reply. Nothing else."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor

from hookwire.wire.framing import INFER_STREAM_CHUNK, RawChunk, Splicer, serializer
from hookwire.v1 import (
    harvest_service_pb2,
    harvest_service_pb2_grpc,
    hook_pb2,
    hook_service_pb2,
    hook_service_pb2_grpc,
    model_service_pb2,
    model_service_pb2_grpc,
    operand_service_pb2,
    operand_service_pb2_grpc,
    tensor_pb2,
)

from ..errors import InvalidArgument, Unavailable
from ..hooks.event_bus import DEFAULT_MAX_MESSAGE_BYTES, DeliveryLimits, chunk_bytes_for
from ..calls.harvest import HarvestManager
from ..hooks.hook_manager import HookManager
from ..calls.inference import Inference
from ..auth import MINIMUM_ROLE, TokenStore
from ..metrics import Metrics
from .security import principal_of
from ..models.model_registry import ModelRegistry
from ..hooks.slots import info_of, slot_to_proto
from ..calls.generation import Generation
from ..calls.parameters import Parameters
from ..calls.tokenization import Tokenization
from .status_mapping import paced, streaming, tolerant_parser, unary

CHUNK_TYPE = tensor_pb2.TensorChunk.DESCRIPTOR.full_name


class ModelServicer(model_service_pb2_grpc.ModelServiceServicer):
    """hookwire.v1.ModelService."""

    def __init__(
        self, registry: ModelRegistry, inference: Inference, metrics: Metrics, tokens: TokenStore,
        tokenization: Tokenization | None = None, generation: Generation | None = None,
        parameters: Parameters | None = None,
    ) -> None:
        self._registry = registry
        self._inference = inference
        self._tokenization = tokenization
        self._generation = generation
        self._parameters = parameters
        self._tokens = tokens
        self.metrics = metrics
        #: Request bounds, checked before a request is parsed (status_mapping.parse_request).
        self.limits = inference.limits

    @unary
    async def ListModels(self, request: model_service_pb2.ListModelsRequest, context: grpc.aio.ServicerContext) -> model_service_pb2.ListModelsResponse:
        principal_of(context, self._tokens).require(MINIMUM_ROLE["ListModels"], "listing models")
        return model_service_pb2.ListModelsResponse(
            models=[e.describe(with_modules=False) for e in self._registry.entries()]
        )

    @unary
    async def GetModel(self, request: model_service_pb2.GetModelRequest, context: grpc.aio.ServicerContext) -> model_service_pb2.Model:
        principal_of(context, self._tokens).require(MINIMUM_ROLE["GetModel"], "inspecting a model")
        return self._registry.entry(request.name).describe(with_modules=True)

    @unary
    async def Infer(self, request: model_service_pb2.InferRequest, context: grpc.aio.ServicerContext) -> model_service_pb2.InferResponse | bytes:
        # Large tensors are written straight into the reply's wire bytes (see Splicer).
        splicer = Splicer(snapshot=True)
        response = await self._inference.infer(request, principal=principal_of(context, self._tokens), splicer=splicer)
        return splicer.serialize(response) if splicer.kept else response

    @streaming
    async def InferStream(self, requests: AsyncIterator[model_service_pb2.InferStreamRequest], context: grpc.aio.ServicerContext) -> AsyncIterator[model_service_pb2.InferStreamResponse | bytes]:
        principal = principal_of(context, self._tokens)
        with self._inference.open_stream(principal) as uploaded:  # admitted before anything is read
            messages = self._inference.idle_limited(requests)
            first = await anext(messages, None)
            if first is None or type(first) is RawChunk or first.WhichOneof("kind") != "request":
                raise InvalidArgument("InferStream: the first message must carry the request")
            chunk_bytes = chunk_bytes_for(first.max_response_message_bytes or DEFAULT_MAX_MESSAGE_BYTES)
            response, chunker = await self._inference.infer_chunked(
                first.request, _chunks(messages), principal, uploaded=uploaded, chunk_bytes=chunk_bytes
            )
            yield model_service_pb2.InferStreamResponse(response=response)
            for chunk in chunker.frames(INFER_STREAM_CHUNK, chunk_bytes):  # wire bytes (see hookwire.wire.framing)
                yield chunk


    @unary
    async def Tokenize(self, request: model_service_pb2.TokenizeRequest, context: grpc.aio.ServicerContext) -> model_service_pb2.TokenizeResponse:
        if self._tokenization is None:
            raise Unavailable("this server does not run Tokenize")
        return await self._tokenization.tokenize(request, principal=principal_of(context, self._tokens))

    @paced("generate_idle_timeout", held="its generation slot and KV cache")
    async def Generate(self, request: model_service_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[model_service_pb2.GenerateResponse | bytes]:
        if self._generation is None:
            raise Unavailable("this server does not run Generate")
        async for message in self._generation.generate(request, principal=principal_of(context, self._tokens)):
            yield message

    @streaming
    async def GetParameters(self, request: model_service_pb2.GetParametersRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[model_service_pb2.GetParametersResponse | bytes]:
        if self._parameters is None:
            raise Unavailable("this server does not run GetParameters")
        async for message in self._parameters.read(request, principal=principal_of(context, self._tokens)):
            yield message  # chunk messages are wire bytes (see hookwire.wire.framing)


async def _chunks(
    requests: AsyncIterator[Any], rpc: str = "InferStream", first: str = "request",
) -> AsyncIterator[tensor_pb2.TensorChunk | RawChunk]:
    async for msg in requests:
        if isinstance(msg, RawChunk):  # read by hand (see add_to_server): its data is a view of the message
            yield msg
            continue
        if msg.WhichOneof("kind") != "chunk":
            raise InvalidArgument(f"{rpc}: after the {first}, only chunks may follow")
        yield msg.chunk


class HookServicer(hook_service_pb2_grpc.HookServiceServicer):
    """hookwire.v1.HookService."""

    def __init__(self, hooks: HookManager, tokens: TokenStore) -> None:
        self._hooks = hooks
        self._tokens = tokens
        self.metrics = hooks.metrics
        #: Request bounds, checked before a request is parsed (status_mapping.parse_request).
        self.limits = hooks.limits

    @streaming
    async def OpenSession(self, request: hook_service_pb2.OpenSessionRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[hook_service_pb2.SessionMessage | bytes]:
        session = self._hooks.open_session(DeliveryLimits.from_proto(request.delivery), principal_of(context, self._tokens))
        try:
            yield hook_service_pb2.SessionMessage(opened=hook_service_pb2.SessionOpened(session_id=session.session_id))
            async for msg in session.stream.messages():
                yield msg
            if session.stream.close_reason:
                raise Unavailable(session.stream.close_reason)
        finally:
            self._hooks.close_session(session.session_id)

    @unary
    async def RegisterHook(self, request: hook_service_pb2.RegisterHookRequest, context: grpc.aio.ServicerContext) -> hook_pb2.Hook:
        record = await self._hooks.register(request.session_id, request.spec, principal_of(context, self._tokens))
        return record.to_proto()

    @unary
    async def DeregisterHook(self, request: hook_service_pb2.DeregisterHookRequest, context: grpc.aio.ServicerContext) -> hook_service_pb2.DeregisterHookResponse:
        removed = await self._hooks.deregister(request.hook_id, principal_of(context, self._tokens))
        return hook_service_pb2.DeregisterHookResponse(removed=removed)

    @unary
    async def ListHooks(self, request: hook_service_pb2.ListHooksRequest, context: grpc.aio.ServicerContext) -> hook_service_pb2.ListHooksResponse:
        records = self._hooks.list_hooks(
            model=request.model, session_id=request.session_id, principal=principal_of(context, self._tokens)
        )
        return hook_service_pb2.ListHooksResponse(
            hooks=await self._hooks.describe(records, include_operand_data=request.include_operand_data)
        )

    @unary
    async def GetSlot(self, request: hook_service_pb2.GetSlotRequest, context: grpc.aio.ServicerContext) -> hook_service_pb2.Slot:
        store = self._hooks.slots(request.session_id, principal_of(context, self._tokens))
        # A slot on a vLLM model's ranks is read there, between the model's steps: off the loop.
        tensor = await asyncio.to_thread(store.read, request.name)
        return slot_to_proto(info_of(request.name, tensor), tensor)

    @unary
    async def ListSlots(self, request: hook_service_pb2.ListSlotsRequest, context: grpc.aio.ServicerContext) -> hook_service_pb2.ListSlotsResponse:
        store = self._hooks.slots(request.session_id, principal_of(context, self._tokens))
        return hook_service_pb2.ListSlotsResponse(
            slots=[slot_to_proto(info) for info in store.describe()],
            total_bytes=store.total_bytes, max_bytes=store.max_bytes,
        )

    @streaming
    async def Subscribe(self, request: hook_service_pb2.SubscribeRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[hook_service_pb2.SessionMessage | bytes]:
        sub = self._hooks.subscribe(
            request.hook_ids, DeliveryLimits.from_proto(request.delivery), principal_of(context, self._tokens)
        )
        try:
            yield hook_service_pb2.SessionMessage(subscribed=hook_service_pb2.Subscribed(hook_ids=list(sub.hook_ids)))
            async for msg in sub.stream.messages():
                yield msg
            if sub.stream.close_reason:
                raise Unavailable(sub.stream.close_reason)
        finally:
            self._hooks.unsubscribe(sub)


class OperandServicer(operand_service_pb2_grpc.OperandServiceServicer):
    """hookwire.v1.OperandService."""

    def __init__(self, hooks: HookManager, inference: Inference, tokens: TokenStore) -> None:
        self._hooks = hooks
        self._operands = hooks.operands
        self._inference = inference
        self._tokens = tokens
        self.metrics = hooks.metrics
        #: Request bounds, checked before a request is parsed (status_mapping.parse_request).
        self.limits = hooks.limits

    @unary
    async def UploadOperand(self, requests: AsyncIterator[operand_service_pb2.UploadOperandRequest], context: grpc.aio.ServicerContext) -> operand_service_pb2.NamedOperand:
        principal = principal_of(context, self._tokens)
        principal.require(MINIMUM_ROLE["UploadOperand"], "uploading an operand")
        self._hooks.refuse_when_draining()
        messages = self._inference.idle_limited(requests, "UploadOperand")
        first = await anext(messages, None)
        if first is None or type(first) is RawChunk or first.WhichOneof("kind") != "operand":
            raise InvalidArgument("UploadOperand: the first message must carry the operand (its header)")
        stored = await self._operands.upload(
            principal, first.operand, _chunks(messages, "UploadOperand", "operand"),
            require_session=lambda session_id: self._hooks.require_session(session_id, principal, owner_only=True),
        )
        return stored.to_proto(principal)

    @unary
    async def DeleteOperand(self, request: operand_service_pb2.DeleteOperandRequest, context: grpc.aio.ServicerContext) -> operand_service_pb2.DeleteOperandResponse:
        nbytes = self._operands.delete(principal_of(context, self._tokens), request.name, request.owner)
        return operand_service_pb2.DeleteOperandResponse(nbytes=nbytes)

    @unary
    async def ListOperands(self, request: operand_service_pb2.ListOperandsRequest, context: grpc.aio.ServicerContext) -> operand_service_pb2.ListOperandsResponse:
        principal = principal_of(context, self._tokens)
        return operand_service_pb2.ListOperandsResponse(
            operands=[op.to_proto(principal) for op in self._operands.listing(principal)],
            total_bytes=self._operands.bytes_of(principal.name), max_bytes=self.limits.max_operand_bytes_per_principal,
        )

    @unary
    async def PublishOperand(self, request: operand_service_pb2.PublishOperandRequest, context: grpc.aio.ServicerContext) -> operand_service_pb2.NamedOperand:
        principal = principal_of(context, self._tokens)
        principal.require(MINIMUM_ROLE["PublishOperand"], "publishing an operand")
        stored = await asyncio.to_thread(self._operands.publish, principal, request.name, request.path)
        return stored.to_proto(principal)


class HarvestServicer(harvest_service_pb2_grpc.HarvestServiceServicer):
    """hookwire.v1.HarvestService."""

    def __init__(self, harvests: HarvestManager, tokens: TokenStore, metrics: Metrics) -> None:
        self._harvests = harvests
        self._tokens = tokens
        self.metrics = metrics
        #: Request bounds, checked before a request is parsed (status_mapping.parse_request).
        self.limits = harvests.limits

    @unary
    async def StartHarvest(self, request: harvest_service_pb2.StartHarvestRequest, context: grpc.aio.ServicerContext) -> harvest_service_pb2.HarvestJob:
        job = await self._harvests.start(request, principal_of(context, self._tokens))
        return job.to_proto()

    @unary
    async def GetHarvest(self, request: harvest_service_pb2.GetHarvestRequest, context: grpc.aio.ServicerContext) -> harvest_service_pb2.HarvestJob:
        return self._harvests.get(request.job_id, principal_of(context, self._tokens))

    @streaming
    async def WatchHarvest(self, request: harvest_service_pb2.WatchHarvestRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[harvest_service_pb2.HarvestJob]:
        async for msg in self._harvests.watch(request.job_id, principal_of(context, self._tokens), request.interval_ms):
            yield msg

    @unary
    async def CancelHarvest(self, request: harvest_service_pb2.CancelHarvestRequest, context: grpc.aio.ServicerContext) -> harvest_service_pb2.HarvestJob:
        return await self._harvests.cancel(request.job_id, principal_of(context, self._tokens))

    @unary
    async def ListHarvests(self, request: harvest_service_pb2.ListHarvestsRequest, context: grpc.aio.ServicerContext) -> harvest_service_pb2.ListHarvestsResponse:
        return harvest_service_pb2.ListHarvestsResponse(jobs=self._harvests.list_jobs(request, principal_of(context, self._tokens)))


def add_to_server(servicer: Any, service: ServiceDescriptor, server: grpc.aio.Server) -> None:
    """Registers a servicer like the generated add_*_to_server, but with request
    parsers that let malformed bytes become INVALID_ARGUMENT instead of INTERNAL, and
    that read a request message holding only a TensorChunk (InferStream's uploads) as
    a RawChunk, a view of gRPC's bytes copied once into its tensor (hookwire.wire.framing);
    and with response serializers that send ``bytes`` as they are: the chunk messages
    that streams send are built by hand."""
    handlers = {}
    for method in service.methods:
        request_class = message_factory.GetMessageClass(method.input_type)
        chunk_field = next((f.number for f in method.input_type.fields
                            if f.message_type is not None and f.message_type.full_name == CHUNK_TYPE), None)
        response_class = message_factory.GetMessageClass(method.output_type)
        factory = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = factory(
            getattr(servicer, method.name),
            request_deserializer=tolerant_parser(request_class, chunk_field=chunk_field),
            response_serializer=serializer(response_class),
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
