"""Reading event streams: chunk reassembly, and routing to per-hook queues."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence, Union

import grpc

from .wire import codec
from ._errors import HookwireError, from_rpc_error
from .wire.framing import CutReply, RawChunk
from ._types import InterceptEvent, Notice
from .v1 import hook_pb2, hook_service_pb2, tensor_pb2

log = logging.getLogger("hookwire")

#: How many ended calls a stream reader remembers, so that ``events(until=call)`` also
#: ends for a call whose end marker was read before the iteration started.
CALL_ENDS_KEPT = 10_000
#: What the SDK holds of a stream read ahead of its readers when the stream's
#: DeliveryOptions leave max_events / max_bytes at 0: the server's own defaults.
DEFAULT_MAX_EVENTS = 1024
DEFAULT_MAX_BYTES = 32 << 20

#: A stream's DeliveryPolicy as the SDK's reader applies it to its own buffer. A
#: session stream's default blocks (the server then blocks the session's own calls
#: and drops other callers' events); a Subscribe stream's default drops the oldest.
_READER_POLICY: dict[int, str] = {
    hook_service_pb2.DELIVERY_POLICY_BLOCK: "block",
    hook_service_pb2.DELIVERY_POLICY_DROP_OLDEST: "drop_oldest",
    hook_service_pb2.DELIVERY_POLICY_DROP_NEWEST: "drop_newest",
}


def reader_policy(policy: int, *, session: bool) -> str:
    """What the SDK does when its buffer of a stream with DeliveryPolicy ``policy`` is
    full: "block" (stop reading: gRPC's flow control makes the server's buffer fill, and
    the server applies its policy), "drop_oldest" or "drop_newest" (keep reading, drop
    in the SDK and count it in the next events' ``dropped``)."""
    return _READER_POLICY.get(policy, "block" if session else "drop_oldest")


def data_bytes(event: hook_pb2.InterceptEvent) -> int:
    """The bytes of tensor data an event holds (what a stream's max_bytes counts), from
    the tensors' shapes: reading a bytes field would copy it."""
    return sum(math.prod(t.shape) * codec.ITEMSIZE.get(t.dtype, 0) for _, t in codec.iter_tensors(event))


@dataclasses.dataclass(frozen=True)
class CallEnded:
    """A stream's marker: every event that call ``request_id`` put on the stream came before it."""

    request_id: str
    model: str


def kind_of(msg: Any) -> str | None:
    """Which kind a stream message is (its oneof ``kind``): "chunk" for a RawChunk."""
    if type(msg) is RawChunk:
        return "chunk"
    return (msg.msg if type(msg) is CutReply else msg).WhichOneof("kind")


def uncut(msg: Any) -> tuple[Any, dict[int, Any]]:
    """A message read by Client.tensor_calls as (the message, the data of the tensors
    cut out of it by chunk id; see hookwire.wire.framing.CutReply)."""
    if type(msg) is CutReply:
        return msg.msg, msg.views
    return msg, {}


def restored(msg: Any, views: dict[int, Any]) -> Any:
    """``msg`` with the data cut out of it put back in its tensors (one more copy each):
    for messages whose tensors are decoded without a chunk mapping."""
    if views:
        for _, tensor in codec.iter_tensors(msg):
            data = views.get(tensor.chunk_id)
            if data is not None:
                tensor.chunk_id = 0
                tensor.data = bytes(data)
    return msg


def assembled(msg: Any, views: dict[int, Any]) -> dict[int, Any] | None:
    """The tensors cut out of ``msg`` (which has no other chunked tensors), by chunk id;
    None when none was. CodecError when one does not fit."""
    if not views:
        return None
    assembler = codec.ChunkAssembler(msg)
    assembler.take(views)
    if not assembler.done:
        raise codec.CodecError("a tensor has a chunk_id, but no chunks may follow this message")
    return assembler.result()


Item = Union["tuple[hook_pb2.InterceptEvent, dict[int, Any] | None]", Notice, CallEnded]


class EventAssembler:
    """Joins the event messages of one stream with the TensorChunks that follow them.

    Memory: a chunked event's tensors are allocated once and filled chunk by chunk.
    Raises HookwireError (DATA_LOSS) for chunks out of place, CodecError for chunks
    that do not fit their tensor.
    """

    def __init__(self) -> None:
        self._pending: tuple[hook_pb2.InterceptEvent, codec.ChunkAssembler] | None = None

    def event(
        self, event: hook_pb2.InterceptEvent, views: dict[int, Any] | None = None,
    ) -> tuple[hook_pb2.InterceptEvent, dict[int, Any] | None] | None:
        """The event, complete; None when its chunks are still to come. ``views``: the
        data of tensors cut out of its message (see uncut)."""
        if self._pending is not None:
            raise HookwireError("an event arrived before the chunks of the previous one", code="DATA_LOSS")
        assembler = codec.ChunkAssembler(event)
        if views:
            assembler.take(views)
        if assembler.done:
            return event, assembler.result() if views else None
        self._pending = (event, assembler)
        return None

    def chunk(self, chunk: tensor_pb2.TensorChunk | RawChunk) -> tuple[hook_pb2.InterceptEvent, dict[int, Any] | None] | None:
        """The pending event once this chunk completed it, else None."""
        if self._pending is None:
            raise HookwireError("a tensor chunk arrived without its event", code="DATA_LOSS")
        event, assembler = self._pending
        assembler.feed(chunk)
        if not assembler.done:
            return None
        self._pending = None
        return event, assembler.result()

    def check_complete(self) -> None:
        """At the end of the stream: raises if an event still waits for chunks."""
        if self._pending is not None:
            raise HookwireError("the stream ended before an event's chunks were complete", code="DATA_LOSS")


async def stream_items(call: grpc.aio.UnaryStreamCall) -> AsyncIterator[Item]:
    """The events (with their chunked tensors reassembled), notices and call-end markers
    of a session or subscription stream.

    Uses read(), not async-for: callers read the opening message with read(), and
    grpc forbids mixing the two styles on one call.
    """
    assembler = EventAssembler()
    while (msg := await call.read()) is not grpc.aio.EOF:
        if type(msg) is RawChunk:  # read by hand (Client.tensor_calls): its data is a view of the message
            complete = assembler.chunk(msg)
            if complete is not None:
                yield complete
            continue
        msg, views = uncut(msg)
        kind = msg.WhichOneof("kind")
        if kind == "chunk":
            complete = assembler.chunk(msg.chunk)
            if complete is not None:
                yield complete
        elif kind == "event":
            complete = assembler.event(msg.event, views)
            if complete is not None:
                yield complete
        elif kind == "batch":
            chunked = assembled(msg.batch, views)
            for event in msg.batch.events:
                yield event, chunked
        elif kind == "notice":
            yield notice_of(msg.notice)
        elif kind == "call_ended":
            yield CallEnded(msg.call_ended.request_id, msg.call_ended.model)
    assembler.check_complete()


def notice_of(msg: Any) -> Notice:
    """A Notice from the wire, logged as a warning when it says a hook lost events."""
    notice = Notice.from_proto(msg)
    if notice.kind in ("capture_failed", "hook_disabled", "drops_started"):
        log.warning("hook %s: %s", notice.hook_id or "-", notice.message)
    return notice


class EndedCalls:
    """The calls whose end marker a stream has carried, with the stream position of each
    marker; the most recent CALL_ENDS_KEPT."""

    def __init__(self) -> None:
        self._at: collections.OrderedDict[str, int] = collections.OrderedDict()

    def add(self, request_id: str, position: int) -> None:
        """Records a marker."""
        self._at[request_id] = position
        if len(self._at) > CALL_ENDS_KEPT:
            self._at.popitem(last=False)

    def position(self, request_id: str) -> int | None:
        """Where the call's marker was, or None if it has not arrived (or was forgotten)."""
        return self._at.get(request_id)


class _Entry:
    """An event in an inbox: its stream position, the event (with its chunked tensors),
    the SDK's drops before it arrived and its bytes of tensor data."""

    __slots__ = ("position", "item", "dropped_before", "nbytes")

    def __init__(self, position: int, item: tuple[hook_pb2.InterceptEvent, dict[int, Any] | None],
                 dropped_before: int, nbytes: int) -> None:
        self.position = position
        self.item = item
        self.dropped_before = dropped_before
        self.nbytes = nbytes


class _Inbox:
    """One hook's events not yet read (a Subscription's: every hook's), in stream order."""

    def __init__(self) -> None:
        self.items: collections.deque[_Entry] = collections.deque()
        #: Decoded events of a compact readout event (InterceptEvent.expand) not yet handed
        #: out, with its position: read before ``items``, so a reader that stops in the
        #: middle of one leaves the rest for the next.
        self.rest: collections.deque[tuple[int, InterceptEvent]] = collections.deque()
        self._wake = asyncio.Event()

    def next_position(self) -> int | None:
        """The stream position of the next event to read; None when there is none."""
        if self.rest:
            return self.rest[0][0]
        return self.items[0].position if self.items else None

    def put(self, entry: _Entry) -> None:
        self.items.append(entry)
        self._wake.set()

    def wake(self) -> None:
        """Lets waiting readers look again (the hook or a call ended, or the stream did)."""
        self._wake.set()

    def arm(self) -> None:
        """Forgets earlier wakes: call it before checking the conditions ``wait`` waits on.
        (Clearing inside ``wait`` lost wakes: under ``asyncio.wait_for`` the wait starts a
        loop turn later, and a marker routed in that turn was cleared unseen.)"""
        self._wake.clear()

    async def wait(self) -> None:
        """Waits for a put or wake since the last ``arm``."""
        await self._wake.wait()


class EventRouter:
    """Routes the items of one stream to per-hook inboxes (``one_inbox``: all to one, in
    arrival order, as a Subscription reads them).

    The events read ahead of their readers are bounded like the server's buffer of
    the stream (``max_events``, ``max_bytes`` of tensor data; 0: the server's
    defaults; a single larger event is still held, alone), and a full buffer applies
    the stream's policy (see reader_policy): "block" stops reading (``room``), so
    that gRPC's flow control fills the server's buffer and the server applies its
    own policy there (a session's own calls wait for the reader); "drop_oldest" and
    "drop_newest" keep reading and drop here, counted like the server's drops: each
    event's ``dropped`` is the server's count plus the SDK's drops of events that
    came before it on the stream. Under "block" the SDK reads past the bound only
    while a reader waits for an event that has not arrived (one hook's reader waiting
    behind unread events of another's), so that readers never deadlock.

    Events may arrive before the RegisterHook reply does; they wait in the hook's
    inbox until its handle reads them. Every item has a position in the stream, so a
    reader can stop exactly at a call's end marker.
    """

    def __init__(self, *, policy: str = "block", max_events: int = 0, max_bytes: int = 0,
                 one_inbox: bool = False) -> None:
        if policy not in ("block", "drop_oldest", "drop_newest"):
            raise ValueError(f"policy must be block, drop_oldest or drop_newest, not {policy!r}")
        self.policy = policy
        self.max_events = max_events or DEFAULT_MAX_EVENTS
        self.max_bytes = max_bytes or DEFAULT_MAX_BYTES
        self._one_inbox = one_inbox
        #: Events held (routed, not yet taken by a reader) and their bytes of tensor data.
        self.held_events = 0
        self.held_bytes = 0
        #: Events of the stream the SDK dropped itself (its buffer was full).
        self.dropped = 0
        self._waiting = 0  # readers waiting for an event that has not arrived
        #: The owner's own calls in the stream's session now in flight (Infer awaited,
        #: Generate streaming): under "block" the SDK reads past its bound while there is
        #: one, because such a call waits for this stream's reader (see room).
        self.own_calls = 0
        self._warned_own = False
        self._room = asyncio.Event()
        self._warned = False  # room() said once that the SDK stopped reading
        #: Called with a hook id before an event of a hook whose modules are not known
        #: is expanded (a Subscription lists the hooks); it must set ``modules[hook_id]``.
        self.resolve: Callable[[str], Awaitable[None]] | None = None
        self._inboxes: dict[str, _Inbox] = {}
        self._ended: set[str] = set()
        self._position = 0
        self.calls = EndedCalls()
        self.error: HookwireError | None = None
        self.notices: list[Notice] = []
        self.closed = False
        #: Called on each call's end marker (the fleet client's merged readers wait on
        #: their own queue, not on an inbox this wakes).
        self.call_listeners: set[Callable[[], None]] = set()
        #: Each registered hook's resolved modules (HookInfo.modules), which its compact
        #: readout events index (InterceptEvent.expand).
        self.modules: dict[str, Sequence[str]] = {}

    def _inbox(self, hook_id: str) -> _Inbox:
        inbox = self._inboxes.get(hook_id)
        if inbox is None:
            inbox = self._inboxes[hook_id] = _Inbox()
        return inbox

    def route(self, item: Item) -> None:
        """Dispatches one stream item."""
        self._position += 1
        if isinstance(item, CallEnded):
            self.calls.add(item.request_id, self._position)
            for waiting in self._inboxes.values():  # readers waiting for this call's end
                waiting.wake()
            for listener in self.call_listeners:
                listener()
            return
        if isinstance(item, Notice):
            self.notices.append(item)
            if item.kind == "hook_removed" and item.hook_id:
                self._ended.add(item.hook_id)
                removed = self._inboxes.get(item.hook_id)
                if removed is not None:
                    removed.wake()
            return
        event, _ = item
        if event.hook_id in self._ended:
            return
        nbytes = data_bytes(event)
        if self._full(nbytes):
            if self.policy == "drop_newest":
                self.dropped += 1
                return
            if self.policy == "drop_oldest":
                while self.held_events and self._full(nbytes):
                    self._drop_oldest()
        self.held_events += 1
        self.held_bytes += nbytes
        self._inbox("" if self._one_inbox else event.hook_id).put(_Entry(self._position, item, self.dropped, nbytes))

    def _full(self, nbytes: int) -> bool:
        """Whether an event of ``nbytes`` does not fit beside the held ones."""
        return self.held_events >= self.max_events or (self.held_events > 0 and self.held_bytes + nbytes > self.max_bytes)

    def _drop_oldest(self) -> None:
        """Drops the held event that came first on the stream (inboxes are in stream order:
        it is at the front of one of them)."""
        oldest = min((i for i in self._inboxes.values() if i.items), key=lambda i: i.items[0].position)
        self._taken(oldest.items.popleft())
        self.dropped += 1

    def _taken(self, entry: _Entry) -> None:
        self.held_events -= 1
        self.held_bytes -= entry.nbytes
        self._room.set()

    def _dropped_before(self, entry: _Entry) -> int:
        """The SDK's drops of events that came before ``entry`` on the stream. Under
        drop_oldest every drop so far did (the oldest held event goes first, and a reader
        takes events in order); under drop_newest, those made before it arrived."""
        return self.dropped if self.policy == "drop_oldest" else entry.dropped_before

    def own_call(self) -> Callable[[], None]:
        """Counts one of the owner's calls in the stream's session as in flight until the
        returned function is called (idempotent). While one is, a "block" stream is read
        past its bound: that call waits on the server for this stream's reader, and a
        program that awaits its call before reading the call's events (the quickstart's
        pattern) would otherwise wait for ever once they outgrow both buffers."""
        self.own_calls += 1
        self._room.set()
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                self.own_calls -= 1

        return release

    def _over(self) -> bool:
        return self.held_events >= self.max_events or self.held_bytes >= self.max_bytes

    async def room(self) -> None:
        """Waits until the stream may be read further (the pump calls it between items): at
        once under a drop policy; under "block" once fewer than the limits are held, a
        reader waits for an event not yet read, one of the owner's own calls in the
        session is in flight (``own_call``), or the stream is over."""
        if self.own_calls and self.policy == "block" and self._over() and not self._warned_own:
            self._warned_own = True
            log.warning(
                "the SDK holds %d unread events (%d bytes of tensor data) of its session stream, past its "
                "limit, because the session's own calls wait for them to be read; they are held in memory "
                "until hook.events() reads them (read them while calls run to keep memory bounded; docs/sdk.md)",
                self.held_events, self.held_bytes)
        while (self.policy == "block" and not self.closed and not self._waiting and not self.own_calls
               and self._over()):
            if not self._warned:
                # Once per stream: a session whose calls are awaited before their events
                # are read otherwise hangs without a word once the unread events outgrow
                # this buffer and the server's.
                self._warned = True
                log.warning(
                    "the SDK holds %d unread events (%d bytes of tensor data) of a stream, its limit: it "
                    "stops reading until they are read, and the server then holds the calls this stream "
                    "blocks (a session's own calls); read hook.events() while calls run, or raise the "
                    "limits (ConnectOptions.session_max_events / session_max_bytes; docs/sdk.md)",
                    self.held_events, self.held_bytes)
            self._room.clear()
            await self._room.wait()

    def end(self, error: HookwireError | None = None) -> None:
        """The stream is over: every reader stops (with ``error`` if it failed) once it
        has read what had arrived."""
        self.closed = True
        if error is not None or self.error is None:
            self.error = error
        for inbox in self._inboxes.values():
            inbox.wake()
        self._room.set()

    async def events(
        self, hook_id: str, until: str | None = None, timeout: float | None = None,
    ) -> AsyncGenerator[InterceptEvent, None]:
        """The hook's events in arrival order, until it is removed or the stream ends;
        with ``until`` (a request id), until that call's end marker has arrived and every
        event of the hook that came before it has been read; with ``timeout``, also once
        nothing has arrived for that many seconds."""
        inner = self.positioned_events(hook_id, until, timeout)
        try:
            async for _, event in inner:
                yield event
        finally:
            await inner.aclose()

    def pending_before(self, hook_id: str, position: int) -> bool:
        """Whether the hook's inbox still holds an event from before stream ``position``
        (one its reader has not taken yet)."""
        inbox = self._inboxes.get(hook_id)
        following = None if inbox is None else inbox.next_position()
        return following is not None and following < position

    async def positioned_events(
        self, hook_id: str, until: str | None = None, timeout: float | None = None,
    ) -> AsyncGenerator[tuple[int, InterceptEvent], None]:
        """``events``, each with its position in the stream (what ``calls.position`` of a
        call's end marker is compared with: the fleet client merges several streams)."""
        inbox = self._inbox(hook_id)
        while True:
            inbox.arm()
            end = None if until is None else self.calls.position(until)
            following = inbox.next_position()
            if end is not None and (following is None or following > end):
                return
            if inbox.rest:
                yield inbox.rest.popleft()
                continue
            if inbox.items:
                entry = inbox.items[0]
                event, chunked = entry.item
                if event.module_indices and event.hook_id not in self.modules and self.resolve is not None:
                    await self.resolve(event.hook_id)  # then look again: another reader may have taken it
                    continue
                inbox.items.popleft()
                self._taken(entry)
                first, *rest = InterceptEvent.expand(event, chunked, modules=self.modules.get(event.hook_id))
                dropped = self._dropped_before(entry)
                if dropped:
                    first = dataclasses.replace(first, dropped=first.dropped + dropped)
                inbox.rest.extend((entry.position, e) for e in rest)
                yield entry.position, first
                continue
            if self.closed:
                if self.error is not None:
                    raise self.error
                return
            if hook_id in self._ended:
                self._inboxes.pop(hook_id, None)  # removed for good: free its inbox
                return
            self._waiting += 1  # lets a blocked pump read on (see room)
            self._room.set()
            try:
                if timeout is None:
                    await inbox.wait()
                    continue
                try:
                    await asyncio.wait_for(inbox.wait(), timeout)
                except TimeoutError:  # wait() holds nothing: cancelling it loses no event
                    return
            finally:
                self._waiting -= 1


async def pump(call: grpc.aio.UnaryStreamCall, router: EventRouter, target: str | None = None) -> None:
    """Reads a stream into ``router`` until it ends, no further ahead of its readers than
    ``router.room`` lets it; records a failure in router.error (``target``: the address
    the channel dials, which a lost connection's message names)."""
    error: HookwireError | None = None
    try:
        async for item in stream_items(call):
            router.route(item)
            await router.room()
    except asyncio.CancelledError:
        pass
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.CANCELLED:
            error = from_rpc_error(exc, target=target)
    except HookwireError as exc:
        error = exc
    except codec.CodecError as exc:
        error = HookwireError(str(exc), code="DATA_LOSS")
    except Exception as exc:  # a reader must never see a failed stream as a clean end
        log.exception("session stream reader failed")
        error = HookwireError(f"{type(exc).__name__}: {exc}", code="UNKNOWN")
    finally:
        router.end(error)
