"""Domain errors. Each names the gRPC status it becomes (status_mapping.py)."""

from __future__ import annotations

import traceback


class HookwireServerError(Exception):
    """Base of the errors a client caused or can act on; the message is sent as is."""


class InvalidArgument(HookwireServerError):
    """The request is malformed (bad tensor bytes, bad path, empty spec, ...)."""


class NotFound(HookwireServerError):
    """A named model, module, session or hook does not exist."""


class FailedPrecondition(HookwireServerError):
    """The request is well-formed but not allowed in the current state."""


class AlreadyExists(HookwireServerError):
    """What the request would create exists (a finished harvest dataset, a job writing the same output)."""


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


def release_failure(exc: BaseException) -> BaseException:
    """Lets go of what a failed call's frames hold, before the failure propagates; returns
    the exception to raise.

    gRPC keeps an aborted call's exception chain alive with the call's state for a while,
    and with the chain its tracebacks: the frames of the pass that failed, whose locals
    (and the closures of the torch hook runner those frames ran) hold its tensors, a
    generation's KV cache included. Every frame on the tracebacks of ``exc`` and of the
    exceptions it was raised from (``from None`` keeps the context, only hidden) is
    cleared. For a HookwireServerError (the client's mistake: its message says it all)
    the tracebacks are dropped too, since a cleared frame still holds the function it
    ran; an unexpected error keeps its (cleared) traceback for the incident log.
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    drop = isinstance(exc, HookwireServerError)
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        if drop:
            current.__traceback__ = None
        pending.extend((current.__context__, current.__cause__))
    return exc


def drop_tracebacks(exc: BaseException) -> BaseException:
    """Drops the tracebacks of ``exc`` and of the exceptions it was raised from (its
    context and cause, ``from None`` included); returns ``exc``. Their frames, and what
    those frames' locals hold (a refused request's tensors), go with them unless
    something else holds them.

    For any failure, once it has been logged: unlike release_failure it clears no
    frame, and clearing one is not safe on every path (the frame of a coroutine that
    caught an exception and lives on, on its traceback, would be finalized)."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        current.__traceback__ = None
        pending.extend((current.__context__, current.__cause__))
    return exc
