"""Event delivery: bounded buffers between the hooks' worker threads and gRPC streams.

A hook fires on a model's worker thread and must never await. It hands each
message to the EventStream of every stream that wants it; the stream's policy
decides what a full buffer does. Today there is one policy, BLOCK (lossless):
the producing forward pass waits for space. The buffer counts events and bytes
and numbers events per hook when they enter, so a drop policy only has to
decide which item to discard and count it.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
from typing import AsyncIterator, Iterator

from hookwire.v1 import hook_service_pb2

from .errors import InvalidArgument

DEFAULT_MAX_EVENTS = 1024
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
LIMIT_MAX_EVENTS = 1 << 20
LIMIT_MAX_BYTES = 4 * 1024 * 1024 * 1024
#: Events with at most this many tensor bytes may share a message ...
BATCH_EVENT_MAX_BYTES = 64 * 1024
#: ... of at most this many tensor bytes (well under clients' 4 MiB default).
BATCH_MAX_BYTES = 1024 * 1024
BATCH_MAX_EVENTS = 256


@dataclasses.dataclass(frozen=True)
class DeliveryLimits:
    """How one stream buffers: its policy and bounds."""

    policy: int = hook_service_pb2.DELIVERY_POLICY_BLOCK
    max_events: int = DEFAULT_MAX_EVENTS
    max_bytes: int = DEFAULT_MAX_BYTES

    @classmethod
    def from_proto(cls, msg: hook_service_pb2.DeliveryOptions) -> DeliveryLimits:
        """Validated limits; zero fields take the server's defaults."""
        policy = msg.policy or hook_service_pb2.DELIVERY_POLICY_BLOCK
        if policy != hook_service_pb2.DELIVERY_POLICY_BLOCK:
            raise InvalidArgument(f"delivery.policy: unknown policy {msg.policy}")
        max_events = msg.max_events or DEFAULT_MAX_EVENTS
        max_bytes = msg.max_bytes or DEFAULT_MAX_BYTES
        if max_events > LIMIT_MAX_EVENTS:
            raise InvalidArgument(f"delivery.max_events: {max_events} is above the limit {LIMIT_MAX_EVENTS}")
        if max_bytes > LIMIT_MAX_BYTES:
            raise InvalidArgument(f"delivery.max_bytes: {max_bytes} is above the limit {LIMIT_MAX_BYTES}")
        return cls(policy=policy, max_events=max_events, max_bytes=max_bytes)


class EventStream:
    """The buffer of one outgoing stream: many producer threads, one consumer on the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, limits: DeliveryLimits) -> None:
        self._loop = loop
        self.limits = limits
        self._lock = threading.Lock()
        self._not_full = threading.Condition(self._lock)
        self._items: collections.deque[tuple[hook_service_pb2.SessionMessage, int]] = collections.deque()
        self._bytes = 0
        self._seq: dict[str, int] = {}
        self._closed = False
        self._ending = False
        self._ready = asyncio.Event()

    @property
    def closed(self) -> bool:
        """True once close() was called."""
        return self._closed

    def put_event(self, msg: hook_service_pb2.SessionMessage, hook_id: str, nbytes: int) -> bool:
        """Queues an event, numbering it for its hook; blocks while the buffer is full.

        Called from a model's worker thread, never the event loop (it may wait).
        Returns False when the stream closed before the event could be queued.
        """
        with self._lock:
            while not self._closed and not self._ending and self._is_full(nbytes):
                self._not_full.wait()
            if self._closed or self._ending:
                return False
            seq = self._seq.get(hook_id, 0) + 1
            self._seq[hook_id] = seq
            msg.event.seq = seq
            self._append(msg, nbytes)
        return True

    def put_notice(self, msg: hook_service_pb2.SessionMessage) -> None:
        """Queues a notice without waiting (notices are small and rare); any thread."""
        with self._lock:
            if not (self._closed or self._ending):
                self._append(msg, 0)

    def _is_full(self, nbytes: int) -> bool:
        if len(self._items) >= self.limits.max_events:
            return True
        # An event larger than the whole byte budget still goes through, alone.
        return bool(self._items) and self._bytes + nbytes > self.limits.max_bytes

    def _append(self, msg: hook_service_pb2.SessionMessage, nbytes: int) -> None:
        was_empty = not self._items
        self._items.append((msg, nbytes))
        self._bytes += nbytes
        if was_empty:
            self._wake()

    async def get(self) -> hook_service_pb2.SessionMessage | None:
        """The next message, waiting for one; None once closed (queued messages are
        dropped) or ended and drained."""
        items = await self._take(0, 1)
        return items[0][0] if items else None

    async def _take(self, max_bytes: int, max_items: int) -> list[tuple[hook_service_pb2.SessionMessage, int]]:
        """The next item and, without waiting, those queued behind it, up to ``max_items``
        items whose bytes stay under ``max_bytes``; [] once closed (or ended and drained)."""
        while True:
            with self._lock:
                if self._closed:
                    return []
                if self._items:
                    out = [self._items.popleft()]
                    budget = max_bytes - out[0][1]
                    while self._items and len(out) < max_items and self._items[0][1] <= budget:
                        budget -= self._items[0][1]
                        out.append(self._items.popleft())
                    self._bytes -= sum(nbytes for _, nbytes in out)
                    self._not_full.notify_all()
                    return out
                if self._ending:
                    return []
                self._ready.clear()
            await self._ready.wait()

    async def messages(self) -> AsyncIterator[hook_service_pb2.SessionMessage]:
        """What to send, in order, until the stream closes or ends.

        Small events that are waiting together go out as one EventBatch: gRPC's
        cost per message, on both ends, is far above the cost of a small event.
        """
        while items := await self._take(BATCH_MAX_BYTES, BATCH_MAX_EVENTS):
            run: list[hook_service_pb2.SessionMessage] = []
            for msg, nbytes in items:
                if msg.WhichOneof("kind") == "event" and nbytes <= BATCH_EVENT_MAX_BYTES:
                    run.append(msg)
                    continue
                for out in _coalesce(run):
                    yield out
                run = []
                yield msg
            for out in _coalesce(run):
                yield out

    def end(self) -> None:
        """Accepts nothing more; get() drains what is queued, then returns None. Any thread."""
        with self._lock:
            self._ending = True
            self._not_full.notify_all()
        self._wake()

    def close(self) -> None:
        """Ends the stream: frees the buffer and releases every waiting producer. Any thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._items.clear()
            self._bytes = 0
            self._not_full.notify_all()
        self._wake()

    def _wake(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._ready.set)
        except RuntimeError:  # the loop is already closed; nobody is waiting
            pass

    def occupancy(self) -> tuple[int, int]:
        """(events, bytes) buffered now."""
        with self._lock:
            return len(self._items), self._bytes


def _coalesce(events: list[hook_service_pb2.SessionMessage]) -> Iterator[hook_service_pb2.SessionMessage]:
    """One message for a run of event messages: the event itself, or a batch of copies."""
    if len(events) == 1:
        yield events[0]
    elif events:
        out = hook_service_pb2.SessionMessage()
        batch = out.batch
        for msg in events:
            batch.events.add().CopyFrom(msg.event)
        yield out
