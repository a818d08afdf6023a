"""A session stream and the per-hook event queues it feeds."""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

import grpc

from ._errors import HookwireError, from_rpc_error
from ._types import InterceptEvent, Notice
from .v1 import hook_pb2, hook_service_pb2

log = logging.getLogger("hookwire")

_END = object()


class EventRouter:
    """Routes the messages of one stream to per-hook queues.

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

    def route(self, msg: hook_service_pb2.SessionMessage) -> None:
        """Dispatches one stream message."""
        kind = msg.WhichOneof("kind")
        if kind == "event":
            self._route_event(msg.event)
        elif kind == "batch":
            for event in msg.batch.events:
                self._route_event(event)
        elif kind == "notice":
            notice = Notice.from_proto(msg.notice)
            self.notices.append(notice)
            if notice.kind == "capture_failed":
                log.warning("hook %s: %s", notice.hook_id, notice.message)
            elif notice.kind == "hook_removed" and notice.hook_id:
                self._queue(notice.hook_id).put_nowait(_END)
                self._ended.add(notice.hook_id)

    def _route_event(self, event: hook_pb2.InterceptEvent) -> None:
        if event.hook_id not in self._ended:
            self._queue(event.hook_id).put_nowait(event)

    def end(self, error: HookwireError | None = None) -> None:
        """The stream is over: every reader stops (with ``error`` if it failed)."""
        self.closed = True
        self.error = error
        for queue in self._queues.values():
            queue.put_nowait(_END)

    def forget(self, hook_id: str) -> None:
        """Drops a removed hook's queue."""
        self._queues.pop(hook_id, None)
        self._ended.add(hook_id)

    async def events(self, hook_id: str) -> AsyncIterator[InterceptEvent]:
        """The hook's events in arrival order, until it is removed or the stream ends."""
        queue = self._queue(hook_id)
        while True:
            item = await queue.get()
            if item is _END:
                queue.put_nowait(_END)  # later readers stop too
                if self.error is not None:
                    raise self.error
                return
            yield InterceptEvent.from_proto(item)  # type: ignore[arg-type]


async def pump(call: grpc.aio.UnaryStreamCall, router: EventRouter) -> None:
    """Reads a stream into ``router`` until it ends; records a failure in router.error."""
    error: HookwireError | None = None
    try:
        # read(), not async-for: the opening message was read with read() and grpc
        # forbids mixing the two styles on one call.
        while (msg := await call.read()) is not grpc.aio.EOF:
            router.route(msg)
    except asyncio.CancelledError:
        pass
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.CANCELLED:
            error = from_rpc_error(exc)
    finally:
        router.end(error)
