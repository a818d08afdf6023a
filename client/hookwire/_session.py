"""Reading event streams: chunk reassembly, and routing to per-hook queues."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Union, cast

import grpc

from . import _codec
from ._errors import HookwireError, from_rpc_error
from ._types import InterceptEvent, Notice
from .v1 import hook_pb2

log = logging.getLogger("hookwire")

_END = object()

Item = Union["tuple[hook_pb2.InterceptEvent, dict[int, Any] | None]", Notice]


async def stream_items(call: grpc.aio.UnaryStreamCall) -> AsyncIterator[Item]:
    """The events (with their chunked tensors reassembled) and notices of a stream.

    Memory: a chunked event's tensors are allocated once and filled chunk by chunk.
    Uses read(), not async-for: callers read the opening message with read(), and
    grpc forbids mixing the two styles on one call.
    """
    pending: tuple[hook_pb2.InterceptEvent, _codec.ChunkAssembler] | None = None
    while (msg := await call.read()) is not grpc.aio.EOF:
        kind = msg.WhichOneof("kind")
        if kind == "chunk":
            if pending is None:
                raise HookwireError("a tensor chunk arrived without its event", code="DATA_LOSS")
            pending[1].feed(msg.chunk)
            if pending[1].done:
                yield pending[0], pending[1].result()
                pending = None
        elif kind == "event":
            if pending is not None:
                raise HookwireError("an event arrived before the chunks of the previous one", code="DATA_LOSS")
            assembler = _codec.ChunkAssembler(msg.event)
            if assembler.done:
                yield msg.event, None
            else:
                pending = (msg.event, assembler)
        elif kind == "batch":
            for event in msg.batch.events:
                yield event, None
        elif kind == "notice":
            notice = Notice.from_proto(msg.notice)
            if notice.kind in ("capture_failed", "hook_disabled", "drops_started"):
                log.warning("hook %s: %s", notice.hook_id or "-", notice.message)
            yield notice
    if pending is not None:
        raise HookwireError("the stream ended before an event's chunks were complete", code="DATA_LOSS")


class EventRouter:
    """Routes the items of one stream to per-hook queues.

    Queues are unbounded on the client: the server's buffer is the bounded one,
    and a reader that falls behind holds events in its own memory instead of
    stalling the model. Events may arrive before the RegisterHook reply does;
    they wait in the hook's queue until its handle reads them.
    """

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[object]] = {}
        self._ended: set[str] = set()
        self.error: HookwireError | None = None
        self.notices: list[Notice] = []
        self.closed = False

    def _queue(self, hook_id: str) -> asyncio.Queue[object]:
        queue = self._queues.get(hook_id)
        if queue is None:
            queue = self._queues[hook_id] = asyncio.Queue()
            if self.closed or hook_id in self._ended:
                queue.put_nowait(_END)
        return queue

    def route(self, item: Item) -> None:
        """Dispatches one stream item."""
        if isinstance(item, Notice):
            self.notices.append(item)
            if item.kind == "hook_removed" and item.hook_id:
                self._queue(item.hook_id).put_nowait(_END)
                self._ended.add(item.hook_id)
            return
        event, _ = item
        if event.hook_id not in self._ended:
            self._queue(event.hook_id).put_nowait(item)

    def end(self, error: HookwireError | None = None) -> None:
        """The stream is over: every reader stops (with ``error`` if it failed)."""
        self.closed = True
        self.error = error
        for queue in self._queues.values():
            queue.put_nowait(_END)

    async def events(self, hook_id: str) -> AsyncIterator[InterceptEvent]:
        """The hook's events in arrival order, until it is removed or the stream ends."""
        queue = self._queue(hook_id)
        while True:
            item = await queue.get()
            if item is _END:
                queue.put_nowait(_END)  # later readers stop too
                if self.error is not None:
                    raise self.error
                if hook_id in self._ended:
                    self._queues.pop(hook_id, None)  # removed for good: free its queue
                return
            event, chunked = cast("tuple[hook_pb2.InterceptEvent, dict[int, Any] | None]", item)
            yield InterceptEvent.from_proto(event, chunked=chunked)


async def pump(call: grpc.aio.UnaryStreamCall, router: EventRouter) -> None:
    """Reads a stream into ``router`` until it ends; records a failure in router.error."""
    error: HookwireError | None = None
    try:
        async for item in stream_items(call):
            router.route(item)
    except asyncio.CancelledError:
        pass
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.CANCELLED:
            error = from_rpc_error(exc)
    except HookwireError as exc:
        error = exc
    except _codec.CodecError as exc:
        error = HookwireError(str(exc), code="DATA_LOSS")
    except Exception as exc:  # a reader must never see a failed stream as a clean end
        log.exception("session stream reader failed")
        error = HookwireError(f"{type(exc).__name__}: {exc}", code="UNKNOWN")
    finally:
        router.end(error)
