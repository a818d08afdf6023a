"""hookwire_server.wakeups: wake-ups of an event loop from another thread, handed over
together at the end of a ``deferred()`` block."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

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
