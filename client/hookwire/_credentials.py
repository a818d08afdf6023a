"""Client credentials: TLS channel credentials and the bearer-token interceptor."""

from __future__ import annotations

import pathlib
from typing import Any

import grpc


def _details_with_token(details: grpc.aio.ClientCallDetails, token: str) -> grpc.aio.ClientCallDetails:
    metadata = [(k, v) for k, v in (details.metadata or ()) if k != "authorization"]
    metadata.append(("authorization", f"Bearer {token}"))
    return grpc.aio.ClientCallDetails(
        details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
    )


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_details_with_token(details, self._token), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_details_with_token(details, self._token), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(_details_with_token(details, self._token), request_iterator)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(_details_with_token(details, self._token), request_iterator)


def bearer_token_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors adding ``authorization: Bearer <token>`` to every call, TLS or plaintext
    loopback. One per call kind: a channel files each interceptor under one kind only."""
    return [_UnaryUnary(token), _UnaryStream(token), _StreamUnary(token), _StreamStream(token)]


def _read(value: str | bytes | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    return pathlib.Path(value).read_bytes()


def channel_credentials(
    ca: str | bytes | None, cert: str | bytes | None, key: str | bytes | None
) -> grpc.ChannelCredentials:
    """TLS credentials: ``ca`` verifies the server (system roots when None); ``cert`` and
    ``key`` present a client certificate (mTLS). Paths or PEM bytes."""
    return grpc.ssl_channel_credentials(root_certificates=_read(ca), private_key=_read(key), certificate_chain=_read(cert))
