"""The scheduler of one model: calls wait in its queue, and each pass the model's worker
thread runs takes the first waiting call with the calls behind it that can share the
pass (equal join key, rows up to max_batch_size).

A pass starts when the worker is free: calls that arrive while a pass runs wait
together and join the next one, so under load passes grow by themselves. Company is
expected from the callers recently seen: those the last pass answered (they send again
soon) and those that were already waiting for a compatible pass when it ended. When
fewer rows wait than that, the first call waits up to max_batch_delay_ms after the model
became free, until that many rows wait (not while a work that cannot join it waits too:
the model would idle in front of that work); a wait that ran out before its company
came lowers the expectation to the rows that did come for the next SHORT_PASSES passes
(callers already waiting are not counted then). Without that wait,
closed-loop callers settle into alternating passes of one call and of all the others
(measured with 8 MiniLM callers: 249 of 513 passes held one call); expecting only the
last pass's rows, they settle into two groups that alternate (8 callers: passes of 4).
A model whose callers come one at a time never waits: its last pass held one row and
nothing else waited.

Work is data: an Infer call, a Generate call and a harvest batch are each a ``Work``
whose ``kind`` says which of the engine's executors runs it (seam.INFER, GENERATE,
HARVEST) and whose ``key`` says what it may share a pass with (works join only when
kind and key are equal; key None always runs alone). A Generate call is submitted once
(``Work.running``): the scheduler keeps it while the engine answers ``seam.Running``
for it, back in the queue after each pass with the key the engine gave, and it wants a
pass only while its reader has kept up or its caller ended it (seam.GenerateCall). Each turn of a model's loop is
three moves, as in vLLM's engine core: ``schedule`` decides and returns data (a Plan of
works to run together, or how long to wait), the engine executes the plan on the
model's worker thread (seam.Engine.execute: one result or exception per work), and the
results settle the works' futures. The scheduler never calls model code; the engine
never decides what runs.

A call that a full stream would hold (its owner's BLOCK stream, an operator's BLOCK
stream, its session's stream under the default policy: see event_bus.DeliveryGate)
does not start until that stream's reader takes from it: the works behind it that no
full stream holds overtake it, and the model never idles in front of a stalled reader.

Tests form batches deterministically with ``hold``: calls queue up without running
until ``release``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Hashable
from typing import Any, Callable

from ..errors import Unavailable
from ..hooks.event_bus import DeliveryGate
from ..models.model_registry import ModelHost
from .seam import Engine, Plan, Running

log = logging.getLogger("hookwire.batching")

#: Passes after a wait for company ran out during which callers already waiting are not
#: counted as company (see the module docstring): an open-loop stream of calls, whose
#: callers do not send again, waits at most once in so many passes.
SHORT_PASSES = 8


@dataclasses.dataclass(eq=False)
class Work:
    """One call (an Infer call, a Generate call for all its steps, a harvest batch)
    waiting for a pass."""

    #: Which executor of the engine runs it: seam.INFER, GENERATE or HARVEST (also the
    #: metrics' label).
    kind: str
    #: The work item the engine executes (infer_pass.InferCall, seam.GenerateCall,
    #: harvest_pass.HarvestBatch).
    payload: Any
    #: Works with equal (kind, key) may share a pass; None: alone.
    key: Hashable | None
    rows: int
    future: asyncio.Future[Any] = dataclasses.field(default_factory=lambda: asyncio.get_running_loop().create_future())
    queued_at: float = dataclasses.field(default_factory=time.perf_counter)
    #: Sizes the row total of a pass holding it must avoid (its inputs' other dimensions):
    #: a tensor every row shares whose first dimension had the pass's row count would be
    #: taken for rows and cut per call (a [tokens, width] position table).
    avoid: frozenset[int] = frozenset()
    #: Works of one group never share a pass (the calls of a session whose hooks save and
    #: patch slots: their saves must be seen in call order, not module order); None: any.
    group: str | None = None
    #: Set (on the loop) when its caller stopped waiting; read on the worker thread, where a
    #: batch already handed to the model skips it if its pass has not started.
    withdrawn: bool = False
    #: True while its batch is on the model's thread (its pass may be running). Event loop.
    in_flight: bool = False
    #: Called once when its batch is back from the model's thread, for a caller that
    #: stopped waiting while it was there: what the pass may still be using (the call's
    #: claim in the memory budget) is given back only then. Event loop.
    on_finished: Callable[[], None] | None = None
    #: Background work (a harvest batch) runs only when no live work waits, always alone
    #: (key None), and sets no expectation of company for live calls: a live call waits at
    #: most for the one background pass that is running when it arrives.
    background: bool = False
    #: Who made the call: (session id, principal name), what a stream's policy decides by
    #: (DeliveryGate.stalled); None: no full stream holds it back.
    caller: tuple[str, str] | None = None
    #: Since when (time.perf_counter) a full stream holds it back; None while none does.
    stalled_since: float | None = None
    #: A call the scheduler keeps for several passes (a seam.GenerateCall payload): after
    #: each pass whose result is seam.Running it goes back in the queue, and it wants a
    #: pass only while its payload asks for one (_wants).
    running: bool = False


def _wants(work: Work) -> bool:
    """Whether ``work`` waits for a pass: still wanted and, for a running call, its caller
    wants its next step (its stream took the last one) or ended it (it must be finished)."""
    if work.future.done():
        return False
    if not work.running:
        return True
    call = work.payload
    return call.ended is not None or call.step <= call.allowed


@dataclasses.dataclass(frozen=True)
class Decision:
    """What ``Scheduler.schedule`` decided: run ``works`` together now (their Plan), or
    run nothing before ``wait_until`` (time.perf_counter; None: until something changes)."""

    works: list[Work] = dataclasses.field(default_factory=list)
    wait_until: float | None = None
    #: Whether the works run with fewer rows than the company expected, its deadline past.
    short: bool = False
    #: The work whose company a wait (``wait_until``) is for.
    waiting_for: Work | None = None

    @property
    def plan(self) -> Plan:
        return Plan(self.works[0].kind, [work.payload for work in self.works])


class Scheduler:
    """Joins the model's waiting calls into passes and runs them on ``engine`` (see the
    module docstring); ``gate`` says which calls a full stream holds back."""

    def __init__(self, host: ModelHost, engine: Engine, gate: DeliveryGate | None = None) -> None:
        self._host = host
        self._engine = engine
        self._gate = gate
        self._queue: collections.deque[Work] = collections.deque()
        self._changed: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._held = False
        self._closed = False
        #: Rows of company expected for the next pass (see the module docstring), and for how
        #: many more passes waiting callers are not counted in it (a wait for company ran out).
        self._company = 0
        self._short = 0
        self._last_works = 0
        #: The running calls the last pass held that go on (back in the queue).
        self._went_on: list[Work] = []
        self._free_since = 0.0

    @property
    def queued(self) -> int:
        """Works waiting for a pass now (a running Generate call only while it wants its
        next step or its end)."""
        return sum(1 for work in self._queue if _wants(work))

    def hold(self) -> None:
        """Lets calls queue up without running until ``release`` (tests form batches with
        it). Event loop."""
        self._held = True

    def release(self) -> None:
        """Undoes ``hold``: the waiting calls run, joined as they can be. Event loop."""
        self._held = False
        self._poke()

    def close(self) -> None:
        """Fails the waiting works with Unavailable and stops taking new ones (the model
        is shutting down). Any thread; on the event loop it takes effect at once."""
        self._closed = True
        task = self._task
        if task is None:
            return
        loop = task.get_loop()
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._fail_waiting()
        elif not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._fail_waiting)
            except RuntimeError:  # closed meanwhile: nothing waits any more
                pass

    def _fail_waiting(self) -> None:
        works = list(self._queue)
        self._queue.clear()
        self._finish_running(works)
        for work in works:
            _fail(work, Unavailable(f"model {self._host.name!r} is shutting down"))
        if self._task is not None:
            self._task.cancel()

    def _finish_running(self, works: list[Work], failure: BaseException | None = None) -> None:
        """Running calls that will get no more passes (the model shuts down, or a plan
        failed as a whole: ``failure``): ended, told so in their mailbox, and handed to the
        engine one last time on the worker thread, which finishes them (their hooks
        detach, their events end, their state is freed). A mailbox reads only its first
        "ended"; one that the engine puts later is never read. Event loop."""
        running = [w for w in works if w.running and not w.future.done()]
        if not running:
            return
        gone = Unavailable(f"model {self._host.name!r} is shutting down")
        for work in running:
            work.payload.ended = work.payload.ended or "shutdown"
            # Each its own exception: a stream that raises it clears its frames (errors.release_failure).
            work.payload.put(("ended", _own(failure) if failure is not None else gone))

        try:
            self._host._executor.submit(_execute, self._engine, running).add_done_callback(_log_finish)
        except RuntimeError:  # the worker is gone already: nothing runs on it any more
            log.debug("model %s: the worker is gone; %d Generate calls were not finished", self._host.name,
                      len(running))

    def poke(self) -> None:
        """Looks at the waiting works again (a stream that held some back has room). Event loop."""
        self._poke()

    def _poke(self) -> None:
        if self._changed is not None:
            self._changed.set()

    async def submit(self, work: Work) -> Any:
        """Queues ``work`` and waits for its result (raises what its run raised). A
        cancelled wait takes the work out of the queue if it has not started."""
        self.enqueue(work)
        # A cancelled wait cancels the future: a work still queued never runs (the loop
        # skips it), nor does one whose batch waits behind other work on the model's
        # thread (_run skips it); a running one's result is dropped.
        try:
            return await work.future
        except asyncio.CancelledError:
            work.withdrawn = True
            raise

    def enqueue(self, work: Work) -> None:
        """Queues ``work`` without waiting for it: a running call (``Work.running``), whose
        engine tells the call itself how each step and its end went (its mailbox), and
        whose future only says that it ended. Unavailable once the model shuts down.
        Event loop."""
        if self._closed:
            raise Unavailable(f"model {self._host.name!r} is shutting down")
        if self._changed is None:
            self._changed = asyncio.Event()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"scheduler:{self._host.name}")
        if work.running:
            work.payload.wake = self._poke
        self._queue.append(work)
        self._poke()

    def _rows_for(self, first: Work) -> int:
        return sum(w.rows for w in self._compatible(first))

    def _stalled(self, work: Work) -> bool:
        """Whether a full stream holds ``work`` back now (noting since when)."""
        gate, caller = self._gate, work.caller
        if work.running and work.payload.ended is not None:  # its end must run: nothing to hold back
            work.stalled_since = None
            return False
        if gate is None or caller is None or not gate.stalled(self._host.name, *caller):
            work.stalled_since = None
            return False
        if work.stalled_since is None:
            work.stalled_since = time.perf_counter()
        return True

    def _ready(self, work: Work) -> bool:
        """Whether ``work`` may run now: still wanted, and held back by no full stream."""
        return _wants(work) and not self._stalled(work)

    def _others_wait(self, first: Work) -> bool:
        """Whether a waiting work cannot share ``first``'s pass: waiting for ``first``'s
        company would leave the model idle while that work waits too."""
        joined = self._compatible(first)
        return any(not w.background and w not in joined and self._ready(w) for w in self._queue)

    def _first(self) -> Work | None:
        """The work whose pass runs next: the oldest live work that may run, else the
        oldest such background one; None when every waiting work is held back."""
        background = None
        for work in self._queue:  # a call its caller ended first: its end frees the model's room
            if work.running and work.payload.ended is not None and not work.future.done():
                return work
        for work in self._queue:
            if not _wants(work):
                work.stalled_since = None  # not waiting for a pass: no stall to count
                continue
            if not work.background:
                if not self._stalled(work):
                    return work
            elif background is None and not self._stalled(work):
                background = work
        return background

    def _compatible(self, first: Work) -> list[Work]:
        """The first waiting work and those behind it that may share its pass: equal run and
        key, rows up to max_batch_size, at most one work of a group, and a row total that is
        none of the sizes of the works' inputs' other dimensions (see Work.avoid)."""
        batch = [first]
        if first.key is None or not self._host.batching.enabled:
            return batch
        rows, limit = first.rows, self._host.batching.max_batch_size
        groups = {first.group} - {None}
        for work in list(self._queue):
            if work is first or not _wants(work) or (work.group is not None and work.group in groups):
                continue
            if work.kind == first.kind and work.key == first.key and rows + work.rows <= limit and not self._stalled(work):
                batch.append(work)
                rows += work.rows
                if work.group is not None:
                    groups.add(work.group)
        while len(batch) > 1:
            avoid = frozenset().union(*(w.avoid for w in batch))
            if rows not in avoid:
                break
            rows -= batch.pop().rows
        return batch

    async def _wait_change(self, timeout: float | None) -> None:
        assert self._changed is not None
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def schedule(self, now: float) -> Decision:
        """Which works run together now, or until when nothing runs (see the module
        docstring). Takes nothing out of the queue. Event loop."""
        while self._queue and self._queue[0].future.done():  # cancelled while waiting
            self._queue.popleft()
        if not self._queue or self._held:
            return Decision()
        first = self._first()
        if first is None:  # every waiting call is held back by a full stream: wait for room
            return Decision()
        settings = self._host.batching
        delay = settings.max_batch_delay_ms / 1e3
        expected = min(settings.max_batch_size, self._company)
        if (
            delay > 0 and first.key is not None and not first.background and settings.enabled
            and self._rows_for(first) < expected and not self._others_wait(first)
        ):
            # Company is expected: more callers were seen lately than wait now, and those the
            # last pass answered send again soon. Wait for them, up to the delay counted from
            # when the model became free (or the call arrived), until as many rows wait; not
            # while a work that cannot join waits too (the model would idle in front of it).
            deadline = max(first.queued_at, self._free_since) + delay
            if now < deadline:
                return Decision(wait_until=deadline, waiting_for=first)
            return Decision([w for w in self._compatible(first) if not w.future.done()], short=True)
        return Decision([w for w in self._compatible(first) if not w.future.done()])

    async def _loop(self) -> None:
        """The model's engine loop: schedule, execute, settle (see the module docstring)."""
        loop = asyncio.get_running_loop()
        waited_for: Work | None = None  # the work the last wait for company was for
        while not self._closed:
            if self._last_works > 1 and self._queue and not self._held:
                # Let the calls whose results were just set queue their next work (a Generate call
                # queues its next step as soon as it has its tokens): it joins this pass instead
                # of trailing one pass behind the others for good. (A lone call skips this.) Once
                # every running call of the last pass wants its next step, their pass starts at
                # once, while their streams still send this one's tokens.
                for _ in range(4):
                    if self._went_on_ready():
                        break
                    await asyncio.sleep(0)
            decision = self.schedule(time.perf_counter())
            if not decision.works:
                waited_for = decision.waiting_for
                left = None if decision.wait_until is None else decision.wait_until - time.perf_counter()
                await self._wait_change(left)
                continue
            batch = decision.works
            # Short of the company this loop waited for (not of company a held scheduler, a full
            # stream or a busy model kept it from waiting for).
            short, waited_for = decision.short and waited_for is batch[0], None
            for work in batch:
                self._queue.remove(work)
                work.in_flight = True
            started = time.perf_counter()
            try:
                results = await loop.run_in_executor(self._host._executor, _execute, self._engine, batch)
            except BaseException as exc:  # the executor refused (shutdown) or the run itself broke
                _landed(batch)
                if isinstance(exc, asyncio.CancelledError):
                    self._finish_running(batch)  # after the plan in flight, on the worker thread
                    for work in batch:
                        _fail(work, Unavailable(f"model {self._host.name!r} is shutting down"))
                    raise
                log.exception("a batch on %s failed as a whole", self._host.name)
                # (The executor refusing work means the model shuts down: Unavailable then.)
                self._finish_running(batch, None if self._closed else exc.with_traceback(None))
                # Without its traceback: it holds this loop's own (suspended) frame, and a
                # caller that clears the frames of its failure (errors.release_failure)
                # would finalize this coroutine and stop the model's scheduler for good.
                results = [exc.with_traceback(None)] * len(batch)
            else:
                _landed(batch)
            first = batch[0]
            if not first.background:  # a harvest pass says nothing about the live callers' company
                rows = sum(w.rows for w in batch)
                if short:  # the company did not come: callers left, or they do not send again
                    self._short = SHORT_PASSES
                # The callers recently seen: this pass's, and those already waiting that could
                # have shared it (they came while it ran); only this pass's for a while after a
                # wait ran out (an open-loop stream of calls, whose callers do not send again).
                self._company = rows + (0 if self._short else self._could_have_joined(batch))
                self._short = max(0, self._short - 1)
                self._last_works = len(batch)
            self._free_since = time.perf_counter()
            self._went_on = _settle(batch, results)
            self._requeue(self._went_on)  # running calls that go on: back in the queue
            observe = self._host.observe_batch
            if observe is not None:
                observe(self._host.name, first.kind, len(batch), sum(w.rows for w in batch),
                        [started - w.queued_at for w in batch])
            # Not kept while the loop waits for the next work: a failed call's exception
            # holds the frames (and tensors) of its pass (errors.release_failure).
            del batch, results, first, decision


    def _went_on_ready(self) -> bool:
        """Whether every call of the last pass is a running call that goes on and already
        wants its next step (its stream took this one) or was ended."""
        went_on = self._went_on
        return len(went_on) == self._last_works and all(_wants(w) or w.future.done() for w in went_on)

    def _could_have_joined(self, batch: list[Work]) -> int:
        """Rows of the waiting works that could have shared ``batch``'s pass: same kind and
        key, still wanted, held back by no full stream, of no slots group the pass held,
        within max_batch_size."""
        first = batch[0]
        groups = {w.group for w in batch} - {None}
        room = self._host.batching.max_batch_size - sum(w.rows for w in batch)
        rows = 0
        for work in self._queue:
            if (work.kind != first.kind or work.key != first.key or work.background or not _wants(work)
                    or (work.group is not None and work.group in groups) or self._stalled(work)):
                continue
            if rows + work.rows > room:
                break
            rows += work.rows
            if work.group is not None:
                groups.add(work.group)
        return rows

    def _requeue(self, works: list[Work]) -> None:
        """Puts running calls that go on back in the queue (a method of its own, so that no
        loop variable of _loop keeps the last one, and the failure its future may hold
        later, alive)."""
        if self._closed:
            self._finish_running(works)
            for work in works:
                _fail(work, Unavailable(f"model {self._host.name!r} is shutting down"))
            return
        self._queue.extend(works)


def _own(exc: BaseException) -> BaseException:
    """A copy of ``exc`` for one of the calls that share its failure (without its
    traceback), or ``exc`` itself when it cannot be copied."""
    try:
        mine = copy.copy(exc)
    except Exception:
        return exc
    return mine.with_traceback(None) if isinstance(mine, BaseException) else exc


def _log_finish(future: concurrent.futures.Future[Any]) -> None:
    """The outcome of a plan that only finishes running calls (any thread): cancelled when
    the worker shut down first, its failure logged."""
    if not future.cancelled() and future.exception() is not None:
        log.warning("finishing Generate calls failed: %r", future.exception())


def _fail(work: Work, exc: BaseException) -> None:
    """Ends a work that will not run: its waiter gets ``exc``; a running call's future only
    says it ended (its engine, or _finish_running, told the call why)."""
    if work.future.done():
        return
    if work.running:
        work.future.set_result(None)
    else:
        work.future.set_exception(exc)


def _landed(batch: list[Work]) -> None:
    """The batch is back from the model's thread: its works are no longer in flight, and
    what callers that stopped waiting left to it (``on_finished``) is given back."""
    for work in batch:
        work.in_flight = False
        finished, work.on_finished = work.on_finished, None
        if finished is not None:
            finished()


def _execute(engine: Engine, batch: list[Work]) -> list[Any]:
    """The batch's plan, executed by the engine on the model's worker thread, without the
    works withdrawn while it waited there behind other work."""
    live = [work for work in batch if not work.withdrawn]
    results: list[Any] = [asyncio.CancelledError()] * len(batch)
    if live:
        answers = list(engine.execute(Plan(live[0].kind, [work.payload for work in live])))
        if len(answers) != len(live):  # (StopIteration below would never settle the loop's future)
            raise RuntimeError(f"the engine answered {len(answers)} results for a plan of {len(live)} items")
        outcomes = iter(answers)
        for i, work in enumerate(batch):
            if not work.withdrawn:
                results[i] = next(outcomes)
    return results


def _settle(batch: list[Work], results: list[Any]) -> list[Work]:
    """Hands each work its result or exception (a function of its own, so that no loop
    variable keeps the last one alive); returns the running calls that go on (result
    seam.Running), their key updated."""
    going_on = []
    for work, result in zip(batch, results):
        if work.future.done():
            continue
        if isinstance(result, Running):
            work.key = result.key
            going_on.append(work)
        elif work.running:  # it ended: its engine told the call how (its mailbox)
            if isinstance(result, BaseException):
                work.payload.put(("ended", result))  # (already there if the engine finished it: never read)
            work.future.set_result(None)
        elif isinstance(result, BaseException):
            work.future.set_exception(result)
        else:
            work.future.set_result(result)
    return going_on


async def in_own_thread(fn: Callable[[], None], name: str) -> None:
    """Runs ``fn`` on a daemon thread of its own and waits for it. For waits that may last
    as long as a reader stalls (a call's backlog on a full BLOCK stream): on asyncio's
    shared thread pool a few of them would hold every thread other work needs."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle(exc: BaseException | None) -> None:
        if done.done():  # the waiter gave up (cancelled, timed out)
            return
        if exc is not None:
            done.set_exception(exc)
        else:
            done.set_result(None)

    def target() -> None:
        error: BaseException | None = None
        try:
            fn()
        except BaseException as exc:  # handed to the waiting call
            error = exc
        try:
            loop.call_soon_threadsafe(settle, error)
        except RuntimeError:  # the loop is closed: nobody waits
            pass

    threading.Thread(target=target, name=name, daemon=True).start()
    await done
