"""The state of one call (an Infer call, or a Generate call over its steps) as the hooks
that fire in its passes read it: who made it, which pass (step) is running, the call
indices of the running pass, the seq numbers of its request-scoped hooks, where those
hooks' events go, and which session streams received its events (they get a
``CallEnded`` marker when it ends).

An Infer call is one pass, step 0. A Generate call runs passes 0, 1, 2, ... (step 0 over
the prompt, step s over the s-th new token); ``begin_step`` starts each, restarting the
call indices. Hooks read the call from ``ModelHost.current_pass`` on the model's worker
thread; everything here is touched by that thread while a pass runs and by the event
loop only between passes.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from hookwire._codec import Chunker
from hookwire._framing import Framing, Splicer
from hookwire.v1 import hook_pb2, hook_service_pb2, model_service_pb2

from .errors import ResourceExhausted

#: Where the request-scoped hooks' events of a streaming call (Generate) go, as they
#: fire: the event and, when it has chunked tensors, the chunker holding them. Called on
#: the model's worker thread.
EventSink = Callable[[hook_pb2.InterceptEvent, "Chunker | None"], None]


class Pass:
    """One call, read by the hooks that fire in its passes."""

    def __init__(
        self, request_id: str, session_id: str, tags: frozenset[str] = frozenset(), *, principal: str = "",
        max_events: int | None = None, model: str = "", sink: EventSink | None = None, session_stream: Any = None,
    ) -> None:
        self.request_id = request_id
        self.session_id = session_id
        self.model = model
        #: The name of the principal that made the call (BLOCK streams hold their owner's calls).
        self.principal = principal
        self.tags = tags
        #: Most events the request-scoped hooks may produce in one pass (max_events_per_call).
        self.max_events = max_events
        #: The running pass: 0 for Infer and a Generate call's prompt pass, s for the pass
        #: consuming the s-th new token.
        self.step = 0
        #: Infer's response, which collects the request-scoped hooks' events (unused with a sink).
        self.response = model_service_pb2.InferResponse(request_id=request_id)
        #: Collects large tensors of the response when it is streamed (InferStream).
        self.chunker: Chunker | None = None
        #: Collects large tensors of a unary response (Infer), written into its wire bytes
        #: as it is sent; None: set inline (or in ``chunker``).
        self.splicer: Splicer | None = None
        #: Where request-scoped events go as they fire (Generate); None: into ``response``.
        self.sink = sink
        #: How the chunk messages of the sink's events are framed (their large tensors are
        #: copied into them as they are captured); None: kept as tensor snapshots.
        self.framing: Framing | None = None
        #: Where notices about the call's request-scoped hooks go (Generate); None: nowhere.
        self.notices: Callable[[hook_service_pb2.Notice], None] | None = None
        #: Takes the request-scoped hooks' captures as tensors instead of events (a harvest
        #: batch stores them itself): called with (hook id, action, module path, call index,
        #: parts) on the worker thread; None: events.
        self.tap: Callable[[str, Any, str, int, dict[str, Any]], None] | None = None
        self._events_in_step = 0
        self._calls: dict[tuple[str, str, int], int] = {}
        self._seqs: dict[str, int] = {}
        #: Session and subscription streams this call offered events to (ordered set), and
        #: the stream of the session it was made in: that one gets a CallEnded marker even
        #: when none of its hooks captured anything (a reader waiting for the call ends).
        self._streams: dict[Any, None] = {} if session_stream is None else {session_stream: None}
        #: While the call shares a pass with others (see hold): what its hooks emitted,
        #: in order, delivered when the pass succeeded (``release``); None: delivered as it fires.
        self._held: list[tuple[Any, ...]] | None = None
        self._checkpoint: tuple[Any, ...] | None = None
        #: Events ``release`` could not hand over without waiting (a full BLOCK stream):
        #: ``flush_backlog`` delivers them, waiting, before the call goes on.
        self.backlog: list[tuple[Any, ...]] = []
        self._end_lock = threading.Lock()
        self._flushing = False
        self._end_pending = False

    def begin_step(self, step: int) -> None:
        """Starts pass ``step``: call indices start again from 0. Worker thread, between passes."""
        self.step = step
        self._calls.clear()
        self._events_in_step = 0

    def next_call_index(self, hook_id: str, path: str, phase: int) -> int:
        """0 for a hook's first fire on a module in a phase in this pass, then 1, 2, ..."""
        key = (hook_id, path, phase)
        index = self._calls.get(key, 0)
        self._calls[key] = index + 1
        return index

    def count_event(self) -> None:
        """Counts a request-scoped event of this pass; ResourceExhausted, failing the call,
        past ``max_events``. An asynchronous capture counts when its hook fires (so the
        pass stops where it would have), and is filled later (``request_event(counted=True)``)."""
        if self.max_events is not None and self._events_in_step >= self.max_events:
            per = "pass (Generate step)" if self.sink is not None else "call"
            raise ResourceExhausted(
                f"the call's request-scoped hooks produced more than {self.max_events} events in one {per}, over the "
                f"limit of {self.max_events} (max_events_per_call); hook fewer modules or use sampling"
            )
        self._events_in_step += 1

    def request_event(self, *, counted: bool = False) -> tuple[hook_pb2.InterceptEvent, Chunker | Splicer | None]:
        """A new event of a request-scoped hook, and where its large tensors go (None:
        inline); hand it to ``deliver`` once filled. ResourceExhausted, failing the call,
        past ``max_events`` events in this pass (unless ``counted`` already)."""
        if not counted:
            self.count_event()
        if self.sink is None:
            return self.response.events.add(), self.chunker or self.splicer
        # Snapshot: the tensors are copied now, as the pass may change them in place later.
        return hook_pb2.InterceptEvent(), Chunker(snapshot=True, framing=self.framing)

    def deliver(self, event: hook_pb2.InterceptEvent, chunker: Chunker | Splicer | None) -> None:
        """Sends a filled request-scoped event (into the response, it already is)."""
        if self.sink is not None:
            assert not isinstance(chunker, Splicer)  # a sink's events are streamed (Chunker)
            kept = chunker if chunker is not None and chunker.tensors else None
            if self._held is not None:
                self._held.append(("sink", event, kept))
            else:
                self.sink(event, kept)

    def put_event(self, stream: Any, msg: Any, hook_id: str, nbytes: int, **kwargs: Any) -> None:
        """Offers a session-scoped event of this call to ``stream`` (EventStream.put_event),
        or keeps it while the call shares a pass (see hold)."""
        self.offered(stream)
        if self._held is not None:
            self._held.append(("stream", stream, msg, hook_id, nbytes, kwargs))
        else:
            stream.put_event(msg, hook_id, nbytes, session_id=self.session_id, principal=self.principal, **kwargs)

    # ------------------------------------------------------------ shared passes

    @property
    def holding(self) -> bool:
        """Whether the call shares a pass now (its events are held, see hold)."""
        return self._held is not None

    def hold(self) -> None:
        """Before a pass the call shares with other calls: keep what its hooks emit until
        the pass succeeded (``release``), and remember where its numbering stood, so that
        a failed shared pass can run again with the call alone (``rollback``) as if the
        failed one never happened. Worker thread."""
        self._held = []
        self._checkpoint = (
            dict(self._seqs), dict(self._calls), self._events_in_step, len(self.response.events), dict(self._streams),
            len(self.splicer.kept) if self.splicer is not None else 0,
        )

    def rollback(self) -> None:
        """Forgets what a failed shared pass did to this call (its held events, numbers);
        nothing when it was not holding."""
        if self._checkpoint is None:
            return
        seqs, calls, events, kept, streams, spliced = self._checkpoint
        self._seqs, self._calls, self._events_in_step, self._streams = seqs, calls, events, streams
        del self.response.events[kept:]
        if self.splicer is not None:
            self.splicer.forget_after(spliced)
        self._held, self._checkpoint = None, None

    def release(self) -> None:
        """After a shared pass succeeded: delivers the held events in order without waiting;
        those behind one a full BLOCK stream would wait for stay in ``backlog``. Worker thread."""
        held, self._held, self._checkpoint = self._held or [], None, None
        for i, item in enumerate(held):
            if item[0] == "sink":
                assert self.sink is not None
                self.sink(item[1], item[2])
                continue
            _, stream, msg, hook_id, nbytes, kwargs = item
            if stream.put_event(
                msg, hook_id, nbytes, session_id=self.session_id, principal=self.principal, wait=False, **kwargs
            ) is None:
                self.backlog = held[i:]
                return

    def flush_backlog(self) -> None:
        """Delivers the backlog, waiting for room as a call alone would have waited; an
        ``end`` asked for meanwhile (the call was cancelled) comes after it. Blocks: run it
        off the event loop and off the model's worker thread."""
        with self._end_lock:
            self._flushing = True
        try:
            backlog, self.backlog = self.backlog, []
            for item in backlog:
                if item[0] == "sink":
                    assert self.sink is not None
                    self.sink(item[1], item[2])
                    continue
                _, stream, msg, hook_id, nbytes, kwargs = item
                stream.put_event(msg, hook_id, nbytes, session_id=self.session_id, principal=self.principal, **kwargs)
        finally:
            with self._end_lock:
                self._flushing = False
                ending, self._end_pending = self._end_pending, False
            if ending:
                self._end()

    def next_seq(self, hook_id: str) -> int:
        """The seq of a request-scoped hook's next event (contiguous from 1)."""
        seq = self._seqs.get(hook_id, 0) + 1
        self._seqs[hook_id] = seq
        return seq

    def offered(self, stream: Any) -> None:
        """Notes that an event of this call was offered to ``stream`` (see ``end``)."""
        self._streams[stream] = None

    def end(self) -> None:
        """Puts a CallEnded marker on every stream this call offered events to, after its
        last event. Call it once, on the worker thread after the call's last pass (so no
        event of the call can follow it); while its backlog is being flushed, the marker
        follows the flush (the worker thread does not wait for a slow reader)."""
        with self._end_lock:
            if self._flushing:
                self._end_pending = True
                return
        self._end()

    def _end(self) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams:
            stream.put_call_ended(self.request_id, self.model, session_id=self.session_id, principal=self.principal)
