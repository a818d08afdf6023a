"""The SDK's event iterators on a real server: HookHandle.events and Subscription.events
end at a call's end marker or after an idle timeout, lose nothing across idle timeouts
and cancelled reads, and end when the subscription is closed while other tasks (one or
two at once) iterate it."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
import torch

import hookwire
from support import LIVENESS, ServerThread, token_batch


async def test_events_end_at_the_calls_marker_or_after_an_idle_timeout(sdk_client: Any) -> None:
    ids, mask = token_batch(3, 7, padded_from=5)
    model = sdk_client.model("tiny-transformer")
    async with model.hook("encoder.layers.*", posthook=hookwire.capture("output")) as hook:
        assert [e async for e in hook.events(timeout=0.05)] == []  # nothing came: it ends
        first = await model.infer(ids, attention_mask=mask)
        second = await model.infer(ids, attention_mask=mask)
        got = [e.request_id async for e in hook.events(until=first)]
        assert got == [first.request_id] * 2
        # An idle timeout ends it once the second call's events are read, and loses nothing.
        later = [e.request_id async for e in hook.events(timeout=0.5)]
        assert later == [second.request_id] * 2
    with pytest.raises(ValueError, match="timeout"):
        hook.events(timeout=0)


async def test_subscription_timeout_keeps_the_read_in_flight(sdk_client: Any, sdk_server: ServerThread) -> None:
    ids, mask = token_batch(3, 7, padded_from=5)
    model = sdk_client.model("tiny-transformer")
    async with hookwire.connect(sdk_server.target) as other:
        async with model.hook("encoder.layers.0", posthook=hookwire.capture("output"), scope="all") as hook:
            async with sdk_client.subscribe([hook.id]) as sub:
                assert [e async for e in sub.events(timeout=0.05)] == []
                call = await other.model("tiny-transformer").infer(ids, attention_mask=mask)
                seen = [e.request_id async for e in sub.events(until=call)]
                assert seen == [call.request_id]



async def test_sessionless_hook_keeps_events_across_idle_timeouts(sdk_client: Any) -> None:
    """Regression guard: HookHandle.events(timeout=) says events that come after a timeout "stay
    queued for the next one"; for a hook without a session (ttl_seconds) every
    events() call opens a new Subscribe and closes it on the timeout, so a call that
    runs between two iterations is lost."""
    ids, mask = token_batch(3, 7)
    model = sdk_client.model("tiny-transformer")
    hook = await model.hook("encoder.layers.0", posthook=hookwire.capture("output"), scope="all", ttl_seconds=300)
    try:
        assert [e async for e in hook.events(timeout=0.2)] == []
        call = await model.infer(ids, attention_mask=mask, use_session=False)
        got = []
        async for event in hook.events(timeout=LIVENESS):
            got.append(event.request_id)
            break  # the one event of the call; waiting for more would wait out the timeout
        assert got == [call.request_id]
    finally:
        await hook.remove()


async def test_subscription_survives_a_cancelled_read(sdk_client: Any, sdk_server: ServerThread) -> None:
    """Regression guard: a read of Subscription.events without a timeout awaits the stream's own
    iterator; cancelling it (a task cancelled, the sync client's Ctrl-C) throws
    CancelledError into stream_items and grpc cancels the RPC, and every later
    iteration ends at once, silently, as if all hooks were removed. The timeout path
    keeps its read in a future (self._next) and survives."""
    ids, mask = token_batch(3, 7)
    model = sdk_client.model("tiny-transformer")
    async with hookwire.connect(sdk_server.target) as other:
        async with model.hook("encoder.layers.0", posthook=hookwire.capture("output"), scope="all") as hook:
            async with sdk_client.subscribe([hook.id]) as sub:
                reader = asyncio.ensure_future(sub.events().__anext__())
                await asyncio.sleep(0.3)  # let it block on the stream (nothing is coming)
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader
                call = await other.model("tiny-transformer").infer(ids, attention_mask=mask)
                seen = [e.request_id async for e in sub.events(until=call, timeout=LIVENESS)]
                assert seen == [call.request_id]



async def test_subscription_closed_while_another_task_iterates_ends_it(sdk_client: Any) -> None:
    """Regression guard (_client.py Subscription.events/aclose): aclose() cancels self._next and sets
    it to None while a reader awaits asyncio.wait((self._next,)); the reader wakes and
    runs ``self._next.result()`` on None: AttributeError instead of a quiet end. The same
    happens through HookHandle.remove() (it aclose()s the handle's subscription) while
    another task or thread iterates hook.events(), and SyncSubscription.close() from
    another thread."""
    model = sdk_client.model("tiny-transformer")
    async with model.hook("encoder.layers.0", posthook=hookwire.capture("output"), scope="all") as hook:
        sub = sdk_client.subscribe([hook.id])
        await sub.start()

        async def read() -> list[Any]:
            return [e async for e in sub.events()]

        reader = asyncio.ensure_future(read())
        await asyncio.sleep(0.3)  # blocked on the stream: nothing is coming
        await sub.aclose()
        assert await asyncio.wait_for(reader, LIVENESS) == []


async def test_two_iterations_of_one_subscription_at_once(sdk_client: Any, sdk_server: ServerThread) -> None:
    """Regression guard (_client.py Subscription.events): two readers share self._next; the first to
    wake takes the item and sets self._next = None (or a new, pending read), and the
    other then calls .result() on None (AttributeError) or on a pending future
    (InvalidStateError). Each event should go to one reader, with no error."""
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(3))
    model = sdk_client.model("tiny-transformer")
    async with hookwire.connect(sdk_server.target) as other:
        async with model.hook("encoder.layers.0", posthook=hookwire.capture("output"), scope="all") as hook:
            async with sdk_client.subscribe([hook.id]) as sub:

                async def read() -> list[str]:
                    return [e.request_id async for e in sub.events(timeout=3.0)]

                readers = [asyncio.ensure_future(read()) for _ in range(2)]
                await asyncio.sleep(0.3)
                call = await other.model("tiny-transformer").infer(ids)
                got = await asyncio.wait_for(asyncio.gather(*readers), LIVENESS)
                assert sorted(got[0] + got[1]) == [call.request_id]
