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


async def test_a_block_stream_that_stops_reading_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    """Regression guard (issue 34 review): under "block" the SDK stops reading at its bound, so
    a session whose calls are awaited before their events are read hung without a word once the
    unread events outgrew the SDK's buffer and the server's. It logs a warning naming the fix."""
    from hookwire.v1 import hook_pb2

    router = EventRouter(policy="block", max_events=2)
    for _ in range(2):
        router.route((hook_pb2.InterceptEvent(hook_id="hk_1"), None))
    with caplog.at_level("WARNING", logger="hookwire"):
        for _ in range(2):
            with pytest.raises(TimeoutError):  # it waits for a reader (the warning comes first)
                await asyncio.wait_for(router.room(), 0.01)
    warnings = [r.getMessage() for r in caplog.records if r.name == "hookwire"]
    assert len(warnings) == 1 and "stops reading until they are read" in warnings[0], warnings
    assert "session_max_events" in warnings[0]
