"""hookwire_server.wakeups: wake-ups of an event loop from another thread, handed over
together at the end of a ``deferred()`` block."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from hookwire_server import wakeups


def _in_thread(fn: Callable[[], None]) -> None:
    """Runs ``fn`` on a thread of its own; what it raised is raised here."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    assert not t.is_alive()
    if errors:
        raise errors[0]


async def test_deferred_wake_ups_run_in_order_once_the_outermost_block_ends() -> None:
    loop = asyncio.get_running_loop()
    ran: list[str] = []
    seen: dict[str, list[str]] = {}
    handed = asyncio.Event()

    def producer() -> None:
        with wakeups.deferred():
            wakeups.call_soon(loop, lambda: ran.append("a"))
            with wakeups.deferred():  # nested: handed over with the outer block
                wakeups.call_soon(loop, lambda: ran.append("b"))
            wakeups.call_soon(loop, lambda: ran.append("c"))
            seen["inside"] = list(ran)
        wakeups.call_soon(loop, lambda: (ran.append("d"), handed.set()))  # outside a block: at once

    await asyncio.to_thread(producer)
    await asyncio.wait_for(handed.wait(), 60)
    assert seen["inside"] == [] and ran == ["a", "b", "c", "d"]


async def test_flush_hands_over_what_was_collected_and_the_block_goes_on_collecting() -> None:
    loop = asyncio.get_running_loop()
    ran: list[int] = []
    first = threading.Event()
    done = asyncio.Event()

    def producer() -> None:
        with wakeups.deferred():
            wakeups.call_soon(loop, lambda: (ran.append(1), first.set()))
            wakeups.flush()
            assert first.wait(60)  # the loop ran it while the block is still open
            wakeups.call_soon(loop, lambda: (ran.append(2), done.set()))
            wakeups.flush()
            wakeups.flush()  # nothing left: nothing runs twice

    await asyncio.to_thread(producer)
    await asyncio.wait_for(done.wait(), 60)
    await asyncio.sleep(0)
    assert ran == [1, 2]


def test_a_deferred_wake_up_of_a_closed_loop_is_dropped() -> None:
    loop = asyncio.new_event_loop()
    loop.close()

    def producer() -> None:
        with wakeups.deferred():
            wakeups.call_soon(loop, lambda: None)

    _in_thread(producer)  # no RuntimeError out of the block
    wakeups.flush()  # outside a block: nothing


class _CountingLoop:
    """What wakeups needs of a loop: ``call_soon_threadsafe``, each call recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[Callable[..., object], tuple[object, ...]]] = []

    def call_soon_threadsafe(self, fn: Callable[..., object], *args: object) -> None:
        self.calls.append((fn, args))

    def run(self) -> None:
        calls, self.calls = self.calls, []
        for fn, args in calls:
            fn(*args)


def test_each_loop_is_woken_once_per_block_and_event_streams_only_where_the_block_says() -> None:
    a, b = _CountingLoop(), _CountingLoop()
    ran: list[str] = []
    with wakeups.deferred():  # as the torch engine's plans: mailboxes held, event streams at once
        for n in range(3):
            wakeups.call_soon(a, lambda n=n: ran.append(f"a{n}"))
        wakeups.call_soon(b, lambda: ran.append("b"))
        wakeups.call_soon(a, lambda: ran.append("event"), event=True)
        assert (len(a.calls), len(b.calls)) == (1, 0)  # the event's wake-up went at once
    assert (len(a.calls), len(b.calls)) == (2, 1)
    a.run()
    b.run()
    assert ran == ["event", "a0", "a1", "a2", "b"]
    ran.clear()
    with wakeups.deferred(events=True):  # as vLLM's link thread ending a step
        for n in range(3):
            wakeups.call_soon(a, lambda n=n: ran.append(f"e{n}"), event=True)
        with wakeups.deferred():  # nested: the outer block's choice holds
            wakeups.call_soon(a, lambda: ran.append("inner"), event=True)
        assert a.calls == []
    assert len(a.calls) == 1
    a.run()
    assert ran == ["e0", "e1", "e2", "inner"]


def test_a_wake_up_that_fails_does_not_keep_the_others_asleep(caplog: pytest.LogCaptureFixture) -> None:
    a = _CountingLoop()
    ran: list[int] = []
    with wakeups.deferred():
        wakeups.call_soon(a, lambda: ran.append(1))
        wakeups.call_soon(a, lambda: 1 / 0)
        wakeups.call_soon(a, lambda: ran.append(3))
    a.run()
    assert ran == [1, 3] and "a wake-up failed" in caplog.text
