"""Domain errors -> gRPC status, in one table; anything unexpected -> INTERNAL with an incident id."""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import grpc

from . import errors
from .auth import Unauthenticated

log = logging.getLogger("hookwire.rpc")

STATUS_OF: dict[type[errors.HookwireServerError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
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


async def _abort(context: grpc.aio.ServicerContext, method: str, exc: BaseException) -> None:
    if isinstance(exc, errors.HookwireServerError):
        await context.abort(status_of(exc), str(exc))
    incident = secrets.token_hex(6)
    log.exception("incident %s in %s", incident, method, exc_info=exc, extra={"incident": incident})
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error (incident {incident}); see the server log")


class MalformedRequest:
    """Stands in for request bytes that do not parse, so the handler can answer
    INVALID_ARGUMENT (gRPC itself would answer INTERNAL)."""

    def __init__(self, message_type: str, error: str) -> None:
        self.message_type = message_type
        self.error = error

    def to_error(self) -> errors.InvalidArgument:
        """The domain error it becomes."""
        return errors.InvalidArgument(f"the request is not a valid {self.message_type} message: {self.error}")


def tolerant_parser(message_class: Any) -> Callable[[bytes], Any]:
    """A request deserializer that returns MalformedRequest instead of raising."""
    name = message_class.DESCRIPTOR.full_name

    def parse(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except Exception as exc:  # DecodeError, and anything else a parser may raise on garbage
            return MalformedRequest(name, str(exc) or type(exc).__name__)

    return parse


def _count(servicer: Any, method: str, code: str) -> None:
    metrics = getattr(servicer, "metrics", None)
    if metrics is not None:
        metrics.rpcs.labels(method, code).inc()


def _code_of(exc: BaseException) -> str:
    if isinstance(exc, errors.HookwireServerError):
        return status_of(exc).name
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return "CANCELLED"
    return "INTERNAL"


def unary(fn: Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]]) -> Callable[..., Awaitable[Resp]]:
    """Wraps a unary servicer method with the status mapping and RPC metrics."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Req, context: grpc.aio.ServicerContext) -> Resp:
        try:
            if isinstance(request, MalformedRequest):
                raise request.to_error()
            response = await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except BaseException as exc:
            _count(self, fn.__name__, _code_of(exc))
            if not isinstance(exc, Exception):
                raise
            await _abort(context, fn.__name__, exc)
            raise  # unreachable: abort raises
        _count(self, fn.__name__, "OK")
        return response

    return wrapper


def streaming(
    fn: Callable[[Any, Req, grpc.aio.ServicerContext], AsyncIterator[Resp]],
) -> Callable[..., AsyncIterator[Resp]]:
    """Wraps a streaming servicer method with the status mapping and RPC metrics."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Req, context: grpc.aio.ServicerContext) -> AsyncIterator[Resp]:
        inner = fn(self, request, context)
        code = "OK"
        try:
            if isinstance(request, MalformedRequest):
                raise request.to_error()
            async for item in inner:
                yield item
        except grpc.aio.AbortError:
            raise
        except BaseException as exc:
            code = _code_of(exc)
            if not isinstance(exc, Exception):
                raise
            await _abort(context, fn.__name__, exc)
        finally:
            _count(self, fn.__name__, code)
            # Closed now, not whenever it is collected: its cleanup (ending a
            # session and removing its hooks) must run when the stream ends.
            await inner.aclose()  # type: ignore[attr-defined]

    return wrapper
