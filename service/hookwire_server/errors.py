"""Domain errors. Each names the gRPC status it becomes (status_mapping.py)."""

from __future__ import annotations


class HookwireServerError(Exception):
    """Base of the errors a client caused or can act on; the message is sent as is."""


class InvalidArgument(HookwireServerError):
    """The request is malformed (bad tensor bytes, bad path, empty spec, ...)."""


class NotFound(HookwireServerError):
    """A named model, module, session or hook does not exist."""


class FailedPrecondition(HookwireServerError):
    """The request is well-formed but not allowed in the current state."""


class PermissionDenied(HookwireServerError):
    """The caller may not do this (e.g. rules on other callers' traffic, not allowed here)."""


class ResourceExhausted(HookwireServerError):
    """The request needs more memory or capacity than is available."""


class Unimplemented(HookwireServerError):
    """The server cannot represent something on the wire (e.g. an output type)."""


class DeadlineExceeded(HookwireServerError):
    """A call ran past the server's time limit."""


class Unavailable(HookwireServerError):
    """The server is shutting down."""
