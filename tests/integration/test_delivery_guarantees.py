"""Delivery promises held exactly: BLOCK by ownership, `dropped` per received event,
one copy of rule operands (and ListHooks without their data), consistent default budgets."""

from __future__ import annotations

import asyncio
import ctypes
import gc
from typing import Any, Iterator

import grpc
import pytest
import torch

import hookwire
from hookwire.wire import codec
from hookwire.v1 import hook_pb2, hook_service_pb2, hook_service_pb2_grpc, model_service_pb2, model_service_pb2_grpc
from hookwire_server import ServerSettings
from hookwire_server.auth import ANONYMOUS, hash_token
from support import LIVENESS, ServerThread, bearer, build_test_registry, serving, slow_reader_channel, until

TOKENS = {name: f"hwt_delivery_{name}" for name in ("alice", "bob", "observer")}
ROLE = {"alice": "user", "bob": "user", "observer": "observer"}
LINES = "\n".join(f"{name}:{ROLE[name]}:{hash_token(token)}" for name, token in TOKENS.items())


@pytest.fixture(scope="module")
def secured() -> Iterator[ServerThread]:
    with serving(tokens=LINES) as srv:
        yield srv


async def _pump(call: Any, queue: asyncio.Queue) -> None:
    """Reads a stream into a queue (cancelling a grpc read would cancel the whole call)."""
    while (msg := await call.read()) is not grpc.aio.EOF:
        queue.put_nowait(msg)
    queue.put_nowait(None)


def _events(msg: hook_service_pb2.SessionMessage) -> list[hook_pb2.InterceptEvent]:
    kind = msg.WhichOneof("kind")
    if kind == "event":
        return [msg.event]
    if kind == "batch":
        return list(msg.batch.events)
    return []


# ------------------------------------------------------------------ BLOCK by ownership


async def test_block_is_lossless_for_a_users_own_calls_on_its_own_subscription(secured) -> None:
    """alice (a user) subscribes with BLOCK to her own session hook and stops reading: her own
    calls wait for her subscription instead of losing events on it."""
    calls = 300
    x = torch.ones(64 * 1024)  # 256 KiB events: more than gRPC's transport buffers absorb
    async with grpc.aio.insecure_channel(secured.target) as channel:
        hooks = hook_service_pb2_grpc.HookServiceStub(channel)
        models = model_service_pb2_grpc.ModelServiceStub(channel)
        session = hooks.OpenSession(hook_service_pb2.OpenSessionRequest(), metadata=bearer(TOKENS["alice"]))
        session_id = (await session.read()).opened.session_id
        hook = await hooks.RegisterHook(hook_service_pb2.RegisterHookRequest(session_id=session_id, spec=hook_pb2.HookSpec(
            model="scale", posthook=hook_pb2.HookAction(capture=[hook_pb2.PART_OUTPUT]))), metadata=bearer(TOKENS["alice"]))
        sub = hooks.Subscribe(hook_service_pb2.SubscribeRequest(hook_ids=[hook.hook_id], delivery=hook_service_pb2.DeliveryOptions(
            policy=hook_service_pb2.DELIVERY_POLICY_BLOCK, max_events=8)), metadata=bearer(TOKENS["alice"]))
        assert (await sub.read()).WhichOneof("kind") == "subscribed"
        session_queue: asyncio.Queue = asyncio.Queue()
        session_reader = asyncio.ensure_future(_pump(session, session_queue))
        request = model_service_pb2.InferRequest(model="scale", session_id=session_id)
        request.args.add().CopyFrom(codec.encode_value(x))

        async def call_all() -> None:
            for _ in range(calls):
                await models.Infer(request, metadata=bearer(TOKENS["alice"]))

        caller = asyncio.ensure_future(call_all())
        (subscription,) = secured.call(lambda: list(secured.server.hooks._subscriptions))
        record = secured.call(lambda: secured.server.hooks._hooks[hook.hook_id])
        # The subscription is not read: alice's calls must wait for it (on main it dropped instead):
        # after their pass (their kept events wait for room), or before it (held back while it is full).
        scheduler = secured.call(lambda: secured.server.engines.scheduler(secured.server.registry.get("scale")))
        await until(lambda: secured.call(lambda: subscription.stream.waiting_producers > 0
                                         or record.counters.events_dropped > 0
                                         or any(w.stalled_since is not None for w in scheduler._queue)),
                    "the stream is full or the pass is held back")
        assert record.counters.events_dropped == 0, "alice's own BLOCK subscription dropped her events"
        sub_queue: asyncio.Queue = asyncio.Queue()
        sub_reader = asyncio.ensure_future(_pump(sub, sub_queue))
        await asyncio.wait_for(caller, LIVENESS)
        received: list[hook_pb2.InterceptEvent] = []
        while len(received) < calls:
            msg = await asyncio.wait_for(sub_queue.get(), LIVENESS)
            assert msg is not None and msg.WhichOneof("kind") != "notice", msg
            received += _events(msg)
        assert [e.seq for e in received] == list(range(1, calls + 1))
        assert all(e.dropped == 0 for e in received)
        (info,) = (await hooks.ListHooks(hook_service_pb2.ListHooksRequest(), metadata=bearer(TOKENS["alice"]))).hooks
        assert info.events_dropped == 0 and info.events_sent == 2 * calls
        sub.cancel()
        session.cancel()
        await asyncio.gather(session_reader, sub_reader, return_exceptions=True)


async def test_a_users_block_subscription_never_holds_another_callers_pass(secured) -> None:
    """An observer's BLOCK subscription to its SCOPE_ALL hook, never read, holds only the
    observer's own calls: bob's calls go on, and their events drop on that stream."""
    async with grpc.aio.insecure_channel(secured.target) as channel:
        hooks = hook_service_pb2_grpc.HookServiceStub(channel)
        session = hooks.OpenSession(hook_service_pb2.OpenSessionRequest(), metadata=bearer(TOKENS["observer"]))
        session_id = (await session.read()).opened.session_id  # never read again either
        hook = await hooks.RegisterHook(hook_service_pb2.RegisterHookRequest(session_id=session_id, spec=hook_pb2.HookSpec(
            model="scale", scope=hook_pb2.SCOPE_ALL,
            posthook=hook_pb2.HookAction(capture=[hook_pb2.PART_OUTPUT]))), metadata=bearer(TOKENS["observer"]))
        sub = hooks.Subscribe(hook_service_pb2.SubscribeRequest(hook_ids=[hook.hook_id], delivery=hook_service_pb2.DeliveryOptions(
            policy=hook_service_pb2.DELIVERY_POLICY_BLOCK, max_events=2)), metadata=bearer(TOKENS["observer"]))
        assert (await sub.read()).WhichOneof("kind") == "subscribed"
        x = torch.ones(256 * 1024)  # 1 MiB events: they fill any buffer quickly
        async with hookwire.connect(secured.target, options=hookwire.ConnectOptions(token=TOKENS["bob"])) as bob:
            for _ in range(30):
                await asyncio.wait_for(bob.model("scale")(x), LIVENESS)  # never held by the stalled stream
        record = secured.call(lambda: secured.server.hooks._hooks[hook.hook_id])
        assert record.counters.events_dropped > 0
        sub.cancel()
        session.cancel()


# ------------------------------------------------------------------ a stalled BLOCK stream holds only its owner


def _mlp_request(rows: int, session_id: str = "", seed: int = 0) -> model_service_pb2.InferRequest:
    x = torch.randn(rows, 8, generator=torch.Generator().manual_seed(seed))
    request = model_service_pb2.InferRequest(model="mlp", session_id=session_id)
    request.args.add().CopyFrom(codec.encode_value(x))
    return request


async def _block_session(hooks: Any, who: str, max_bytes: int) -> tuple[Any, str]:
    """A session of ``who`` ("": no credentials) with a small BLOCK buffer and a
    session-scoped hook capturing every module of the demo MLP (7 events a call); the
    session stream is read up to its first message only."""
    metadata = bearer(TOKENS[who]) if who else None
    session = hooks.OpenSession(hook_service_pb2.OpenSessionRequest(delivery=hook_service_pb2.DeliveryOptions(
        policy=hook_service_pb2.DELIVERY_POLICY_BLOCK, max_bytes=max_bytes)), metadata=metadata)
    session_id = (await session.read()).opened.session_id
    await hooks.RegisterHook(hook_service_pb2.RegisterHookRequest(session_id=session_id, spec=hook_pb2.HookSpec(
        model="mlp", module="**", posthook=hook_pb2.HookAction(capture=[hook_pb2.PART_OUTPUT]))), metadata=metadata)
    return session, session_id


async def test_a_stalled_block_session_never_stalls_another_principals_calls(secured) -> None:
    """alice opens a BLOCK session (64 KiB buffer) with a capture-everything hook, stops
    reading it and keeps calling Infer in it. bob's calls on the same model all complete
    (on main every one of them ran into its deadline behind alice's waiting pass); once alice
    reads again, every one of her calls completes and none of her events is lost."""
    alice_calls, rows = 6, 2048  # 256 KiB per hidden-layer event: more than the buffer and gRPC's own
    async with slow_reader_channel(secured.target) as channel:
        hooks = hook_service_pb2_grpc.HookServiceStub(channel)
        models = model_service_pb2_grpc.ModelServiceStub(channel)
        session, session_id = await _block_session(hooks, "alice", 64 * 1024)
        alice = [asyncio.ensure_future(models.Infer(_mlp_request(rows, session_id, i), metadata=bearer(TOKENS["alice"])))
                 for i in range(alice_calls)]
        (stream,) = secured.call(lambda: [s.stream for s in secured.server.hooks._sessions.values()
                                          if s.session_id == session_id])
        # alice's stream is full: a call of hers waits for her reader (after its pass; the rest
        # wait before theirs).
        await until(lambda: secured.call(lambda: stream.waiting_producers > 0), "a producer waits for the stalled stream")
        local = secured.call(lambda: secured.server.registry.get("mlp").module)
        for i in range(12):
            request = _mlp_request(rows, seed=100 + i)
            reply = await asyncio.wait_for(models.Infer(request, metadata=bearer(TOKENS["bob"])), LIVENESS)
            expected = local(codec.decode_value(request.args[0]))
            assert torch.equal(codec.decode_value(reply.output), expected)
        # Her first calls may have ended (gRPC's transport buffers took their events); not the rest.
        assert not all(call.done() for call in alice), "alice's calls went on while her stream was stalled"
        queue: asyncio.Queue = asyncio.Queue()
        reader = asyncio.ensure_future(_pump(session, queue))
        await asyncio.wait_for(asyncio.gather(*alice), LIVENESS)
        events: list[hook_pb2.InterceptEvent] = []
        ended: set[str] = set()
        while len(ended) < alice_calls:
            msg = await asyncio.wait_for(queue.get(), LIVENESS)
            assert msg is not None and msg.WhichOneof("kind") not in ("notice",), msg
            events += _events(msg)
            if msg.WhichOneof("kind") == "call_ended":
                ended.add(msg.call_ended.request_id)
        assert len(events) == 7 * alice_calls
        assert [e.seq for e in events] == list(range(1, 7 * alice_calls + 1))
        assert all(e.dropped == 0 for e in events)
        session.cancel()
        await asyncio.gather(reader, return_exceptions=True)


async def test_events_kept_for_a_full_stream_count_against_the_principals_byte_limit(make_server) -> None:
    """A call whose events a full BLOCK stream cannot take keeps them until its pass ends,
    counted against max_buffered_bytes_per_principal: past it, the call fails with
    RESOURCE_EXHAUSTED naming the setting at once (not after its reader reads), the server
    stays healthy, the events it kept still go out once the reader reads, and the kept bytes
    are given back (a later call within the limit succeeds)."""
    srv = make_server(max_buffered_bytes_per_principal=6 * 1024 * 1024)
    async with slow_reader_channel(srv.target) as channel:
        hooks = hook_service_pb2_grpc.HookServiceStub(channel)
        models = model_service_pb2_grpc.ModelServiceStub(channel)
        session = hooks.OpenSession(hook_service_pb2.OpenSessionRequest(delivery=hook_service_pb2.DeliveryOptions(
            policy=hook_service_pb2.DELIVERY_POLICY_BLOCK, max_bytes=64 * 1024)))
        session_id = (await session.read()).opened.session_id
        await hooks.RegisterHook(hook_service_pb2.RegisterHookRequest(session_id=session_id, spec=hook_pb2.HookSpec(
            model="mlp", module="**", posthook=hook_pb2.HookAction(capture=[hook_pb2.PART_OUTPUT]))))
        queue: asyncio.Queue = asyncio.Queue()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            # 4 MiB per hidden-layer event, 21 MiB a call: the call keeps one or two events, and
            # the next passes the limit (more than gRPC's transport takes from a stream nobody reads).
            await asyncio.wait_for(models.Infer(_mlp_request(32768, session_id)), LIVENESS)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_buffered_bytes_per_principal" in (info.value.details() or "")
        reader = asyncio.ensure_future(_pump(session, queue))
        await until(lambda: srv.call(lambda: srv.server.hooks.held_bytes.held(ANONYMOUS.name) == 0), "the held bytes are given back")
        reply = await asyncio.wait_for(models.Infer(_mlp_request(16, session_id)), LIVENESS)
        assert list(codec.decode_value(reply.output).shape) == [16, 4]
        session.cancel()
        await asyncio.gather(reader, return_exceptions=True)


async def test_a_full_session_stream_does_not_hold_calls_that_cannot_emit_into_it(make_server) -> None:
    """A user's session (BLOCK, a session-scoped hook) is full and unread: her calls in that
    session wait, but her calls outside it, for which that hook never fires, run at once."""
    srv = make_server(infer_timeout=30.0)
    async with slow_reader_channel(srv.target) as channel:
        hooks = hook_service_pb2_grpc.HookServiceStub(channel)
        models = model_service_pb2_grpc.ModelServiceStub(channel)
        session, session_id = await _block_session(hooks, "", 64 * 1024)
        in_session = [asyncio.ensure_future(models.Infer(_mlp_request(2048, session_id, i))) for i in range(6)]
        (stream,) = srv.call(lambda: [s.stream for s in srv.server.hooks._sessions.values()])
        await until(lambda: srv.call(lambda: stream.waiting_producers > 0), "a producer waits for the full stream")
        try:
            for i in range(3):
                reply = await asyncio.wait_for(models.Infer(_mlp_request(4, seed=i)), LIVENESS)
                assert list(codec.decode_value(reply.output).shape) == [4, 4]
        finally:
            session.cancel()
            await asyncio.gather(*in_session, return_exceptions=True)


# ------------------------------------------------------------------ `dropped` on every event


async def test_dropped_equals_the_seq_gaps_before_every_received_event(server) -> None:
    """Two stalled subscribers (DROP_OLDEST, DROP_NEWEST) of one hook: on every event each
    receives, ``dropped`` is exactly the number of seq numbers missing before it."""
    calls, rounds = 30, 3
    x = torch.ones(256 * 1024)  # 1 MiB events: gRPC's own transport buffers cannot hide the stall
    async with hookwire.connect(server.target) as caller, grpc.aio.insecure_channel(server.target) as channel:
        handle = await caller.model("scale").hook("", posthook=hookwire.capture("output"), scope="all", ttl_seconds=600)
        stub = hook_service_pb2_grpc.HookServiceStub(channel)
        calls_by_name, queues, readers = {}, {}, []
        for name, policy in (("oldest", hook_service_pb2.DELIVERY_POLICY_DROP_OLDEST),
                             ("newest", hook_service_pb2.DELIVERY_POLICY_DROP_NEWEST)):
            call = stub.Subscribe(hook_service_pb2.SubscribeRequest(hook_ids=[handle.id], delivery=hook_service_pb2.DeliveryOptions(
                policy=policy, max_events=4)))
            assert (await call.read()).WhichOneof("kind") == "subscribed"
            calls_by_name[name], queues[name] = call, asyncio.Queue()
        streams = server.call(lambda: {
            name: next(s.stream for s in server.server.hooks._subscriptions if s.stream.limits.policy == policy)
            for name, policy in (("oldest", hook_service_pb2.DELIVERY_POLICY_DROP_OLDEST),
                                 ("newest", hook_service_pb2.DELIVERY_POLICY_DROP_NEWEST))
        })
        offered = 0
        received: dict[str, list[hook_pb2.InterceptEvent]] = {name: [] for name in streams}
        for _ in range(rounds):
            # Stalled: nobody reads while the calls run, so both buffers overflow.
            for _ in range(calls):
                await caller.model("scale")(x)
            offered += calls
            for name, call in calls_by_name.items():
                # Nothing more is offered until the next round: read what the stream kept.
                kept = offered - server.call(lambda stream=streams[name]: stream.dropped)
                while len(received[name]) < kept:
                    received[name] += _events(await asyncio.wait_for(call.read(), LIVENESS))
        for name, events in received.items():
            seqs = [e.seq for e in events]
            assert seqs == sorted(set(seqs)) and len(events) < offered, name
            for i, event in enumerate(events):
                assert event.dropped == event.seq - 1 - i, f"{name}: event seq {event.seq} says {event.dropped} dropped"
        for call in calls_by_name.values():
            call.cancel()
        await handle.remove()


# ------------------------------------------------------------------ rule operands: one copy


def _rss_bytes() -> int:
    """Resident bytes of this process (the server's), after handing freed heap back to the
    OS: what is held, not what the allocator keeps cached from transient copies."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the bound below is generous anyway
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _add_spec(values: torch.Tensor) -> hook_pb2.HookSpec:
    from hookwire.v1 import rule_pb2

    operand = rule_pb2.Operand(tensor=codec.encode_tensor(values))
    return hook_pb2.HookSpec(model="scale", posthook=hook_pb2.HookAction(
        rules=[rule_pb2.Rule(target="output", add=rule_pb2.AddOp(value=operand))]))


async def test_rule_operands_are_held_once_and_listed_without_their_data(server) -> None:
    """4 hooks with 64 MiB operands: the server (this process) grows by about one copy of
    each, and ListHooks answers a client with gRPC's default 4 MiB receive limit."""
    hooks_n, numel = 4, 16 * 1024 * 1024  # float32: 64 MiB each
    operand_bytes = hooks_n * numel * 4
    async with grpc.aio.insecure_channel(server.target) as channel:  # gRPC's default limits
        stub = hook_service_pb2_grpc.HookServiceStub(channel)
        session = stub.OpenSession(hook_service_pb2.OpenSessionRequest())
        session_id = (await session.read()).opened.session_id
        before = _rss_bytes()
        for i in range(hooks_n):
            request = hook_service_pb2.RegisterHookRequest(session_id=session_id, spec=_add_spec(torch.full((numel,), float(i))))
            await stub.RegisterHook(request)
            del request
        growth = _rss_bytes() - before
        # One copy is 256 MiB; main kept the requests' bytes beside the decoded tensors (~580 MiB).
        # Within a suite's process the growth measured 1.13 alone and once 1.49 (gRPC may
        # still hold a request's buffers when RSS is read); holding every request's bytes
        # beside its tensor is 2x and more: the bound tells them apart.
        assert growth < operand_bytes * 1.6, f"registering {operand_bytes >> 20} MiB of operands took {growth >> 20} MiB"
        listed = await stub.ListHooks(hook_service_pb2.ListHooksRequest(session_id=session_id))
        assert len(listed.hooks) == hooks_n
        for hook in listed.hooks:
            (rule,) = hook.spec.posthook.rules
            tensor = rule.add.value.tensor
            assert tensor.dtype == 1 and list(tensor.shape) == [numel] and tensor.data == b""
        session.cancel()


async def test_list_hooks_returns_the_operands_as_registered_when_asked(client) -> None:
    values = torch.randn(3, 8, generator=torch.Generator().manual_seed(1)).to(torch.float16)
    direction = torch.tensor([3.0, 4.0, 0, 0, 1.0, 0, 0, 2.0], dtype=torch.float64)  # listed as sent, not normalized
    from hookwire.v1 import rule_pb2

    spec = _add_spec(values)
    spec.posthook.rules.add(target="output", project_out=rule_pb2.ProjectOutOp(direction=codec.encode_tensor(direction)))
    session = await client.session()
    reply = await client.hook_stub.RegisterHook(hook_service_pb2.RegisterHookRequest(session_id=session.session_id, spec=spec))
    assert reply.spec.posthook.rules[0].add.value.tensor.data == b""  # RegisterHook's echo is small too
    (bare,) = await client.list_hooks(session_id=session.session_id)
    (full,) = await client.list_hooks(session_id=session.session_id, include_operand_data=True)
    for info, with_data in ((bare, False), (full, True)):
        add, project = info.raw.spec.posthook.rules
        assert add.add.value.tensor.dtype == spec.posthook.rules[0].add.value.tensor.dtype
        assert list(add.add.value.tensor.shape) == [3, 8] and list(project.project_out.direction.shape) == [8]
        assert (add.add.value.tensor.data == spec.posthook.rules[0].add.value.tensor.data) is with_data
        assert (project.project_out.direction.data == spec.posthook.rules[1].project_out.direction.data) is with_data
    # The rules still apply exactly as registered (the direction normalized as the doc says).
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    expected = x * 2 + values.to(torch.float32)
    d = (direction / torch.linalg.vector_norm(direction)).to(torch.float32)
    expected = expected - (expected @ d).unsqueeze(-1) * d
    assert torch.equal(await client.model("scale")(x), expected)


# ------------------------------------------------------------------ default budgets


def test_default_stream_budgets_are_consistent() -> None:
    from hookwire_server.hooks.event_bus import DEFAULT_MAX_BYTES
    from hookwire_server.limits import Limits

    limits = Limits()
    assert limits.max_streams_per_principal * DEFAULT_MAX_BYTES <= limits.max_buffered_bytes_per_principal
    assert limits.max_buffered_bytes_per_principal < limits.max_buffered_bytes


@pytest.fixture
def defaults() -> Iterator[ServerThread]:
    with serving() as srv:
        yield srv


async def test_the_stream_limit_applies_with_default_buffers(defaults) -> None:
    """One principal opens max_streams_per_principal streams with default DeliveryOptions; the
    next one is refused naming the stream limit (on main the byte budget refused the 65th)."""
    limit = ServerSettings().max_streams_per_principal
    channels = [grpc.aio.insecure_channel(defaults.target) for _ in range(4)]
    calls = []
    try:
        stubs = [hook_service_pb2_grpc.HookServiceStub(c) for c in channels]
        session = stubs[0].OpenSession(hook_service_pb2.OpenSessionRequest())
        calls.append(session)
        session_id = (await session.read()).opened.session_id
        hook = await stubs[0].RegisterHook(hook_service_pb2.RegisterHookRequest(session_id=session_id, spec=hook_pb2.HookSpec(
            model="scale", posthook=hook_pb2.HookAction(capture=[hook_pb2.PART_OUTPUT]))))
        for i in range(limit - 1):
            call = stubs[i % len(stubs)].Subscribe(hook_service_pb2.SubscribeRequest(hook_ids=[hook.hook_id]))
            calls.append(call)
            assert (await call.read()).WhichOneof("kind") == "subscribed", f"stream {i + 2} was refused"
        extra = stubs[0].Subscribe(hook_service_pb2.SubscribeRequest(hook_ids=[hook.hook_id]))
        calls.append(extra)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await extra.read()
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_streams_per_principal" in err.value.details()
    finally:
        for call in calls:
            call.cancel()
        for channel in channels:
            await channel.close()


async def test_large_operands_are_decoded_and_encoded_off_the_event_loop(monkeypatch) -> None:
    """RegisterHook with a large operand, and ListHooks with operand data, must leave the
    event loop serving: the slow part is held on a gate here, and a health check on the
    same server must answer while it is held (if it ran on the loop, nothing would)."""
    import threading

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from hookwire_server.hooks import hook_manager

    from hookwire_server.hooks import hook_record

    gate, entered = threading.Event(), threading.Event()

    def gated(fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            entered.set()
            assert gate.wait(120), "the gate was never opened"
            return fn(*args, **kwargs)
        return run

    srv = ServerThread(build_test_registry()).start()
    try:
        async with grpc.aio.insecure_channel(srv.target) as channel:
            stub = hook_service_pb2_grpc.HookServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            session = stub.OpenSession(hook_service_pb2.OpenSessionRequest())
            session_id = (await session.read()).opened.session_id
            big = _add_spec(torch.ones(1 << 16))  # 256 KiB: over the inline size
            for step in ("register", "list"):
                gate.clear()
                entered.clear()
                if step == "register":
                    monkeypatch.setattr(hook_manager, "compile_spec", gated(hook_manager.compile_spec))
                    call = stub.RegisterHook(hook_service_pb2.RegisterHookRequest(session_id=session_id, spec=big))
                else:
                    monkeypatch.setattr(hook_record.HookRecord, "to_proto", gated(hook_record.HookRecord.to_proto))
                    call = stub.ListHooks(hook_service_pb2.ListHooksRequest(
                        session_id=session_id, include_operand_data=True))
                waiting = asyncio.ensure_future(call)
                assert await asyncio.to_thread(entered.wait, 120)
                answer = await health.Check(health_pb2.HealthCheckRequest(), timeout=60)  # while the gate holds (120 s)
                assert answer.status == health_pb2.HealthCheckResponse.SERVING
                gate.set()
                await asyncio.wait_for(waiting, 120)
                monkeypatch.undo()
            session.cancel()
    finally:
        gate.set()
        srv.stop()
