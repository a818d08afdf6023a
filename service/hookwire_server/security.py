"""gRPC side of authentication: the interceptor that rejects bad credentials before a
handler runs, the principal of a call, and TLS server credentials."""

from __future__ import annotations

import pathlib
from typing import Any, Awaitable, Callable

import grpc

from .auth import ANONYMOUS, Principal, TokenStore, Unauthenticated

#: Services anyone may call: probes and discovery.
OPEN_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")


def _bearer(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            scheme, _, token = str(value).partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects a wrong bearer token, or a missing one when no client certificate can
    stand in for it, with UNAUTHENTICATED before the handler runs."""

    def __init__(self, tokens: TokenStore, *, client_certs: bool) -> None:
        self._tokens = tokens
        self._client_certs = client_certs

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not self._tokens.enabled or details.method.startswith(OPEN_PREFIXES):
            return handler
        token = _bearer(details.invocation_metadata)
        if token is None and self._client_certs:
            return handler  # the client certificate is checked in the handler
        try:
            self._tokens.authenticate(token)
        except Unauthenticated as exc:
            return _deny(handler, str(exc))
        return handler


def _deny(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    kwargs = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **kwargs)
    return grpc.unary_unary_rpc_method_handler(unary, **kwargs)


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
