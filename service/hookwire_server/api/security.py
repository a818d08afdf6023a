"""gRPC side of authentication: the interceptor that refuses bad credentials and
missing roles before a request is read, the principal of a call, and TLS server
credentials."""

from __future__ import annotations

import pathlib
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping

import grpc

from ..auth import ANONYMOUS, MINIMUM_ROLE, Principal, TokenStore, Unauthenticated
from ..errors import PermissionDenied

#: Services anyone may call: probes and discovery.
OPEN_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")


def _bearer(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            scheme, _, token = str(value).partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses, before the request is read, a call with missing or wrong credentials
    (UNAUTHENTICATED) or whose principal lacks the RPC's least role (PERMISSION_DENIED,
    see MINIMUM_ROLE).

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
        if handler is None or not self._tokens.enabled or details.method.startswith(OPEN_PREFIXES):
            return handler
        rpc = details.method.rsplit("/", 1)[-1]
        role = self._roles.get(rpc)
        token = _bearer(details.invocation_metadata)
        if token is None and self._client_certs:
            return _gate(handler, self._tokens, rpc, role)
        try:
            principal = self._tokens.authenticate(token)
            if role is not None:
                principal.require(role, rpc)
        except (Unauthenticated, PermissionDenied) as exc:
            return _deny(handler, _STATUS[type(exc)], str(exc))
        return handler


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


def _gate(handler: grpc.RpcMethodHandler, tokens: TokenStore, rpc: str, role: str | None) -> grpc.RpcMethodHandler:
    """``handler`` behind a check of the client certificate's principal that runs before
    the request is read (a refused body is never received)."""

    async def admit(context: grpc.aio.ServicerContext) -> None:
        try:
            principal = principal_of(context, tokens)
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
