"""Event delivery: bounded buffers between the hooks' worker threads and gRPC streams.

A hook fires on a model's worker thread and must never await. It hands each
message to the EventStream of every stream that wants it; the stream's policy
decides what a full buffer does:

- BLOCK: lossless for the calls of the stream's owner (the principal that
  opened it), and for everyone's calls on an operator's stream. The forward pass
  never waits for a reader: once the stream is full, the call keeps its further
  events (passes.Pass, counted against the principal's byte budget, HeldBytes)
  and waits for the reader after its pass, alone; and a call that such a stream
  would hold is not started while the stream is full (DeliveryGate), so calls of
  other principals overtake it. Other callers' events drop oldest first, so a
  stream that stops reading never holds another caller's call.
- DROP_OLDEST / DROP_NEWEST: the pass never waits; the oldest buffered event,
  or the new one, is dropped and counted.
- UNSPECIFIED: BLOCK for the calls of the stream's own session, DROP_OLDEST for
  everyone else's, so no other caller ever waits on this stream.

Events are numbered per hook when they are offered, so a dropped event leaves a
gap in its hook's ``seq``. Every event carries ``dropped``: the number of events
numbered on this stream before it that were dropped, i.e. exactly the seq numbers
missing in front of it. It is stamped when the event leaves the buffer, since an
event that waits in a DROP_OLDEST buffer can see older events evicted in front of
it. DROPS_STARTED / DROPS_ENDED notices bracket each run of drops. The accounting
is exact: it is all done under the stream's lock.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
from typing import AsyncIterator, Callable, Iterator

from hookwire.wire.codec import Chunker
from hookwire.wire.framing import SESSION_MESSAGE_CHUNK
from hookwire.v1 import hook_service_pb2

from .. import wakeups
from ..errors import InvalidArgument, ResourceExhausted
from ..limits import DEFAULT_STREAM_BYTES, exceeded

DEFAULT_MAX_EVENTS = 1024
#: Sized with the per-principal stream limit and byte budget (see limits.py).
DEFAULT_MAX_BYTES = DEFAULT_STREAM_BYTES
LIMIT_MAX_EVENTS = 1 << 20
LIMIT_MAX_BYTES = 4 * 1024 * 1024 * 1024
#: gRPC's default receive limit, which many clients keep.
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
MIN_MAX_MESSAGE_BYTES = 1024 * 1024
#: Payload of one TensorChunk, at most. Measured with tests/bench/bench_delivery.py (since folded into bench_hotpath.py, P2):
#: 1 MiB chunks stream captured tensors into the SDK at about 1 GiB/s, 2 MiB and 4 MiB
#: chunks at a third to a half of that (the raw gRPC stream does not slow down alike).
CHUNK_BYTES = 1024 * 1024
#: Events of at most this many serialized bytes may share a message ...
BATCH_EVENT_MAX_BYTES = 64 * 1024
#: ... of at most this many serialized bytes (and under the stream's message limit).
BATCH_MAX_BYTES = 1024 * 1024
BATCH_MAX_EVENTS = 256

BLOCK = hook_service_pb2.DELIVERY_POLICY_BLOCK
DROP_OLDEST = hook_service_pb2.DELIVERY_POLICY_DROP_OLDEST
DROP_NEWEST = hook_service_pb2.DELIVERY_POLICY_DROP_NEWEST
AUTO = hook_service_pb2.DELIVERY_POLICY_UNSPECIFIED


@dataclasses.dataclass(frozen=True)
class DeliveryLimits:
    """How one stream buffers: its policy and bounds."""

    policy: int = AUTO
    max_events: int = DEFAULT_MAX_EVENTS
    max_bytes: int = DEFAULT_MAX_BYTES
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    @classmethod
    def from_proto(cls, msg: hook_service_pb2.DeliveryOptions) -> DeliveryLimits:
        """Validated limits; zero fields take the server's defaults."""
        if msg.policy not in hook_service_pb2.DeliveryPolicy.values():
            raise InvalidArgument(f"delivery.policy: unknown policy {msg.policy}")
        max_events = msg.max_events or DEFAULT_MAX_EVENTS
        max_bytes = msg.max_bytes or DEFAULT_MAX_BYTES
        max_message = msg.max_message_bytes or DEFAULT_MAX_MESSAGE_BYTES
        if max_events > LIMIT_MAX_EVENTS:
            raise InvalidArgument(f"delivery.max_events: {max_events} is above the limit {LIMIT_MAX_EVENTS}")
        if max_bytes > LIMIT_MAX_BYTES:
            raise InvalidArgument(f"delivery.max_bytes: {max_bytes} is above the limit {LIMIT_MAX_BYTES}")
        if max_message < MIN_MAX_MESSAGE_BYTES:
            raise InvalidArgument(
                f"delivery.max_message_bytes: {max_message} is below the minimum {MIN_MAX_MESSAGE_BYTES}"
            )
        return cls(policy=msg.policy, max_events=max_events, max_bytes=max_bytes, max_message_bytes=max_message)

    @property
    def chunk_bytes(self) -> int:
        """Payload per TensorChunk on this stream."""
        return chunk_bytes_for(self.max_message_bytes)


def chunk_bytes_for(max_message_bytes: int) -> int:
    """Payload per TensorChunk for a peer that accepts messages up to ``max_message_bytes``."""
    return max(64 * 1024, min(CHUNK_BYTES, max_message_bytes - 64 * 1024))


class HookCounters:
    """What happened to a hook's events, across all its streams. Any thread."""

    def __init__(self, on_drop: Callable[[], None] | None = None) -> None:
        self._lock = threading.Lock()
        self.events_sent = 0
        self.events_dropped = 0
        self._on_drop = on_drop

    def add(self, *, sent: int = 0, dropped: int = 0) -> None:
        """Counts queued (net of evictions) and dropped events."""
        with self._lock:
            self.events_sent += sent
            self.events_dropped += dropped
        if dropped and self._on_drop is not None:
            self._on_drop()


#: Room left in a message for its envelope (batch framing, field tags).
ENVELOPE_BYTES = 16 * 1024


@dataclasses.dataclass
class _Item:
    msg: hook_service_pb2.SessionMessage
    nbytes: int  # tensor bytes it holds (inline and chunked): what the buffer counts
    counters: HookCounters | None = None
    chunker: Chunker | None = None
    wire: int = 0  # serialized size of the message itself (chunks excluded)
    droppable: bool = False  # queued without waiting: a drop policy may evict it
    #: Events numbered before this one that were dropped before it was queued.
    dropped_before: int = 0
    #: Evictions to add to this item's ``dropped_before`` and to every item behind it
    #: (a lazy suffix sum, moved forward as items leave: an eviction counts for the
    #: items queued behind the evicted one, not for those ahead of it).
    carry: int = 0


def _notice(kind: hook_service_pb2.NoticeKind, message: str, dropped: int) -> hook_service_pb2.SessionMessage:
    return hook_service_pb2.SessionMessage(
        notice=hook_service_pb2.Notice(kind=kind, message=message, dropped=dropped)
    )


#: Unread CallEnded markers a stream keeps for calls that do not block on it (at least).
MIN_MARKER_CAP = 1024
#: Sessions a stream tells apart per model when deciding which calls it holds back; past
#: this many it holds back every call of the model that it blocks for.
SOURCE_SESSIONS = 64
ANY_SESSION = "*"


class EventStream:
    """The buffer of one outgoing stream: many producer threads, one consumer on the loop."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, limits: DeliveryLimits, *, owner_session_id: str = "",
        owner: str = "", on_sent: Callable[[int, int], None] | None = None, blocks_others: bool = True,
    ) -> None:
        self._loop = loop
        #: Whether BLOCK may also hold other principals' passes (operators only: an observer
        #: that stops reading must not stall other callers).
        self.blocks_others = blocks_others
        #: The name of the principal that opened the stream: BLOCK holds its calls ("" for none).
        self.owner = owner
        self.limits = limits
        #: Called with (events, tensor bytes) as messages are handed to gRPC.
        self._on_sent = on_sent
        #: The session whose own calls block under the default policy ("" for none).
        self.owner_session_id = owner_session_id
        self._lock = threading.Lock()
        self._not_full = threading.Condition(self._lock)
        self._items: collections.deque[_Item] = collections.deque()
        self._events = 0  # event items in _items (notices do not count)
        self._bytes = 0
        self._seq: dict[str, int] = {}
        #: Events dropped on this stream so far.
        self.dropped = 0
        self._dropping = False
        self._closed = False
        self._ending = False
        #: Why the server closed the stream ("" when the client went away or it ended normally).
        self.close_reason = ""
        self._ready = asyncio.Event()
        #: Producers waiting for space now (BLOCK).
        self._waiting = 0
        #: Sum of the items' ``carry``: evictions that every item queued now will still
        #: be stamped with as it leaves (a new item already counts them in ``dropped``).
        self._carry_total = 0
        #: CallEnded markers queued now (bounded by max_events, see put_call_ended).
        self._markers = 0
        #: The calls whose events this stream has carried and blocks for, by model: the
        #: sessions they were made in (ANY_SESSION past SOURCE_SESSIONS of them). A full
        #: stream holds back only such calls (DeliveryGate.stalled); forgotten when a hook
        #: of the stream is removed (relearnt from the next event).
        self._sources: dict[str, set[str]] = {}
        #: Called on the event loop when a reader takes from the stream after the gate found
        #: it full, and when the stream ends: calls it held back may start now.
        self.on_room: Callable[[], None] | None = None
        #: Called (any thread, under the stream's lock) when the stream fills up for calls it
        #: blocks for: the gate then looks at it (DeliveryGate keeps the full streams only).
        self.on_full: Callable[[EventStream], None] | None = None
        self._gated = False

    @property
    def waiting_producers(self) -> int:
        """Forward passes waiting for space in this buffer now (BLOCK)."""
        with self._lock:
            return self._waiting

    @property
    def closed(self) -> bool:
        """True once close() was called."""
        return self._closed

    def blocks_for(self, session_id: str, principal: str = "") -> bool:
        """Whether an event of a call made in ``session_id`` by the principal named
        ``principal`` waits for space (else it may drop).

        UNSPECIFIED blocks for the stream's own session only. BLOCK blocks for its
        owner's calls (its own session's calls are its owner's) and, on an operator's
        stream, for everyone's.
        """
        policy = self.limits.policy
        own_session = bool(session_id) and session_id == self.owner_session_id
        if policy == AUTO:
            return own_session
        own_calls = own_session or (bool(principal) and principal == self.owner)
        return policy == BLOCK and (own_calls or self.blocks_others)

    def full_now(self) -> bool:
        """Whether the stream is full now (or producers already wait for room). Reads
        counters without the lock: a stale answer only moves a call by one scheduling
        decision."""
        return self._waiting > 0 or self._events >= self.limits.max_events or self._bytes >= self.limits.max_bytes

    def stalls(self, model: str, session_id: str, principal: str) -> bool:
        """Whether a call on ``model`` made in ``session_id`` by ``principal`` must not start
        now: the stream blocks for it, has carried events of such calls (same model and
        session), and is full. Event loop."""
        sessions = self._sources.get(model)
        if not sessions or (session_id not in sessions and ANY_SESSION not in sessions):
            return False
        if self._closed or self._ending or not self.blocks_for(session_id, principal) or not self.full_now():
            return False
        self._gated = True  # the next read (or the end) tells the schedulers
        return True

    def _learn(self, model: str, session_id: str) -> None:
        """Notes that events of calls on ``model`` in ``session_id`` come to this stream."""
        sessions = self._sources.setdefault(model, set())
        if session_id not in sessions and ANY_SESSION not in sessions:
            if len(sessions) >= SOURCE_SESSIONS:
                sessions.clear()
                session_id = ANY_SESSION
            sessions.add(session_id)

    def _filled(self) -> None:
        """Under the lock: tells the gate when the stream is full for calls it blocks for."""
        if self.on_full is not None and self.full_now():
            self.on_full(self)

    def put_event(
        self, msg: hook_service_pb2.SessionMessage, hook_id: str, nbytes: int, *,
        session_id: str = "", principal: str = "", counters: HookCounters | None = None,
        chunker: Chunker | None = None, wire: int | None = None, cancelled: Callable[[], bool] | None = None,
        wait: bool = True,
    ) -> bool | None:
        """Offers an event, numbering it for its hook; True if it was queued.

        Called from a model's worker thread, never the event loop: when the stream
        blocks for the call (``session_id``, made by ``principal``; see blocks_for)
        it waits while the buffer is full (until ``cancelled()`` turns true, e.g. the
        hook was removed). Otherwise it never waits. ``wire`` is the message's
        serialized size; an event that cannot fit this stream's max_message_bytes is
        dropped, with a notice. The event's ``dropped`` is set when it leaves the buffer.
        Without ``wait``, an event that would wait is left alone (not numbered, not
        queued) and None is returned: the caller offers it again later, waiting.
        """
        block = self.blocks_for(session_id, principal)
        if wire is None:
            wire = msg.ByteSize()
        with self._lock:
            if self._closed or self._ending:
                return False
            if block:
                self._learn(msg.event.model, session_id)  # from the first event on, even one kept back
            if block and not wait and self._is_full(nbytes) and not (cancelled is not None and cancelled()):
                if self.on_full is not None:
                    self.on_full(self)
                return None
            if block:
                self._waiting += 1
                self._filled()
                try:
                    while (
                        not self._closed and not self._ending and self._is_full(nbytes)
                        and not (cancelled is not None and cancelled())
                    ):
                        wakeups.flush()  # the loop that makes room must be awake (a deferred block)
                        self._not_full.wait()
                        if not self.blocks_for(session_id, principal):
                            # A token reload demoted the stream's owner: it may no longer hold this call.
                            block = False
                            break
                finally:
                    self._waiting -= 1
                if self._closed or self._ending or (cancelled is not None and cancelled()):
                    return False
            # Numbered once it has a place (or is dropped), under the lock: seq
            # follows stream order, and a dropped event leaves its gap.
            seq = self._seq.get(hook_id, 0) + 1
            self._seq[hook_id] = seq
            if wire > self.limits.max_message_bytes - ENVELOPE_BYTES:
                self._count_drop(counters, run=False)
                self._append(_Item(hook_service_pb2.SessionMessage(notice=hook_service_pb2.Notice(
                    kind=hook_service_pb2.NOTICE_KIND_CAPTURE_FAILED, hook_id=hook_id, dropped=self.dropped,
                    message=f"event {seq} of hook {hook_id} takes {wire} bytes, more than this stream's "
                            f"max_message_bytes ({self.limits.max_message_bytes}): dropped")), 0))
                return False
            evicted = False
            if not block and self._is_full(nbytes):
                if self.limits.policy == DROP_NEWEST:
                    self._count_drop(counters)
                    return False
                while self._is_full(nbytes) and self._evict_oldest_droppable():
                    evicted = True
                if self._is_full(nbytes):  # only events that were promised delivery are left
                    self._count_drop(counters)
                    return False
            if self._dropping and not evicted:
                self._dropping = False
                self._append(_Item(_notice(
                    hook_service_pb2.NOTICE_KIND_DROPS_ENDED,
                    f"delivering again; {self.dropped} events dropped on this stream so far", self.dropped), 0))
            msg.event.seq = seq
            # Every event dropped so far was numbered before this one. The evictions
            # still carried by queued items reach this one as they leave (_popleft),
            # like those in front of it while it waits: count them only there.
            self._append(_Item(
                msg, nbytes, counters, chunker, wire, droppable=not block,
                dropped_before=self.dropped - self._carry_total,
            ))
            self._events += 1
            if block:
                self._filled()
        if counters is not None:
            counters.add(sent=1)
        return True

    def drop_if_full(
        self, hook_id: str, *, session_id: str = "", principal: str = "", counters: HookCounters | None = None,
    ) -> bool:
        """For DROP_NEWEST: when the buffer already holds max_events events, the next event
        is dropped whatever its size, so it is numbered and counted as dropped now, and the
        caller need not encode it. True when it was dropped; any thread."""
        if self.limits.policy != DROP_NEWEST or self.blocks_for(session_id, principal):
            return False
        with self._lock:
            if self._closed or self._ending or self._events < self.limits.max_events:
                return False
            self._seq[hook_id] = self._seq.get(hook_id, 0) + 1
            self._count_drop(counters)
        return True

    def _count_drop(self, counters: HookCounters | None, *, run: bool = True) -> None:
        """Counts a drop; ``run``: because the buffer is full (a run of drops, with notices)."""
        self.dropped += 1
        if counters is not None:
            counters.add(dropped=1)
        if run and not self._dropping:
            self._dropping = True
            self._append(_Item(_notice(
                hook_service_pb2.NOTICE_KIND_DROPS_STARTED,
                f"buffer full ({self.limits.max_events} events / {self.limits.max_bytes} bytes): dropping events",
                self.dropped), 0))

    def _evict_oldest_droppable(self) -> bool:
        for i, item in enumerate(self._items):
            if item.droppable:
                # The items behind it were numbered after it: each now has one more
                # missing seq in front of it. Items ahead of it do not.
                if i + 1 < len(self._items):
                    self._items[i + 1].carry += item.carry + 1
                    self._carry_total += 1
                else:
                    self._carry_total -= item.carry
                del self._items[i]
                self._events -= 1
                self._bytes -= item.nbytes
                if item.counters is not None:
                    item.counters.add(sent=-1)
                self._count_drop(item.counters)
                return True
        return False

    def wake_producers(self) -> None:
        """Makes producers waiting for space re-check their ``cancelled`` condition and
        whether the stream still blocks for their call (``blocks_others`` may change), and
        the schedulers the calls it held back. Any thread."""
        with self._lock:
            self._not_full.notify_all()
        self._room_later()

    def forget_hook(self, hook_id: str) -> None:
        """Drops a removed hook's numbering (ids are never reused), and what the stream knew
        of the calls it carries (the other hooks' calls are learnt again from their events)."""
        with self._lock:
            self._seq.pop(hook_id, None)
            self._sources.clear()

    def put_notice(self, msg: hook_service_pb2.SessionMessage) -> None:
        """Queues a notice without waiting (notices are small and rare); any thread."""
        with self._lock:
            if not (self._closed or self._ending):
                self._append(_Item(msg, 0))

    def put_call_ended(self, request_id: str, model: str, *, session_id: str = "", principal: str = "") -> bool:
        """Queues the end-of-call marker of a call (made in ``session_id`` by
        ``principal``) that offered events to this stream, without waiting; any
        thread, after the call's last event. True if queued.

        A call whose events block on this stream (see blocks_for) always gets its
        marker: such calls wait for the reader on their events, so their markers
        cannot pile up. For the others, a stream already holding
        max(max_events, MIN_MARKER_CAP) unread markers (a reader stalled while calls
        go on and its events drop) gets no more, so its memory stays bounded.
        """
        block = self.blocks_for(session_id, principal)
        with self._lock:
            if self._closed or self._ending:
                return False
            if not block and self._markers >= max(self.limits.max_events, MIN_MARKER_CAP):
                return False
            self._markers += 1
            self._append(_Item(hook_service_pb2.SessionMessage(
                call_ended=hook_service_pb2.CallEnded(request_id=request_id, model=model)), 0))
        return True

    def _is_full(self, nbytes: int) -> bool:
        if self._events >= self.limits.max_events:
            return True
        # An event larger than the whole byte budget still goes through, alone.
        return bool(self._events) and self._bytes + nbytes > self.limits.max_bytes

    def _append(self, item: _Item) -> None:
        was_empty = not self._items
        self._items.append(item)
        self._bytes += item.nbytes
        if was_empty:
            self._wake()

    async def _take(self, max_wire: int, max_items: int) -> list[_Item]:
        """The next item and, without waiting, those queued behind it, up to ``max_items``
        items whose messages together stay under ``max_wire`` serialized bytes;
        [] once closed (or ended and drained)."""
        while True:
            with self._lock:
                if self._closed:
                    return []
                if self._items:
                    out = [self._popleft()]
                    budget = max_wire - out[0].wire
                    while (
                        self._items and len(out) < max_items and out[-1].chunker is None
                        and self._items[0].chunker is None and self._items[0].wire <= budget
                    ):
                        budget -= self._items[0].wire
                        out.append(self._popleft())
                    for item in out:
                        self._bytes -= item.nbytes
                        kind = item.msg.WhichOneof("kind")
                        if kind == "event":
                            self._events -= 1
                        elif kind == "call_ended":
                            self._markers -= 1
                    self._not_full.notify_all()
                    gated, self._gated = self._gated, False
                    if gated and self.on_room is not None:
                        self.on_room()
                    return out
                if self._ending:
                    return []
                self._ready.clear()
            await self._ready.wait()

    def _popleft(self) -> _Item:
        """The front item, its event stamped with its final ``dropped`` (under the lock).

        Setting one varint field of the message object re-encodes nothing: the message
        is serialized once, by gRPC, after this.
        """
        item = self._items.popleft()
        if item.carry:
            if self._items:
                self._items[0].carry += item.carry
            else:
                self._carry_total -= item.carry
            item.dropped_before += item.carry
            item.carry = 0
        if item.msg.WhichOneof("kind") == "event":
            item.msg.event.dropped = item.dropped_before
        return item

    async def get(self) -> hook_service_pb2.SessionMessage | None:
        """The next message, waiting for one; None once closed (queued messages are
        dropped) or ended and drained. Chunks of a chunked event are not included."""
        items = await self._take(0, 1)
        return items[0].msg if items else None

    async def messages(self) -> AsyncIterator[hook_service_pb2.SessionMessage | bytes]:
        """What to send, in order, until the stream closes or ends: messages, and the
        chunk messages of chunked events as their wire bytes (SessionMessage.chunk).

        Small events that are waiting together go out as one EventBatch: gRPC's
        cost per message, on both ends, is far above the cost of a small event.
        An event with chunked tensors goes out alone, followed by its chunks.
        """
        batch_budget = min(BATCH_MAX_BYTES, self.limits.max_message_bytes - ENVELOPE_BYTES)
        while items := await self._take(batch_budget, BATCH_MAX_EVENTS):
            if self._on_sent is not None:
                events = [item for item in items if item.msg.WhichOneof("kind") == "event"]
                self._on_sent(len(events), sum(item.nbytes for item in events))
            run: list[hook_service_pb2.SessionMessage] = []
            for item in items:
                msg = item.msg
                if item.chunker is None and msg.WhichOneof("kind") == "event" and item.wire <= BATCH_EVENT_MAX_BYTES:
                    run.append(msg)
                    continue
                for out in _coalesce(run):
                    yield out
                run = []
                yield msg
                if item.chunker is not None:
                    # Built by hand (the wire bytes protobuf would write), mostly on the
                    # producing thread: see hook_record._capture.
                    for chunk in item.chunker.frames(SESSION_MESSAGE_CHUNK, self.limits.chunk_bytes):
                        if self._closed:
                            return
                        yield chunk
            for out in _coalesce(run):
                yield out

    def end(self) -> None:
        """Accepts nothing more; get() drains what is queued, then returns None. Any thread."""
        with self._lock:
            self._ending = True
            self._not_full.notify_all()
        self._wake()
        self._room_later()

    def close(self, reason: str = "") -> None:
        """Ends the stream: frees the buffer and releases every waiting producer. Any thread.

        A ``reason`` means the server ended it (the RPC then fails with UNAVAILABLE).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.close_reason = reason
            self._items.clear()
            self._carry_total = 0
            self._events = 0
            self._markers = 0
            self._bytes = 0
            self._not_full.notify_all()
        self._wake()
        self._room_later()

    def _room_later(self) -> None:
        """Tells the schedulers (on the loop) that calls this stream held back may start."""
        if self.on_room is None:
            return
        try:
            self._loop.call_soon_threadsafe(self.on_room)
        except RuntimeError:  # the loop is already closed: nothing is scheduled any more
            pass

    def _wake(self) -> None:
        # Through wakeups: a vLLM step's events, put by the link thread under
        # deferred(events=True), wake the loop once (see wakeups).
        try:
            wakeups.call_soon(self._loop, self._ready.set, event=True)
        except RuntimeError:  # the loop is already closed; nobody is waiting
            pass

    def occupancy(self) -> tuple[int, int]:
        """(events, bytes) buffered now."""
        with self._lock:
            return self._events, self._bytes


class DeliveryGate:
    """The open streams, asked by the schedulers which calls must not start now.

    A call whose events a full stream would hold (BLOCK for its owner's calls, or for
    everyone's on an operator's stream; the default policy for the stream's own
    session) would only add to what waits for that stream's reader: it is not started
    until the reader takes from the stream, and later calls that no full stream holds
    overtake it. Event loop only.
    """

    def __init__(self) -> None:
        self._streams: set[EventStream] = set()
        #: Streams that filled up (told by the streams themselves, from any thread): only
        #: these are asked, so a server whose readers keep up pays nothing per decision.
        self._full: set[EventStream] = set()
        self._listeners: list[Callable[[], None]] = []

    def add(self, stream: EventStream) -> None:
        """Watches ``stream`` (a session's or a subscription's) from now on."""
        stream.on_room = self._room
        stream.on_full = self._full.add
        self._streams.add(stream)

    def remove(self, stream: EventStream) -> None:
        """Forgets a closed stream; the calls it held back may start."""
        self._full.discard(stream)
        if stream in self._streams:
            self._streams.discard(stream)
            self._room()

    def listen(self, fn: Callable[[], None]) -> None:
        """Calls ``fn`` (on the loop) whenever calls held back may start."""
        self._listeners.append(fn)

    def _room(self) -> None:
        for fn in self._listeners:
            fn()

    def stalled(self, model: str, session_id: str, principal: str) -> bool:
        """Whether a call on ``model`` made in ``session_id`` by ``principal`` waits now
        (see EventStream.stalls)."""
        if not self._full:
            return False
        for stream in list(self._full):  # a copy: streams add themselves from other threads
            if stream.closed or not stream.full_now():
                # Room again (a stream that fills up again tells the gate again).
                self._full.discard(stream)
            elif stream.stalls(model, session_id, principal):
                return True
        return False


class HeldBytesExceeded(ResourceExhausted):
    """A call's kept events would pass its principal's max_buffered_bytes_per_principal."""


class HeldBytes:
    """Event bytes that calls keep because a full stream cannot take them yet (see
    passes.Pass), per principal, counted with the principal's stream buffers against
    max_buffered_bytes_per_principal: past it, the call keeping them fails with
    RESOURCE_EXHAUSTED instead of holding more memory. Any thread."""

    def __init__(self, limit: int, buffers: Callable[[str], int]) -> None:
        self.limit = limit
        #: The byte budgets of a principal's open streams.
        self._buffers = buffers
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}

    def take(self, principal: str, nbytes: int) -> None:
        """Counts ``nbytes`` more for ``principal``; ResourceExhausted, counting nothing,
        when that would pass the limit."""
        buffers = self._buffers(principal)
        with self._lock:
            held = self._held.get(principal, 0) + nbytes
            if held + buffers > self.limit:
                raise exceeded(
                    f"events the calls of {principal or 'the caller'!r} keep for full streams (its own, or an "
                    "operator's BLOCK stream) that cannot take them yet",
                    f"{held} bytes, {held + buffers} with its stream buffers",
                    self.limit, "max_buffered_bytes_per_principal",
                    "the streams' readers must read (or the calls capture less)", error=HeldBytesExceeded,
                )
            self._held[principal] = held

    def give(self, principal: str, nbytes: int) -> None:
        """Uncounts ``nbytes`` (delivered, or dropped with their failed call)."""
        if not nbytes:
            return
        with self._lock:
            held = self._held.get(principal, 0) - nbytes
            if held > 0:
                self._held[principal] = held
            else:
                self._held.pop(principal, None)

    def held(self, principal: str) -> int:
        """Bytes counted for ``principal`` now."""
        with self._lock:
            return self._held.get(principal, 0)


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
