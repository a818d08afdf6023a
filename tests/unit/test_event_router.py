"""The SDK's EventRouter: a reader waiting with an idle timeout sees a call's end marker
that arrives in the loop turn its wait starts in (it used to clear that wake unseen and
sleep until the timeout)."""

from __future__ import annotations

import asyncio

import pytest

from hookwire._session import CallEnded, EventRouter


async def test_a_marker_routed_as_the_timed_wait_starts_ends_the_iteration() -> None:
    router = EventRouter()
    events = router.events("hk_1", until="req_1", timeout=3600).__aiter__()
    reader = asyncio.ensure_future(events.__anext__())
    await asyncio.sleep(0)  # the reader checks its conditions and starts its timed wait
    router.route(CallEnded("req_1", "m"))  # before that wait's task first runs
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(reader, 120)  # ends in a loop turn; 120 s only guards a hang


async def test_without_a_timeout_too() -> None:
    router = EventRouter()
    events = router.events("hk_1", until="req_1").__aiter__()
    reader = asyncio.ensure_future(events.__anext__())
    await asyncio.sleep(0)
    router.route(CallEnded("req_1", "m"))
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(reader, 120)
