"""Domain errors -> gRPC status, in one table; anything unexpected -> INTERNAL with an incident id."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import secrets
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import grpc

from hookwire.wire.framing import read_frame

from .. import errors

from . import request_bounds
from ..auth import Unauthenticated
from ..limits import Limits
from ..memory import trim_heap
from .request_bounds import RequestBounds

log = logging.getLogger("hookwire.rpc")

STATUS_OF: dict[type[errors.HookwireServerError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.Unimplemented: grpc.StatusCode.UNIMPLEMENTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
}

Req = TypeVar("Req")
Resp = TypeVar("Resp")


def status_of(exc: errors.HookwireServerError) -> grpc.StatusCode:
    """The status code a domain error becomes."""
    for cls in type(exc).__mro__:
        code = STATUS_OF.get(cls)  # type: ignore[call-overload]
        if code is not None:
            return code
    return grpc.StatusCode.UNKNOWN  # pragma: no cover - every subclass is in the table


def _refusal(method: str, exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status and details a failure becomes (an unexpected one logged as an incident
    first); then ``exc`` lets go of its frames (errors.drop_tracebacks). gRPC keeps the
    AbortError it raises in a reference cycle with the call's state, which only a full
    garbage collection frees, and that error's context is the failure: through the
    failure's tracebacks, the frames it passed would keep what the call had read (a
    refused request's 64 MiB operand) until then."""
    if isinstance(exc, errors.HookwireServerError):
        code, details = status_of(exc), str(exc)
    else:
        incident = secrets.token_hex(6)
        log.exception("incident %s in %s", incident, method, exc_info=exc, extra={"incident": incident})
        code, details = grpc.StatusCode.INTERNAL, f"internal error (incident {incident}); see the server log"
    errors.drop_tracebacks(exc)
    return code, details


#: A refused request of at least this many bytes gives the heap's freed memory back
#: (memory.trim_heap, on a thread): its decoded tensors were freed, not returned; no
#: model worker goes idle after it, to trim (models/worker.py).
TRIM_AFTER_REFUSED_BYTES = 16 * 1024 * 1024

#: Fields of a request scanned on the event loop: a request holding no more (however
#: many bytes its tensors take) is checked and parsed right there, in well under a
#: millisecond; one holding more is scanned again and parsed on PARSERS.
INLINE_FIELDS = 4096

#: Threads that scan and parse requests with many fields: their own, so that a flood of
#: such requests queues here and not in front of other calls' work (asyncio's default
#: executor runs the tensor checks of Infer calls with lists or maps, and request-hook compilation).
PARSERS = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="hookwire-parse")


class RawRequest:
    """Request bytes not parsed yet. gRPC calls the deserializer on the event loop;
    the wrapped handler checks the bytes against the request bounds and parses them,
    off the loop when they hold many fields (see ``parse_request``)."""

    __slots__ = ("message_class", "data")

    def __init__(self, message_class: Any, data: bytes) -> None:
        self.message_class = message_class
        self.data = data

    def parse(self, bounds: RequestBounds) -> Any:
        """The message; InvalidArgument or ResourceExhausted (naming the limit) when it
        passes a bound or does not parse. Costs O(min(size, bounds)) before the parse."""
        descriptor = self.message_class.DESCRIPTOR
        request_bounds.check(self.data, descriptor, bounds)
        try:
            return self.message_class.FromString(self.data)
        except Exception as exc:  # DecodeError, and anything else a parser may raise on garbage
            # gRPC itself would answer INTERNAL for bytes that do not parse.
            raise errors.InvalidArgument(
                f"the request is not a valid {descriptor.full_name} message: {str(exc) or type(exc).__name__}"
            ) from None


def tolerant_parser(message_class: Any, *, chunk_field: int | None = None) -> Callable[[bytes], Any]:
    """A request deserializer that never raises: it wraps the bytes in a RawRequest,
    which the ``unary``/``streaming`` wrappers parse (so malformed bytes become
    INVALID_ARGUMENT, not gRPC's INTERNAL, and nothing large is parsed on the loop).
    With ``chunk_field`` (the message's TensorChunk field), a message holding only a
    chunk is read at once as a RawChunk (see hookwire.wire.framing; it has no field the
    request bounds limit), without copying its data."""

    def parse(data: bytes) -> Any:
        return RawRequest(message_class, data)

    if chunk_field is None:
        return parse
    tag = (chunk_field << 3) | 2

    def parse_or_read_chunk(data: bytes) -> Any:
        if data and data[0] == tag:
            chunk = read_frame(data, chunk_field)
            if chunk is not None:
                return chunk
        return RawRequest(message_class, data)

    return parse_or_read_chunk


async def parse_request(request: Any, servicer: Any) -> Any:
    """The parsed message for a RawRequest (anything else as it is), checked against the
    servicer's ``limits``; a request of more than INLINE_FIELDS fields is checked and
    parsed on a PARSERS thread, so a wide request never stalls the event loop (health
    checks, other calls)."""
    if not isinstance(request, RawRequest):
        return request
    limits: Limits = getattr(servicer, "limits", None) or Limits()
    try:
        try:
            return request.parse(RequestBounds(limits, min(limits.max_request_fields, INLINE_FIELDS)))
        except request_bounds.TooManyFields:
            if limits.max_request_fields <= INLINE_FIELDS:
                raise
        return await asyncio.get_running_loop().run_in_executor(PARSERS, request.parse, RequestBounds(limits))
    finally:
        # Parsed or refused, the bytes are done with: an interceptor's frame holding the
        # RawRequest (kept with a refused call's AbortError, see _refusal) holds no more.
        request.data = b""


async def _parsed_stream(requests: AsyncIterator[Any], servicer: Any) -> AsyncIterator[Any]:
    async for request in requests:
        yield await parse_request(request, servicer)


def _count(servicer: Any, method: str, code: str) -> None:
    metrics = getattr(servicer, "metrics", None)
    if metrics is not None:
        metrics.rpcs.labels(method, code, "grpc").inc()


def _code_of(exc: BaseException) -> str:
    if isinstance(exc, errors.HookwireServerError):
        return status_of(exc).name
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return "CANCELLED"
    return "INTERNAL"


def unary(fn: Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]]) -> Callable[..., Awaitable[Resp]]:
    """Wraps a servicer method with a single response (unary, or client streaming: each
    message is parsed as it is read) with the status mapping and RPC metrics."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Req, context: grpc.aio.ServicerContext) -> Resp:
        size = len(request.data) if isinstance(request, RawRequest) else 0
        try:
            if hasattr(request, "__aiter__"):
                request = _parsed_stream(request, self)  # type: ignore[assignment,arg-type]
            request = await parse_request(request, self)
            response = await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except BaseException as exc:
            _count(self, fn.__name__, _code_of(exc))
            if not isinstance(exc, Exception):
                raise
            refusal = _refusal(fn.__name__, exc)
        else:
            _count(self, fn.__name__, "OK")
            return response
        # Out of the handler, so that the AbortError has no context; and the request let
        # go: gRPC keeps that error, with its traceback (this frame), until a collection.
        request = None  # type: ignore[assignment]
        if size >= TRIM_AFTER_REFUSED_BYTES:
            await asyncio.to_thread(trim_heap)
        await context.abort(*refusal)
        raise AssertionError("unreachable: abort raises")

    return wrapper


class _stream_status:  # noqa: N801 - used as a function, in `async with`
    """The status mapping and RPC metrics of a streaming servicer method, as ``async
    with _stream_status(servicer, method, context, request) as stream``: a domain error becomes
    its status (the method's iterator, ``stream.inner``, is closed first, so that its
    cleanup frees what the call held before the status goes out); the iterator is closed
    when the RPC ends for any reason, not whenever it is collected (ending a session and
    removing its hooks, freeing a generation's KV cache, must run then). A class, not a
    generator: the RPC's wrapper enters and leaves it without a frame of its own."""

    __slots__ = ("servicer", "method", "context", "inner", "request")

    def __init__(self, servicer: Any, method: str, context: grpc.aio.ServicerContext, request: Any) -> None:
        self.servicer = servicer
        self.method = method
        self.context = context
        #: The servicer method's iterator, once the wrapper made it.
        self.inner: Any = None
        #: The request as received, until the wrapper parses it (``parsed``): held here, not
        #: by the wrapper's frame, which a failure's AbortError keeps (see _refusal).
        self.request: Any = request

    async def parsed(self) -> Any:
        """The request, parsed (parse_request); this no longer holds it."""
        request, self.request = self.request, None
        return await parse_request(request, self.servicer)

    async def __aenter__(self) -> _stream_status:
        return self

    async def __aexit__(self, kind: Any, exc: BaseException | None, tb: Any) -> bool:
        code = "OK"
        try:
            if exc is None or isinstance(exc, grpc.aio.AbortError):
                return False
            code = _code_of(exc)
            if not isinstance(exc, Exception):
                return False
            if self.inner is not None:
                await self.inner.aclose()
            refusal = _refusal(self.method, exc)  # (its frames let go: the AbortError's context is exc)
            self.request = tb = None  # this frame is on the AbortError's traceback too
            await self.context.abort(*refusal)
            return False
        finally:
            _count(self.servicer, self.method, code)
            if self.inner is not None:
                await self.inner.aclose()


def streaming(
    fn: Callable[[Any, Req, grpc.aio.ServicerContext], AsyncIterator[Resp]],
) -> Callable[..., AsyncIterator[Resp]]:
    """Wraps a streaming servicer method with the status mapping and RPC metrics."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Req, context: grpc.aio.ServicerContext) -> AsyncIterator[Resp]:
        if hasattr(request, "__aiter__"):  # client streaming: each message is parsed as it is read
            request = _parsed_stream(request, self)  # type: ignore[assignment,arg-type]
        status = _stream_status(self, fn.__name__, context, request)
        del request  # (the status holds it: see _stream_status.request)
        async with status as stream:
            stream.inner = fn(self, await stream.parsed(), context)
            async for item in stream.inner:
                yield item

    return wrapper


def paced(setting: str, held: str) -> Callable[[Callable[[Any, Req, grpc.aio.ServicerContext], AsyncIterator[Resp]]], Callable[..., Awaitable[None]]]:
    """Like ``streaming``, for a server-streaming method whose call holds resources while
    it runs (Generate: a slot and a KV cache): each message is written with a bound, the
    servicer's ``limits.<setting>`` seconds. A client that takes no message for that long
    (a connected reader that stopped reading: gRPC's flow control holds the write) ends
    the call with DEADLINE_EXCEEDED naming the setting, and the method's iterator is
    closed, so its cleanup frees what the call held (``held``, for the message)."""

    def wrap(
        fn: Callable[[Any, Req, grpc.aio.ServicerContext], AsyncIterator[Resp]],
    ) -> Callable[..., Awaitable[None]]:
        @functools.wraps(fn)
        async def wrapper(self: Any, request: Req, context: grpc.aio.ServicerContext) -> None:
            status = _stream_status(self, fn.__name__, context, request)
            del request  # (the status holds it: see _stream_status.request)
            async with status as stream:
                stream.inner = fn(self, await stream.parsed(), context)
                idle = getattr(self.limits, setting)
                async for item in stream.inner:
                    try:
                        async with asyncio.timeout(idle):
                            await context.write(item)
                    except TimeoutError:
                        raise errors.DeadlineExceeded(
                            f"{fn.__name__}: the client read nothing for {idle:g} s ({setting}); the call ended and "
                            f"freed {held}"
                        ) from None

        return wrapper

    return wrap
