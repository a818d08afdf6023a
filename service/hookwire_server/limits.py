"""Resource limits. Each is configurable (ServerSettings field of the same name) and
answers with RESOURCE_EXHAUSTED or INVALID_ARGUMENT naming the limit."""

from __future__ import annotations

import dataclasses

from .errors import ResourceExhausted


@dataclasses.dataclass
class Limits:
    """Defaults sized for one server on one machine; raise them for big deployments."""

    #: Bytes of slots each session may keep.
    max_slot_bytes: int = 256 * 1024 * 1024
    #: Longest TTL of a hook without a session, in seconds.
    max_ttl_seconds: int = 24 * 3600
    #: Registered hooks per session.
    max_hooks_per_session: int = 256
    #: Registered hooks per principal (all its sessions and TTL hooks).
    max_hooks_per_principal: int = 1024
    #: Rules per hook action.
    max_rules_per_action: int = 64
    #: Open sessions per principal.
    max_sessions_per_principal: int = 64
    #: Open event streams (sessions and subscriptions) per principal.
    max_streams_per_principal: int = 128
    #: Sum of the byte budgets (DeliveryOptions.max_bytes) of all open streams.
    max_buffered_bytes: int = 8 * 1024 * 1024 * 1024
    #: The same for the streams of one principal (so one caller cannot take them all).
    max_buffered_bytes_per_principal: int = 4 * 1024 * 1024 * 1024
    #: Tensor elements in one Infer request (all inputs together).
    max_infer_elements: int = 1 << 31
    #: Infer calls waiting for one model's thread, beyond the running one.
    max_queued_infers: int = 64
    #: Seconds an Infer call may take (queueing included) before it fails with DEADLINE_EXCEEDED.
    infer_timeout: float = 600.0
    #: Most bytes the chunked tensors of one InferStream request may claim.
    max_request_bytes: int = 2 * 1024 * 1024 * 1024

    # -- InferStream (issue #9, auth): a stream that stops sending must not hold memory.
    #: Seconds an InferStream may go without a message from its client before it is
    #: ended (DEADLINE_EXCEEDED) and the chunks it sent are freed.
    infer_stream_idle_timeout: float = 30.0
    #: Open InferStream calls per principal (RESOURCE_EXHAUSTED beyond).
    max_infer_streams_per_principal: int = 16


def check(count: int, limit: int, what: str, name: str) -> None:
    """ResourceExhausted when ``count`` would go past ``limit``."""
    if count >= limit:
        raise ResourceExhausted(f"{what}: the limit is {limit} ({name})")
