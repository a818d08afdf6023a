"""gRPC side of authentication: the interceptor that refuses bad credentials and
missing roles before a request is read and leaves one audit line per RPC, the principal
of a call, and TLS server credentials."""

from __future__ import annotations

import asyncio
import inspect
import logging
import pathlib
import re
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping

import grpc

from hookwire.wire import ids

from ..auth import ANONYMOUS, MINIMUM_ROLE, Principal, TokenStore, Unauthenticated
from ..errors import PermissionDenied
from ..rpc_context import CURRENT, RpcContext

#: Services anyone may call: probes and discovery.
OPEN_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")

#: The audit trail: one line per RPC (method, principal, request ids, status, duration).
audit_log = logging.getLogger("hookwire.audit")

#: Metadata a caller may send to name the call in its own terms; the audit line carries it.
CLIENT_REQUEST_ID = "x-request-id"
#: What a client's request id may be: visible ASCII, no spaces (a log line stays one
#: line and one token), at most MAX_CLIENT_REQUEST_ID characters.
MAX_CLIENT_REQUEST_ID = 128
_CLIENT_REQUEST_ID = re.compile(rf"[\x21-\x7e]{{1,{MAX_CLIENT_REQUEST_ID}}}")


def _bearer(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            scheme, _, token = str(value).partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses, before the request is read, a call with missing or wrong credentials
    (UNAUTHENTICATED) or whose principal lacks the RPC's least role (PERMISSION_DENIED,
    see MINIMUM_ROLE), and logs each RPC once when it ends (``audit``).

    A refused call's body is never received or deserialized: the handler that
    answers is request-streaming and never reads, so a large unauthenticated request
    costs the server next to nothing. Without a bearer token but with client
    certificates configured (mTLS), the principal comes from the verified
    certificate, which only the call's context shows: the call then goes through a
    request-streaming gate that checks it first and reads the request only once the
    caller is allowed. The handlers still check roles on every call (the authority);
    this is an early refusal that agrees with them.
    """

    def __init__(self, tokens: TokenStore, *, client_certs: bool, roles: Mapping[str, str] = MINIMUM_ROLE) -> None:
        self._tokens = tokens
        self._client_certs = client_certs
        self._roles = roles

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        rpc = details.method.rsplit("/", 1)[-1]
        if details.method.startswith(OPEN_PREFIXES):
            # Probes call every few seconds on every replica: their lines are DEBUG.
            if not audit_log.isEnabledFor(logging.DEBUG):
                return handler
            return audit(handler, _rpc_context(rpc, details, ANONYMOUS.name), logging.DEBUG)
        call = _rpc_context(rpc, details, "" if self._tokens.enabled else ANONYMOUS.name)
        if call.client_request_id and not _CLIENT_REQUEST_ID.fullmatch(call.client_request_id):
            shown = call.client_request_id[:MAX_CLIENT_REQUEST_ID]
            call.client_request_id = ""  # not into the log as it is
            return audit(_deny(handler, grpc.StatusCode.INVALID_ARGUMENT,
                               f"{CLIENT_REQUEST_ID} metadata: expected 1 to {MAX_CLIENT_REQUEST_ID} visible ASCII "
                               f"characters without spaces, not {shown!r}"), call)
        if not self._tokens.enabled:
            return audit(handler, call)
        role = self._roles.get(rpc)
        token = _bearer(details.invocation_metadata)
        if token is None and self._client_certs:
            return audit(_gate(handler, self._tokens, rpc, role, call), call)
        try:
            principal = self._tokens.authenticate(token)
            call.principal = principal.name
            if role is not None:
                principal.require(role, rpc)
        except (Unauthenticated, PermissionDenied) as exc:
            return audit(_deny(handler, _STATUS[type(exc)], str(exc)), call)
        return audit(handler, call)


_STATUS = {Unauthenticated: grpc.StatusCode.UNAUTHENTICATED, PermissionDenied: grpc.StatusCode.PERMISSION_DENIED}


def _deny(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler that refuses without reading: request-streaming whatever the RPC's
    kind (the wire is the same), with no deserializer, and the iterator never read."""

    async def unary(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    async def streaming(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator

    kwargs = {"response_serializer": handler.response_serializer}
    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, **kwargs)
    return grpc.stream_unary_rpc_method_handler(unary, **kwargs)


def _gate(
    handler: grpc.RpcMethodHandler, tokens: TokenStore, rpc: str, role: str | None, call: RpcContext,
) -> grpc.RpcMethodHandler:
    """``handler`` behind a check of the client certificate's principal that runs before
    the request is read (a refused body is never received); ``call`` learns the principal."""

    async def admit(context: grpc.aio.ServicerContext) -> None:
        try:
            principal = principal_of(context, tokens)
            call.principal = principal.name
            if role is not None:
                principal.require(role, rpc)
        except (Unauthenticated, PermissionDenied) as exc:
            await context.abort(_STATUS[type(exc)], str(exc))

    async def first(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        async for request in requests:
            return request
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call carried no request message")

    async def unary_unary(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        await admit(context)
        return await handler.unary_unary(await first(requests, context), context)

    async def unary_stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        await admit(context)
        async for response in handler.unary_stream(await first(requests, context), context):
            yield response

    async def stream_unary(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        await admit(context)
        return await handler.stream_unary(requests, context)

    async def stream_stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        await admit(context)
        async for response in handler.stream_stream(requests, context):
            yield response

    kwargs = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.request_streaming:
        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(stream_stream, **kwargs)
        return grpc.stream_unary_rpc_method_handler(stream_unary, **kwargs)
    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(unary_stream, **kwargs)
    return grpc.stream_unary_rpc_method_handler(unary_unary, **kwargs)


def _rpc_context(rpc: str, details: grpc.HandlerCallDetails, principal: str) -> RpcContext:
    client_request_id = ""
    for key, value in details.invocation_metadata or ():
        if key == CLIENT_REQUEST_ID:
            client_request_id = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    return RpcContext(rpc, ids.new_id(ids.REQUEST), principal, client_request_id)


def _code_of(context: grpc.aio.ServicerContext, exc: BaseException | None) -> str:
    """The status an RPC ended with: what it aborted with or set, else OK, CANCELLED (the
    client went away) or UNKNOWN (what gRPC answers for an exception it was not told of)."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if exc is None:
        return "OK"
    return "CANCELLED" if isinstance(exc, asyncio.CancelledError) else "UNKNOWN"


def _log_rpc(call: RpcContext, level: int, code: str, started: float) -> None:
    if not audit_log.isEnabledFor(level):
        return
    duration_ms = round((time.perf_counter() - started) * 1e3, 3)
    audit_log.log(level, "rpc %s %s", call.method, code, extra={
        "method": call.method, "principal": call.principal or "(unauthenticated)", "request_id": call.request_id,
        "client_request_id": call.client_request_id, "code": code, "duration_ms": duration_ms,
    })


def audit(handler: grpc.RpcMethodHandler, call: RpcContext, level: int = logging.INFO) -> grpc.RpcMethodHandler:
    """``handler`` run with ``call`` as the current RPC (rpc_context.CURRENT: log records
    of the call carry its principal and request id, its Infer or Generate call takes the
    id) and one ``hookwire.audit`` line at ``level`` once it ends, with the method, the
    principal, the server's and the client's request ids, the status code and the
    duration."""

    # CURRENT is set and never reset: gRPC runs each RPC in an asyncio task of its own,
    # whose context copy ends with it.
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        # Streaming handlers are async generators, or coroutines that write with
        # context.write (Generate's): the wrapper must be of the same kind for gRPC.
        if inspect.isasyncgenfunction(fn):
            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                CURRENT.set(call)
                started, failure = time.perf_counter(), None
                try:
                    async for response in fn(request, context):
                        yield response
                except BaseException as exc:
                    failure = exc
                    raise
                finally:
                    _log_rpc(call, level, _code_of(context, failure), started)
            return stream

        async def once(request: Any, context: grpc.aio.ServicerContext) -> Any:
            CURRENT.set(call)
            started, failure = time.perf_counter(), None
            try:
                return await fn(request, context)
            except BaseException as exc:
                failure = exc
                raise
            finally:
                _log_rpc(call, level, _code_of(context, failure), started)
        return once

    kwargs = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream), **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary), **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream), **kwargs)
    return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary), **kwargs)


def principal_of(context: grpc.aio.ServicerContext, tokens: TokenStore) -> Principal:
    """Who is calling: ANONYMOUS when authentication is off; else the principal of the
    bearer token or of the verified client certificate (mTLS); Unauthenticated otherwise."""
    if not tokens.enabled:
        return ANONYMOUS
    token = _bearer(context.invocation_metadata())
    subjects: list[str] = []
    if token is None:
        auth = context.auth_context()
        for key in ("x509_subject", "x509_common_name"):
            subjects += [v.decode() if isinstance(v, bytes) else str(v) for v in auth.get(key, [])]
        subjects += [f"CN={name}" for name in list(subjects) if "=" not in name]
    return tokens.authenticate(token, subjects)


def server_credentials(cert: str, key: str, client_ca: str | None) -> grpc.ServerCredentials:
    """TLS with a certificate chain and key; with ``client_ca``, client certificates
    are required and verified (mTLS)."""
    chain = pathlib.Path(cert).read_bytes()
    private = pathlib.Path(key).read_bytes()
    roots = pathlib.Path(client_ca).read_bytes() if client_ca else None
    return grpc.ssl_server_credentials([(private, chain)], root_certificates=roots, require_client_auth=bool(roots))
