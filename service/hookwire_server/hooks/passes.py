"""The state of one call (an Infer call, or a Generate call over its steps) as the hooks
that fire in its passes read it: who made it, which pass (step) is running, the call
indices of the running pass, the seq numbers of its request-scoped hooks, where those
hooks' events go, and which session streams received its events (they get a
``CallEnded`` marker when it ends).

An Infer call is one pass, step 0. A Generate call runs passes 0, 1, 2, ... (step 0 over
the prompt, step s over the s-th new token); ``begin_step`` starts each, restarting the
call indices. Hooks read the calls of the running pass from ``ModelHost.current_batch``
(engine.batching.Batch: each call's Pass and its rows) on the model's worker thread;
everything here is touched by that thread while a pass runs and by the event loop only
between passes (events a full stream could not take are delivered after the pass by a
thread of their own: ``finish``/``flush_backlog``).
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Callable

from hookwire.wire.codec import Chunker
from hookwire.wire.framing import Framing, Splicer
from hookwire.v1 import hook_pb2, hook_service_pb2, model_service_pb2

from ..limits import exceeded
from .event_bus import HeldBytes

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
        #: Signals the call's hooks kept in the running pass, per principal owning the hooks
        #: (owner name -> signal name -> tensor: rules' SignalOp writes them, their
        #: conditions read them); emptied when a pass begins.
        self.signals: dict[str, Any] = {}
        #: Sequences (rows of the call) a stop rule ended in the running pass: row ->
        #: (hook id, module, step). The engine reads it after the pass; emptied (the same
        #: dict) when a pass begins.
        self.stops: dict[int, tuple[str, str, int]] = {}
        #: ``token_ids``, or a function that makes them (an engine whose hooks mostly run
        #: elsewhere builds them only when a hook here reads them).
        self._token_ids: Any = None
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
        #: Events a full stream that blocks for the call could not take without waiting
        #: (the pass never waits for a reader): ``flush_backlog`` delivers them, waiting,
        #: after the pass and before the call goes on. Once one is kept, every later
        #: session event of the call is kept behind it (streams see the call's order).
        self.backlog: list[tuple[Any, ...]] = []
        #: Where the backlog's bytes are counted (max_buffered_bytes_per_principal); None: nowhere.
        self.held_bytes: HeldBytes | None = None
        self._backlog_bytes = 0
        #: Set when nobody waits for the backlog any more (its Generate call timed out):
        #: a flush in progress stops, and the rest is dropped.
        self._abandoned = threading.Event()
        self._end_lock = threading.Lock()
        self._flushing = False
        self._end_pending = False

    @property
    def token_ids(self) -> Any:
        """The token ids at the running pass's positions, ``[sequences, positions]`` in the
        call's layout (a Generate step 0: the prompt as padded; later steps: each new
        token), for rules' token-id signals; None where the engine does not know them.
        Lazy where the engine set a function: made on first read, then kept."""
        ids = self._token_ids
        if callable(ids):
            ids = self._token_ids = ids()
        return ids

    @token_ids.setter
    def token_ids(self, value: Any) -> None:
        self._token_ids = value

    def begin_step(self, step: int) -> None:
        """Starts pass ``step``: call indices start again from 0. Worker thread, between passes."""
        self.step = step
        self._calls.clear()
        self._events_in_step = 0
        self.signals = {}
        self.stops.clear()
        self.token_ids = None

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
            raise exceeded("the call's request-scoped hooks", f"more than {self.max_events} events in one {per}",
                           self.max_events, "max_events_per_call", "hook fewer modules or use sampling")
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
        """Offers a session-scoped event of this call to ``stream`` (EventStream.put_event)
        without waiting: while the call shares a pass it is held (see hold); when the
        stream would make it wait (full, and blocking for this call), it is kept in the
        backlog, counted in ``held_bytes`` (ResourceExhausted past the principal's
        limit: the event is not kept and the call fails). Worker thread."""
        self.offered(stream)
        item = ("stream", stream, msg, hook_id, nbytes, kwargs)
        if self._held is not None:
            self._held.append(item)
        elif self.backlog or stream.put_event(
            msg, hook_id, nbytes, session_id=self.session_id, principal=self.principal, wait=False, **kwargs
        ) is None:
            self._keep([item])

    def _keep(self, items: list[tuple[Any, ...]]) -> None:
        """Adds ``items`` to the backlog, counting their bytes (all or none)."""
        nbytes = sum(item[4] for item in items if item[0] == "stream")
        if self.held_bytes is not None and nbytes:
            self.held_bytes.take(self.principal, nbytes)
        self._backlog_bytes += nbytes
        self.backlog.extend(items)

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
        self.signals = {}  # the call runs the pass again: its hooks keep them again
        self.stops.clear()
        del self.response.events[kept:]
        if self.splicer is not None:
            self.splicer.forget_after(spliced)
        self._held, self._checkpoint = None, None

    def release(self) -> None:
        """After a shared pass succeeded: delivers the held events in order without waiting;
        those from the first one a full stream would make wait on are kept in ``backlog``
        (ResourceExhausted, keeping none of them, past the principal's byte limit: the
        call fails). Worker thread."""
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
                self._keep(held[i:])
                return

    def flush_backlog(self) -> None:
        """Delivers the backlog, waiting for room as a call alone would have waited; an
        ``end`` asked for meanwhile (the call was cancelled) comes after it. Stops early,
        dropping the rest, once the call is abandoned. Blocks: run it off the event loop
        and off the model's worker thread."""
        with self._end_lock:
            self._flushing = True
            backlog, self.backlog = self.backlog, []
        try:
            for item in backlog:
                if item[0] == "sink":
                    assert self.sink is not None
                    if not self._abandoned.is_set():
                        self.sink(item[1], item[2])
                    continue
                _, stream, msg, hook_id, nbytes, kwargs = item
                if not self._abandoned.is_set():
                    removed = kwargs.get("cancelled")
                    stream.put_event(
                        msg, hook_id, nbytes, session_id=self.session_id, principal=self.principal,
                        **{**kwargs, "cancelled": self._gives_up(removed)},
                    )
                self._uncount(nbytes)
        finally:
            with self._end_lock:
                self._flushing = False
                ending, self._end_pending = self._end_pending, False
            if ending:
                self._end()

    def _gives_up(self, removed: Callable[[], bool] | None) -> Callable[[], bool]:
        """What ends a wait for room: the call abandoned, or the event's hook removed."""
        abandoned = self._abandoned.is_set
        return abandoned if removed is None else (lambda: abandoned() or removed())

    def _uncount(self, nbytes: int) -> None:
        self._backlog_bytes -= nbytes
        if self.held_bytes is not None:
            self.held_bytes.give(self.principal, nbytes)

    def abandon(self) -> None:
        """Nobody waits for the backlog any more (its call timed out waiting for a reader):
        a flush stops at its next event and drops the rest; a backlog not being flushed is
        dropped now. Any thread."""
        self._abandoned.set()
        with self._end_lock:  # a flush that starts later finds the backlog empty
            backlog = [] if self._flushing else self.backlog
            if not self._flushing:
                self.backlog = []
        for item in backlog:
            if item[0] == "stream":
                self._uncount(item[4])
        for stream in list(self._streams):  # a flush waiting for room re-checks, and stops
            stream.wake_producers()

    def finish(self, *, end: bool = True) -> concurrent.futures.Future[None] | None:
        """After the call's last pass (worker thread): its CallEnded markers (with ``end``)
        now, or, when events wait in its backlog, from a thread of its own once that
        thread has delivered them; the model goes on with other calls meanwhile, and the
        delivery does not depend on the caller (a call cancelled or timed out while its
        pass ran still delivers every event of that pass, then its marker). Returns a
        future done once that thread is, or None when nothing waited."""
        if not self.backlog:
            if end:
                self.end()
            return None
        flushing: concurrent.futures.Future[None] = concurrent.futures.Future()
        flushing.set_running_or_notify_cancel()  # a waiter that gives up cannot cancel it

        def flush_and_end() -> None:
            try:
                self.flush_backlog()
                if end:
                    self.end()
            finally:
                flushing.set_result(None)

        threading.Thread(target=flush_and_end, name=f"backlog:{self.request_id}", daemon=True).start()
        return flushing

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
