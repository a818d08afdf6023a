"""The SDK's exceptions, mapped from gRPC status in exactly one place (``from_rpc_error``)."""

from __future__ import annotations

import grpc


class HookwireError(Exception):
    """Base of every error the SDK raises for a failed call.

    Attributes:
        code: the gRPC status code name, e.g. ``"NOT_FOUND"``.
        details: the server's message.
    """

    code: str = "UNKNOWN"

    def __init__(self, details: str, code: str | None = None) -> None:
        super().__init__(details)
        self.details = details
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code}: {self.details}"


class InvalidArgumentError(HookwireError):
    """The request was malformed (bad tensor bytes, bad path, empty hook spec, ...)."""

    code = "INVALID_ARGUMENT"


class NotFoundError(HookwireError):
    """A model, module, session or hook does not exist."""

    code = "NOT_FOUND"


class FailedPreconditionError(HookwireError):
    """Well-formed, but not allowed now (e.g. MODE_TRAIN on a model that forbids it)."""

    code = "FAILED_PRECONDITION"


class ResourceExhaustedError(HookwireError):
    """A limit was reached (memory, message size, ...)."""

    code = "RESOURCE_EXHAUSTED"


class AlreadyExistsError(HookwireError):
    """What the call would create exists (a finished harvest dataset, a job writing the same output)."""

    code = "ALREADY_EXISTS"


class PermissionDeniedError(HookwireError):
    """The caller may not do this."""

    code = "PERMISSION_DENIED"


class UnauthenticatedError(HookwireError):
    """Missing or wrong credentials."""

    code = "UNAUTHENTICATED"


class UnimplementedError(HookwireError):
    """The server cannot do or represent this (e.g. an output type with no wire form)."""

    code = "UNIMPLEMENTED"


class UnavailableError(HookwireError):
    """The server is unreachable or shutting down; retrying later may work."""

    code = "UNAVAILABLE"


class DeadlineExceededError(HookwireError):
    """The call ran past its deadline."""

    code = "DEADLINE_EXCEEDED"


class CancelledError(HookwireError):
    """The call was cancelled."""

    code = "CANCELLED"


class InternalError(HookwireError):
    """A server bug; the message carries an incident id to find it in the server log."""

    code = "INTERNAL"


_BY_CODE: dict[grpc.StatusCode, type[HookwireError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExistsError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.UNIMPLEMENTED: UnimplementedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: CancelledError,
    grpc.StatusCode.INTERNAL: InternalError,
}


def from_rpc_error(error: grpc.RpcError, *, target: str | None = None) -> HookwireError:
    """The SDK exception for a failed RPC (raise it ``from None``).

    With ``target`` (the address the channel dials), a call that never reached a
    server (UNAVAILABLE from the transport: refused, unresolvable, closed, TLS
    mismatch) gets an UnavailableError whose message names the target, says
    that no server answers there (or why the connection failed) and what to
    check, and keeps gRPC's own words at the end; so does a call whose
    connection was lost while it ran (the server went away mid-call).
    UNAVAILABLE answers sent by a server (draining, a model loading) are kept as
    they are.
    """
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else None) or str(code)
    if target is not None and code == grpc.StatusCode.UNAVAILABLE:
        reason = _unreachable(target, details)
        if reason is not None:
            details = f"{reason} (gRPC: {details})"
    cls = _BY_CODE.get(code, HookwireError)
    return cls(details, code=code.name if cls is HookwireError else None)


def _unreachable(target: str, details: str) -> str | None:
    """What went wrong reaching ``target``, from gRPC's transport message; None when a server answered."""
    text = details.lower()
    if "errors resolving" in text or "dns resolution failed" in text:
        return f"no server answers at {target}: the host name does not resolve (check the target: host:port)"
    if "handshake" in text or "ssl_error" in text:
        return (f"the TLS handshake with {target} failed: a plaintext server needs no --tls and no https://; "
                "a TLS server needs a certificate the client trusts (--tls-ca) that names this host")
    if "connection refused" in text:
        return f"no server answers at {target}: nothing listens on that port (is `hookwire serve` running there?)"
    dropped = "socket closed" in text or "connection reset" in text or "broken pipe" in text
    # gRPC says "failed to connect to all addresses" only while it was still connecting:
    # a server that drops a connection before any call got through may be a TLS server
    # reading plaintext. A call already under way on a working connection says "Stream
    # removed" instead: the server went away, and TLS has nothing to do with it.
    if dropped and "failed to connect" in text:
        return (f"{target} closed the connection at once: if it serves TLS, connect with --tls, --tls-ca "
                "or an https:// target")
    if dropped:
        return (f"the server at {target} went away: it closed the connection mid-call (it may have crashed "
                "or been stopped; see its logs)")
    if "failed to connect" in text:
        return f"no server answers at {target} (is `hookwire serve` running there, and reachable from here?)"
    return None
