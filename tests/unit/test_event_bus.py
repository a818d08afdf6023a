"""hookwire_server.hooks.event_bus: the bounded buffer between hook threads and a stream."""

from __future__ import annotations

import asyncio
import collections
import threading

import pytest

from hookwire.v1 import hook_service_pb2
from hookwire_server import errors, wakeups
from hookwire_server.hooks import event_bus
from hookwire_server.hooks.event_bus import DeliveryLimits, EventStream
from support import until

TIMEOUT = 60.0  # hang guard for anything that should happen "soon" (generous: a loaded machine is slow)
SETTLE = 0.15  # how long to wait before concluding that a thread is blocked


def event(hook_id: str, tag: str = "") -> hook_service_pb2.SessionMessage:
    msg = hook_service_pb2.SessionMessage()
    msg.event.hook_id = hook_id
    msg.event.request_id = tag
    return msg


def notice(text: str) -> hook_service_pb2.SessionMessage:
    msg = hook_service_pb2.SessionMessage()
    msg.notice.kind = hook_service_pb2.NOTICE_KIND_HOOK_REMOVED
    msg.notice.message = text
    return msg


def make_stream(
    max_events: int = event_bus.DEFAULT_MAX_EVENTS, max_bytes: int = event_bus.DEFAULT_MAX_BYTES,
    policy: int = event_bus.BLOCK,
):
    return EventStream(asyncio.get_running_loop(), DeliveryLimits(policy=policy, max_events=max_events, max_bytes=max_bytes))


class Producer(threading.Thread):
    """A plain thread putting events, recording each put_event result as it returns."""

    def __init__(self, stream: EventStream, items: list[tuple[str, int]], tag: str = "") -> None:
        super().__init__(daemon=True)
        self.stream = stream
        self.items = items
        self.tag = tag
        self.results: list[bool] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for i, (hook_id, nbytes) in enumerate(self.items):
                self.results.append(self.stream.put_event(event(hook_id, f"{self.tag}{i}"), hook_id, nbytes))
        except BaseException as exc:  # pragma: no cover - reported by the test
            self.error = exc


async def get(stream: EventStream):
    return await asyncio.wait_for(stream.get(), TIMEOUT)


async def join(thread: threading.Thread, timeout: float = TIMEOUT) -> None:
    """Joins without blocking the loop; fails if the thread does not end in time."""
    await asyncio.to_thread(thread.join, timeout)
    assert not thread.is_alive(), "producer thread did not finish"


async def assert_stays_blocked(producer: Producer, done: int) -> None:
    """The producer has finished exactly ``done`` puts and is still waiting."""
    await asyncio.sleep(SETTLE)
    assert producer.is_alive()
    assert len(producer.results) == done


# --------------------------------------------------------------------------- producers and consumer


async def test_threads_produce_while_consumer_awaits():
    stream = make_stream(max_events=4)
    hooks = ["h-a", "h-b", "h-c"]
    per_thread = 200
    # Two threads per hook, so the numbering of one hook is shared between threads.
    producers = [Producer(stream, [(h, 10)] * per_thread, tag=f"{h}/{n}/") for h in hooks for n in range(2)]
    for p in producers:
        p.start()
    seqs: dict[str, list[int]] = collections.defaultdict(list)
    tags_seen = set()
    for _ in range(len(producers) * per_thread):
        msg = await get(stream)
        assert msg is not None
        assert msg.WhichOneof("kind") == "event"
        seqs[msg.event.hook_id].append(msg.event.seq)
        tags_seen.add(msg.event.request_id)
        assert stream.occupancy()[0] <= 4
    for p in producers:
        await join(p)
        assert p.error is None
        assert p.results == [True] * per_thread
    assert len(tags_seen) == len(producers) * per_thread  # nothing lost or duplicated
    for h in hooks:
        # In arrival order, contiguous from 1; each hook numbered on its own.
        assert seqs[h] == list(range(1, 2 * per_thread + 1)), h
    assert stream.occupancy() == (0, 0)


async def test_seq_is_per_hook_and_contiguous_from_one():
    stream = make_stream()
    order = ["x", "y", "x", "z", "x", "y"]
    for h in order:
        assert stream.put_event(event(h), h, 0)
    got = [await get(stream) for _ in order]
    assert [(m.event.hook_id, m.event.seq) for m in got] == [
        ("x", 1),
        ("y", 1),
        ("x", 2),
        ("z", 1),
        ("x", 3),
        ("y", 2),
    ]


async def test_streams_number_independently():
    a, b = make_stream(), make_stream()
    for _ in range(3):
        a.put_event(event("h"), "h", 0)
    b.put_event(event("h"), "h", 0)
    assert [(await get(a)).event.seq for _ in range(3)] == [1, 2, 3]
    assert (await get(b)).event.seq == 1


async def test_get_waits_for_a_producer_thread():
    stream = make_stream()
    waiter = asyncio.ensure_future(stream.get())
    await asyncio.sleep(0.05)
    assert not waiter.done()
    producer = Producer(stream, [("h", 1)])
    producer.start()
    msg = await asyncio.wait_for(waiter, TIMEOUT)
    assert msg.event.hook_id == "h"
    assert msg.event.seq == 1
    await join(producer)


async def test_get_after_queue_drained_waits_again():
    stream = make_stream()
    stream.put_event(event("h"), "h", 0)
    assert (await get(stream)).event.seq == 1
    waiter = asyncio.ensure_future(stream.get())
    await asyncio.sleep(0.05)
    assert not waiter.done()
    threading.Thread(target=stream.put_event, args=(event("h"), "h", 0), daemon=True).start()
    assert (await asyncio.wait_for(waiter, TIMEOUT)).event.seq == 2


# --------------------------------------------------------------------------- BLOCK


async def test_block_policy_producer_waits_when_full_and_resumes_on_read():
    stream = make_stream(max_events=2)
    producer = Producer(stream, [("h", 0)] * 5)
    producer.start()
    await until(lambda: len(producer.results) == 2, "the producer moves on")
    await assert_stays_blocked(producer, 2)
    assert stream.occupancy()[0] == 2

    first = await get(stream)
    assert first.event.seq == 1
    await until(lambda: len(producer.results) == 3, "the producer moves on")
    await assert_stays_blocked(producer, 3)
    assert stream.occupancy()[0] == 2

    rest = [await get(stream) for _ in range(4)]
    await join(producer)
    assert producer.results == [True] * 5
    assert [m.event.seq for m in rest] == [2, 3, 4, 5]
    assert stream.occupancy() == (0, 0)


async def test_block_on_bytes():
    stream = make_stream(max_events=100, max_bytes=100)
    producer = Producer(stream, [("h", 60), ("h", 60), ("h", 40)])
    producer.start()
    await until(lambda: len(producer.results) == 1, "the producer moves on")
    # 60 + 60 > 100: the second event waits.
    await assert_stays_blocked(producer, 1)
    assert stream.occupancy() == (1, 60)
    assert (await get(stream)).event.seq == 1
    # Then 60 + 40 <= 100: both fit.
    await join(producer)
    assert stream.occupancy() == (2, 100)
    assert [(await get(stream)).event.seq for _ in range(2)] == [2, 3]
    assert stream.occupancy() == (0, 0)


async def test_event_larger_than_max_bytes_goes_through_alone():
    stream = make_stream(max_events=100, max_bytes=100)
    # Into an empty buffer it goes at once, without blocking.
    producer = Producer(stream, [("big", 1000), ("small", 1)])
    producer.start()
    await until(lambda: len(producer.results) == 1, "the producer moves on")
    assert producer.results == [True]
    assert stream.occupancy() == (1, 1000)
    # Nothing else joins it while it is buffered.
    await assert_stays_blocked(producer, 1)
    assert (await get(stream)).event.hook_id == "big"
    await join(producer)
    assert (await get(stream)).event.hook_id == "small"


async def test_big_event_waits_for_buffer_to_empty():
    stream = make_stream(max_events=100, max_bytes=100)
    assert stream.put_event(event("s"), "s", 10)
    producer = Producer(stream, [("big", 500)])
    producer.start()
    await assert_stays_blocked(producer, 0)
    assert (await get(stream)).event.hook_id == "s"
    await join(producer)
    assert producer.results == [True]
    assert (await get(stream)).event.hook_id == "big"


async def test_many_blocked_producers_all_resume():
    stream = make_stream(max_events=1)
    producers = [Producer(stream, [(f"h{i}", 0)] * 3) for i in range(4)]
    for p in producers:
        p.start()
    got = [await get(stream) for _ in range(12)]
    for p in producers:
        await join(p)
        assert p.results == [True] * 3
    per_hook = collections.defaultdict(list)
    for m in got:
        per_hook[m.event.hook_id].append(m.event.seq)
    assert dict(per_hook) == {f"h{i}": [1, 2, 3] for i in range(4)}


# --------------------------------------------------------------------------- close / end


async def test_close_releases_blocked_producer():
    stream = make_stream(max_events=1)
    producer = Producer(stream, [("h", 0)] * 3)
    producer.start()
    await until(lambda: len(producer.results) == 1, "the producer moves on")
    await assert_stays_blocked(producer, 1)
    stream.close()
    await join(producer)
    assert producer.results == [True, False, False]
    assert stream.closed
    # Queued events are dropped; get() answers None, every time.
    assert await get(stream) is None
    assert await get(stream) is None
    assert stream.occupancy() == (0, 0)


async def test_close_from_another_thread_wakes_waiting_get():
    stream = make_stream()
    waiter = asyncio.ensure_future(stream.get())
    await asyncio.sleep(0.05)
    assert not waiter.done()
    closer = threading.Thread(target=stream.close, daemon=True)
    closer.start()
    assert await asyncio.wait_for(waiter, TIMEOUT) is None
    await join(closer)


async def test_after_close_puts_are_refused():
    stream = make_stream()
    stream.close()
    stream.close()  # idempotent
    msg = event("h")
    assert stream.put_event(msg, "h", 10) is False
    assert msg.event.seq == 0  # not numbered
    stream.put_notice(notice("late"))
    assert stream.occupancy() == (0, 0)
    assert await get(stream) is None


async def test_end_drains_then_returns_none():
    stream = make_stream()
    for _ in range(3):
        assert stream.put_event(event("h"), "h", 5)
    stream.put_notice(notice("bye"))
    stream.end()
    assert not stream.closed
    assert stream.put_event(event("h"), "h", 5) is False
    stream.put_notice(notice("ignored"))
    got = [await get(stream) for _ in range(4)]
    assert [m.event.seq for m in got[:3]] == [1, 2, 3]
    assert got[3].notice.message == "bye"
    assert await get(stream) is None
    assert await get(stream) is None


async def test_end_releases_blocked_producer():
    stream = make_stream(max_events=1)
    producer = Producer(stream, [("h", 0)] * 2)
    producer.start()
    await until(lambda: len(producer.results) == 1, "the producer moves on")
    await assert_stays_blocked(producer, 1)
    stream.end()
    await join(producer)
    assert producer.results == [True, False]
    # The event queued before end() is still delivered.
    assert (await get(stream)).event.seq == 1
    assert await get(stream) is None


async def test_end_from_another_thread_wakes_waiting_get():
    stream = make_stream()
    waiter = asyncio.ensure_future(stream.get())
    await asyncio.sleep(0.05)
    threading.Thread(target=stream.end, daemon=True).start()
    assert await asyncio.wait_for(waiter, TIMEOUT) is None


def test_close_after_loop_closed_does_not_raise():
    loop = asyncio.new_event_loop()
    stream = EventStream(loop, DeliveryLimits())
    loop.close()
    stream.close()
    stream.end()
    assert stream.closed


# --------------------------------------------------------------------------- notices


async def test_put_notice_never_blocks():
    stream = make_stream(max_events=1, max_bytes=1)
    assert stream.put_event(event("h"), "h", 1)  # full on both counts

    def put_notices():
        for i in range(50):
            stream.put_notice(notice(f"n{i}"))

    t = threading.Thread(target=put_notices, daemon=True)
    t.start()
    await join(t)
    assert stream.occupancy() == (1, 1)  # notices are not events and take no budget
    first = await get(stream)
    assert first.WhichOneof("kind") == "event"
    got = [await get(stream) for _ in range(50)]
    assert [m.notice.message for m in got] == [f"n{i}" for i in range(50)]
    assert all(m.WhichOneof("kind") == "notice" for m in got)


async def test_notice_wakes_waiting_get():
    stream = make_stream()
    waiter = asyncio.ensure_future(stream.get())
    await asyncio.sleep(0.05)
    threading.Thread(target=stream.put_notice, args=(notice("hi"),), daemon=True).start()
    msg = await asyncio.wait_for(waiter, TIMEOUT)
    assert msg.notice.message == "hi"


async def test_notices_do_not_consume_seq_numbers():
    stream = make_stream()
    stream.put_event(event("h"), "h", 0)
    stream.put_notice(notice("n"))
    stream.put_event(event("h"), "h", 0)
    got = [await get(stream) for _ in range(3)]
    assert got[0].event.seq == 1
    assert got[1].WhichOneof("kind") == "notice"
    assert got[2].event.seq == 2


# --------------------------------------------------------------------------- DeliveryLimits


def test_limits_zero_fields_take_defaults():
    limits = DeliveryLimits.from_proto(hook_service_pb2.DeliveryOptions())
    assert limits == DeliveryLimits()
    assert limits.policy == hook_service_pb2.DELIVERY_POLICY_UNSPECIFIED
    assert limits.max_events == event_bus.DEFAULT_MAX_EVENTS
    assert limits.max_bytes == event_bus.DEFAULT_MAX_BYTES


def test_limits_explicit_values_kept():
    msg = hook_service_pb2.DeliveryOptions(
        policy=hook_service_pb2.DELIVERY_POLICY_BLOCK, max_events=7, max_bytes=12345
    )
    assert DeliveryLimits.from_proto(msg) == DeliveryLimits(
        policy=hook_service_pb2.DELIVERY_POLICY_BLOCK, max_events=7, max_bytes=12345
    )
    partial = DeliveryLimits.from_proto(hook_service_pb2.DeliveryOptions(max_events=3))
    assert partial.max_events == 3
    assert partial.max_bytes == event_bus.DEFAULT_MAX_BYTES


def test_limits_at_the_limit_are_accepted():
    msg = hook_service_pb2.DeliveryOptions(
        max_events=event_bus.LIMIT_MAX_EVENTS, max_bytes=event_bus.LIMIT_MAX_BYTES
    )
    limits = DeliveryLimits.from_proto(msg)
    assert limits.max_events == event_bus.LIMIT_MAX_EVENTS
    assert limits.max_bytes == event_bus.LIMIT_MAX_BYTES


@pytest.mark.parametrize(
    "fields,field_name",
    [
        ({"max_events": event_bus.LIMIT_MAX_EVENTS + 1}, "max_events"),
        ({"max_events": 2**32 - 1}, "max_events"),
        ({"max_bytes": event_bus.LIMIT_MAX_BYTES + 1}, "max_bytes"),
        ({"max_bytes": 2**64 - 1}, "max_bytes"),
        ({"policy": 7}, "policy"),
    ],
)
def test_limits_out_of_range_raise_invalid_argument(fields, field_name):
    with pytest.raises(errors.InvalidArgument, match=field_name):
        DeliveryLimits.from_proto(hook_service_pb2.DeliveryOptions(**fields))


def test_invalid_argument_is_a_server_error():
    assert issubclass(errors.InvalidArgument, errors.HookwireServerError)


def test_limits_are_frozen():
    limits = DeliveryLimits()
    with pytest.raises(Exception):
        limits.max_events = 1  # type: ignore[misc]


async def _sent(stream: EventStream, n_messages: int) -> list[hook_service_pb2.SessionMessage]:
    out = []
    it = stream.messages()
    for _ in range(n_messages):
        out.append(await asyncio.wait_for(it.__anext__(), TIMEOUT))
    return out


async def test_waiting_small_events_go_out_as_one_batch_in_order() -> None:
    stream = make_stream()
    for i in range(5):
        stream.put_event(event("h", f"r{i}"), "h", 100)
    (msg,) = await _sent(stream, 1)
    assert msg.WhichOneof("kind") == "batch"
    assert [(e.request_id, e.seq) for e in msg.batch.events] == [(f"r{i}", i + 1) for i in range(5)]
    assert stream.occupancy() == (0, 0)


async def test_a_lone_event_is_not_wrapped_in_a_batch() -> None:
    stream = make_stream()
    stream.put_event(event("h"), "h", 10)
    (msg,) = await _sent(stream, 1)
    assert msg.WhichOneof("kind") == "event"


async def test_large_events_and_notices_split_batches_and_keep_their_place() -> None:
    stream = make_stream()
    big = event_bus.BATCH_EVENT_MAX_BYTES + 1
    stream.put_event(event("h", "a"), "h", 10)
    stream.put_event(event("h", "b"), "h", 10)
    stream.put_notice(notice("n"))
    stream.put_event(event("h", "c"), "h", 10)
    stream.put_event(event("h", "big"), "h", big, wire=big)
    stream.put_event(event("h", "d"), "h", 10)
    msgs = await _sent(stream, 5)
    shape = [
        (m.WhichOneof("kind"), [e.request_id for e in m.batch.events] if m.HasField("batch") else m.event.request_id or m.notice.message)
        for m in msgs
    ]
    assert shape == [("batch", ["a", "b"]), ("notice", "n"), ("event", "c"), ("event", "big"), ("event", "d")]


async def test_batches_respect_the_byte_and_count_caps() -> None:
    stream = make_stream(max_events=10_000)
    n = event_bus.BATCH_MAX_EVENTS + 10
    for _ in range(n):
        stream.put_event(event("h"), "h", 1)
    first, second = await _sent(stream, 2)
    assert len(first.batch.events) == event_bus.BATCH_MAX_EVENTS
    assert len(second.batch.events) == 10
    per = event_bus.BATCH_EVENT_MAX_BYTES
    for _ in range(40):
        stream.put_event(event("h"), "h", per, wire=per)
    msg = (await _sent(stream, 1))[0]
    assert len(msg.batch.events) * per <= event_bus.BATCH_MAX_BYTES
    assert len(msg.batch.events) == event_bus.BATCH_MAX_BYTES // per


async def test_messages_end_when_the_stream_ends() -> None:
    stream = make_stream()
    stream.put_event(event("h"), "h", 1)
    stream.end()
    assert [m async for m in stream.messages()][0].event.seq == 1


# --------------------------------------------------------------------------- drop policies


async def test_drop_newest_counts_exactly_and_leaves_seq_gaps() -> None:
    stream = make_stream(max_events=3, policy=event_bus.DROP_NEWEST)
    counters = event_bus.HookCounters()
    results = [stream.put_event(event("h", f"r{i}"), "h", 1, counters=counters) for i in range(10)]
    assert results == [True] * 3 + [False] * 7
    assert stream.dropped == 7 and counters.events_dropped == 7 and counters.events_sent == 3
    msgs = [await get(stream) for _ in range(4)]
    assert [m.WhichOneof("kind") for m in msgs] == ["event", "event", "event", "notice"]
    assert [m.event.seq for m in msgs[:3]] == [1, 2, 3]
    assert msgs[3].notice.kind == hook_service_pb2.NOTICE_KIND_DROPS_STARTED and msgs[3].notice.dropped == 1
    assert stream.put_event(event("h", "after"), "h", 1, counters=counters)
    ended, after = await get(stream), await get(stream)
    assert ended.notice.kind == hook_service_pb2.NOTICE_KIND_DROPS_ENDED and ended.notice.dropped == 7
    assert after.event.seq == 11 and after.event.dropped == 7  # seq 4..10 were dropped


async def test_drop_oldest_keeps_the_newest_and_counts_per_hook() -> None:
    stream = make_stream(max_events=2, policy=event_bus.DROP_OLDEST)
    a, b = event_bus.HookCounters(), event_bus.HookCounters()
    for i in range(6):
        hook, counters = ("a", a) if i % 2 == 0 else ("b", b)
        assert stream.put_event(event(hook, f"r{i}"), hook, 1, counters=counters)
    assert stream.dropped == 4
    assert (a.events_sent, a.events_dropped, b.events_sent, b.events_dropped) == (1, 2, 1, 2)
    msgs = [await get(stream) for _ in range(3)]
    kinds = [m.WhichOneof("kind") for m in msgs]
    assert kinds == ["notice", "event", "event"]  # one DROPS_STARTED for the whole run of drops
    assert [m.event.request_id for m in msgs[1:]] == ["r4", "r5"]
    # r0..r3 were all dropped, and all were numbered before r4 and r5.
    assert [m.event.dropped for m in msgs[1:]] == [4, 4]
    assert stream.put_event(event("a", "calm"), "a", 1, counters=a)  # room again: the run ends
    ended, calm = await get(stream), await get(stream)
    assert ended.notice.kind == hook_service_pb2.NOTICE_KIND_DROPS_ENDED and calm.event.request_id == "calm"


async def test_default_policy_blocks_only_the_owners_calls() -> None:
    stream = EventStream(asyncio.get_running_loop(), DeliveryLimits(max_events=1), owner_session_id="ses_me")
    assert stream.blocks_for("ses_me") and not stream.blocks_for("ses_other") and not stream.blocks_for("")
    assert stream.put_event(event("h"), "h", 1, session_id="ses_other")
    assert stream.put_event(event("h"), "h", 1, session_id="ses_other")  # evicts the first: never waits
    assert stream.dropped == 1
    producer = Producer(stream, [])
    blocked = threading.Thread(target=lambda: stream.put_event(event("h"), "h", 1, session_id="ses_me"), daemon=True)
    blocked.start()
    await asyncio.sleep(SETTLE)
    assert blocked.is_alive(), "the owner's own call waits for space"
    assert (await get(stream)).WhichOneof("kind") == "notice"  # DROPS_STARTED
    assert (await get(stream)).WhichOneof("kind") == "event"
    await join(blocked)
    del producer


async def test_drop_policy_memory_is_bounded_by_bytes() -> None:
    stream = make_stream(max_events=1000, max_bytes=1000, policy=event_bus.DROP_OLDEST)
    for i in range(500):
        stream.put_event(event("h"), "h", 100)
        assert stream.occupancy()[1] <= 1000
    assert stream.occupancy() == (10, 1000)
    assert stream.dropped == 490


async def test_batches_are_sized_by_serialized_bytes_not_tensor_bytes() -> None:
    stream = make_stream()
    for i in range(40):  # no tensor bytes, but 60 KB of message each (e.g. histograms)
        stream.put_event(event("h", f"r{i}"), "h", 0, wire=60_000)
    first = (await _sent(stream, 1))[0]
    assert 0 < len(first.batch.events) <= event_bus.BATCH_MAX_BYTES // 60_000


async def test_an_event_larger_than_the_message_limit_is_dropped_with_a_notice() -> None:
    stream = make_stream()
    counters = event_bus.HookCounters()
    assert not stream.put_event(event("h"), "h", 0, wire=event_bus.DEFAULT_MAX_MESSAGE_BYTES, counters=counters)
    assert stream.put_event(event("h"), "h", 0, counters=counters)
    notice, ok = await get(stream), await get(stream)
    assert notice.notice.kind == hook_service_pb2.NOTICE_KIND_CAPTURE_FAILED and "max_message_bytes" in notice.notice.message
    assert ok.event.seq == 2 and ok.event.dropped == 1 and counters.events_dropped == 1


async def test_default_policy_never_evicts_the_owners_own_events() -> None:
    stream = EventStream(asyncio.get_running_loop(), DeliveryLimits(max_events=2), owner_session_id="ses_me")
    assert stream.put_event(event("mine", "m1"), "mine", 1, session_id="ses_me")
    assert stream.put_event(event("mine", "m2"), "mine", 1, session_id="ses_me")
    assert not stream.put_event(event("all", "o1"), "all", 1, session_id="ses_other")  # nothing evictable
    msgs = [await get(stream) for _ in range(3)]
    assert [m.event.request_id for m in msgs if m.WhichOneof("kind") == "event"] == ["m1", "m2"]


async def test_a_blocked_producer_gives_up_when_cancelled() -> None:
    stream = make_stream(max_events=1)
    assert stream.put_event(event("h"), "h", 1)
    removed = threading.Event()
    results = []
    t = threading.Thread(target=lambda: results.append(
        stream.put_event(event("h"), "h", 1, cancelled=removed.is_set)), daemon=True)
    t.start()
    await asyncio.sleep(SETTLE)
    assert t.is_alive()
    removed.set()
    stream.wake_producers()
    await join(t)
    assert results == [False]


@pytest.mark.parametrize("policy", ["auto", "block_for_owner", "drop_oldest", "drop_newest"])
async def test_dropped_is_the_number_of_missing_seqs_before_every_delivered_event(policy: str) -> None:
    """Random mixes of puts (own and others' calls, three hooks) and reads: every event read
    says exactly how many events numbered before it on this stream were dropped, including
    evictions in front of it while it waited and none of the drops behind it."""
    import random

    limits = {
        "auto": DeliveryLimits(max_events=4),
        "block_for_owner": DeliveryLimits(policy=event_bus.BLOCK, max_events=4),
        "drop_oldest": DeliveryLimits(policy=event_bus.DROP_OLDEST, max_events=4),
        "drop_newest": DeliveryLimits(policy=event_bus.DROP_NEWEST, max_events=4),
    }[policy]
    for seed in range(20):
        rng = random.Random(seed)
        stream = EventStream(asyncio.get_running_loop(), limits, owner_session_id="ses_me", owner="alice",
                             blocks_others=False)
        numbered: list[str] = []  # every event given a seq, in numbering order
        received: list[hook_service_pb2.InterceptEvent] = []
        for i in range(300):
            if rng.random() < 0.35 and stream.occupancy()[0]:
                msg = await get(stream)
                if msg.WhichOneof("kind") == "event":
                    received.append(msg.event)
                continue
            own = rng.random() < 0.4
            if own and stream.blocks_for("ses_me", "alice") and stream.occupancy()[0] >= limits.max_events:
                continue  # it would wait for space (single-threaded test)
            name, hook = f"e{i}", rng.choice("abc")
            stream.put_event(event(hook, name), hook, 1,
                             session_id="ses_me" if own else "ses_other", principal="alice" if own else "bob")
            numbered.append(name)
        stream.end()
        while (msg := await get(stream)) is not None:
            if msg.WhichOneof("kind") == "event":
                received.append(msg.event)
        delivered = {e.request_id for e in received}
        assert len(delivered) < len(numbered), "nothing was dropped: the case proves nothing"
        for e in received:
            before = numbered[:numbered.index(e.request_id)]
            assert e.dropped == sum(1 for name in before if name not in delivered), (seed, e.request_id)
        assert received[-1].dropped <= stream.dropped


async def test_block_holds_its_owners_calls_and_only_an_operators_stream_holds_everyones() -> None:
    loop = asyncio.get_running_loop()
    block = DeliveryLimits(policy=event_bus.BLOCK, max_events=1)
    users = EventStream(loop, block, owner="alice", blocks_others=False)  # a user's subscription: no session
    assert users.blocks_for("", "alice") and users.blocks_for("ses_any", "alice")
    assert not users.blocks_for("", "bob") and not users.blocks_for("ses_any", "")
    operators = EventStream(loop, block, owner="root", blocks_others=True)
    assert operators.blocks_for("", "bob") and operators.blocks_for("", "")
    session = EventStream(loop, block, owner_session_id="ses_me", owner="alice", blocks_others=False)
    assert session.blocks_for("ses_me") and session.blocks_for("", "alice") and not session.blocks_for("ses_b", "bob")
    auto = EventStream(loop, DeliveryLimits(max_events=1), owner="alice", blocks_others=True)
    assert not auto.blocks_for("", "alice")  # UNSPECIFIED blocks for the stream's own session only
    # alice's own call waits on her own full BLOCK subscription instead of dropping.
    assert users.put_event(event("h"), "h", 1, principal="alice")
    waiter = threading.Thread(target=lambda: users.put_event(event("h"), "h", 1, principal="alice"), daemon=True)
    waiter.start()
    await until(lambda: users.waiting_producers == 1, "a producer waits for room")
    assert users.dropped == 0
    assert (await get(users)).event.seq == 1
    await join(waiter)
    assert users.waiting_producers == 0 and (await get(users)).event.seq == 2 and users.dropped == 0


# --------------------------------------------------------------------------- wake-ups handed over together


class DeferredProducer(Producer):
    """A Producer inside wakeups.deferred(events=...) (``events``: as vLLM's link thread
    ends a step; without: as the torch engine runs a plan), holding the block open until
    ``go`` is set."""

    def __init__(self, stream: EventStream, items: list[tuple[str, int]], events: bool = True) -> None:
        super().__init__(stream, items)
        self.go = threading.Event()
        self.events = events

    def run(self) -> None:
        with wakeups.deferred(events=self.events):
            super().run()
            self.go.wait(TIMEOUT)


async def test_a_producer_under_deferred_events_wakes_the_stream_once_after_its_last_event() -> None:
    stream = make_stream()
    consumer = asyncio.ensure_future(stream.messages().__anext__())
    for _ in range(3):  # the consumer runs until it waits for its first event (one step)
        await asyncio.sleep(0)
    producer = DeferredProducer(stream, [("h", 10)] * 5)
    producer.start()
    await until(lambda: len(producer.results) == 5, "the producer puts its events")
    await asyncio.sleep(SETTLE)
    assert not consumer.done()  # not woken yet: the wake-ups wait for the block's end
    producer.go.set()
    msg = await asyncio.wait_for(consumer, TIMEOUT)
    await join(producer)
    assert msg.WhichOneof("kind") == "batch" and [e.seq for e in msg.batch.events] == [1, 2, 3, 4, 5]


async def test_a_plan_deferring_its_mailboxes_still_streams_its_events_as_they_come() -> None:
    """The torch engine runs a plan's passes inside deferred(): a pass's events (large
    chunked captures above all) go out while it runs."""
    stream = make_stream()
    producer = DeferredProducer(stream, [("h", 10)], events=False)
    producer.start()
    try:
        first = await get(stream)  # woken inside the still open block
        assert first.event.seq == 1 and producer.is_alive()
    finally:
        producer.go.set()
    await join(producer)


async def test_a_blocked_producer_under_deferred_wakes_the_stream_before_it_waits() -> None:
    """Without the flush the consumer, which makes the room, would never be woken."""
    stream = make_stream(max_events=2)
    producer = DeferredProducer(stream, [("h", 0)] * 7)
    producer.go.set()
    producer.start()
    got = [await get(stream) for _ in range(7)]
    await join(producer)
    assert producer.error is None and producer.results == [True] * 7
    assert [m.event.seq for m in got] == list(range(1, 8))
