"""Who is calling and which request this is, for the length of one RPC.

The gRPC layer (``api.security``) sets the current RPC's context when a call starts; log
records emitted while it runs carry its principal and request id
(``logging_setup``), and the Infer or Generate call the RPC makes takes its request id
(``take_request_id``), so that the RPC's audit line, the call's own log lines, its
response and its events all name one id. A context variable, not an argument: asyncio
tasks inherit it, so no layer in between passes it on. Threads do not: work a call hands
to a model's thread logs without these fields.
"""

from __future__ import annotations

import contextvars
import dataclasses

from hookwire.wire import ids


@dataclasses.dataclass(slots=True)
class RpcContext:
    """One RPC: its method, the request id the server gave it, the caller."""

    #: The RPC's name (``Infer``).
    method: str
    #: The server's id for this RPC (``req_`` and 32 hex digits).
    request_id: str
    #: The authenticated principal's name; "" until it is known (a client-certificate
    #: call learns it once the gate has checked it), or for a refused call.
    principal: str = ""
    #: The caller's own id for the call (its ``x-request-id`` metadata), or "".
    client_request_id: str = ""
    #: Whether a call of this RPC took ``request_id`` already (the rest get new ids).
    taken: bool = False
    #: The API the call came through: "grpc", or "http" (the OpenAI-compatible front);
    #: the ``front`` label of the RPC and latency metrics.
    front: str = "grpc"


CURRENT: contextvars.ContextVar[RpcContext | None] = contextvars.ContextVar("hookwire_rpc", default=None)


def take_request_id() -> str:
    """The request id for an Infer or Generate call: the current RPC's id for its first
    call, a new one for any later call of the same RPC (a stream of calls) or outside
    an RPC. Never blocks."""
    rpc = CURRENT.get()
    if rpc is None or rpc.taken:
        return ids.new_id(ids.REQUEST)
    rpc.taken = True
    return rpc.request_id


def current_front() -> str:
    """The API the current call came through ("grpc" outside any RPC). Never blocks."""
    rpc = CURRENT.get()
    return "grpc" if rpc is None else rpc.front
