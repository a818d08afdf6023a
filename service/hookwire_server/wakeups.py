"""Wake-ups of an event loop from a model's worker thread, handed over together.

Each ``loop.call_soon_threadsafe`` writes to the loop's self-pipe: a system call that
lets go of the GIL, which the worker thread then waits to get back from a busy event
loop. A decoding step of 8 Generate calls woke 8 streams that way, one per call, and
spent about a fifth of its time there (py-spy on tiny-lm, issue 26). While the worker
runs a plan inside ``deferred()``, ``call_soon`` collects the wake-ups instead, and the
end of the plan hands each loop all of its own in one call.

The same holds for the events of a vLLM step in worker processes: the link thread takes
a step's firings in ``link_end`` and puts each event into its streams (``EventStream``),
one self-pipe write per stream that was empty; under ``deferred(events=True)`` the event
loop wakes once, after the step's last event, and sends them together (one EventBatch,
not one message per firing). Event streams' wake-ups (``call_soon(..., event=True)``)
are held only in such a block: the torch engine's plans, which run forward passes
inside ``deferred()``, keep streaming a pass's events (large chunked ones above all)
while the pass runs.

A thread that must wait for the event loop inside a ``deferred()`` block (an event
stream that blocks its producer until there is room) calls ``flush()`` first, so that
the loop it waits for has been woken.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

log = logging.getLogger("hookwire.wakeups")

_local = threading.local()


def call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[[], object], *, event: bool = False) -> None:
    """Runs ``fn`` on ``loop`` (any thread): at the end of the ``deferred()`` block this
    thread is in, else at once (``call_soon_threadsafe``). ``event``: an event stream's
    wake-up, held only in a block opened with ``events=True``. RuntimeError when the
    loop is closed (at once only: a deferred wake-up to a closed loop is dropped)."""
    pending: dict[asyncio.AbstractEventLoop, list[Callable[[], object]]] | None = getattr(_local, "pending", None)
    if pending is None or (event and not getattr(_local, "events", False)):
        loop.call_soon_threadsafe(fn)
    else:
        pending.setdefault(loop, []).append(fn)


@contextlib.contextmanager
def deferred(*, events: bool = False) -> Iterator[None]:
    """Collects this thread's ``call_soon`` wake-ups (``events``: event streams' too)
    until the block ends, then hands them over, one call per loop, in order (also when
    the block raises). Nested blocks hand over at the end of the outermost."""
    if getattr(_local, "pending", None) is not None:
        outer = getattr(_local, "events", False)
        _local.events = outer or events
        try:
            yield
        finally:
            _local.events = outer
        return
    pending: dict[asyncio.AbstractEventLoop, list[Callable[[], object]]] = {}
    _local.pending = pending
    _local.events = events
    try:
        yield
    finally:
        _local.pending = None
        _local.events = False
        _hand_over(pending)


def flush() -> None:
    """Hands over this thread's collected wake-ups now (before it waits for a loop);
    nothing outside a ``deferred()`` block."""
    pending: dict[asyncio.AbstractEventLoop, list[Callable[[], object]]] | None = getattr(_local, "pending", None)
    if not pending:
        return
    taken = dict(pending)
    pending.clear()
    _hand_over(taken)


def _hand_over(pending: dict[asyncio.AbstractEventLoop, list[Callable[[], object]]]) -> None:
    for loop, fns in pending.items():
        try:
            loop.call_soon_threadsafe(_run_all, fns)
        except RuntimeError:  # the loop has closed: nobody reads any more
            pass


def _run_all(fns: list[Callable[[], object]]) -> None:
    # One wake-up that fails must not keep the others (other calls' streams) asleep.
    for fn in fns:
        try:
            fn()
        except Exception:
            log.exception("a wake-up failed")
