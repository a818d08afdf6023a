"""Sessions, scopes, subscriptions, lifetimes and lossless delivery."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import grpc
import pytest
import torch

import hookwire
from hookwire.v1 import hook_pb2, hook_service_pb2, hook_service_pb2_grpc, model_service_pb2, model_service_pb2_grpc
from support import LIVENESS, collect, until


async def test_session_scope_fires_only_for_own_calls(client, other_client) -> None:
    x = torch.randn(1, 8)
    async with client.model("mlp").hook("fc1", posthook=hookwire.capture("output")) as hook:
        theirs = await other_client.model("mlp").infer(x)
        mine = await client.model("mlp").infer(x)
        (event,) = await collect(hook, 1)
        assert event.request_id == mine.request_id != theirs.request_id
        assert event.seq == 1


async def test_scope_all_fires_for_everyone(client, other_client) -> None:
    x = torch.randn(1, 8)
    async with client.model("mlp").hook("fc1", posthook=hookwire.capture("output"), scope="all") as hook:
        theirs = await other_client.model("mlp").infer(x)
        anonymous = await other_client.model("mlp").infer(x, use_session=False)
        mine = await client.model("mlp").infer(x)
        events = await collect(hook, 3)
    assert [e.request_id for e in events] == [theirs.request_id, anonymous.request_id, mine.request_id]
    assert [e.seq for e in events] == [1, 2, 3]


async def test_request_scoped_hooks_fire_only_for_their_call(client, other_client) -> None:
    x = torch.randn(1, 8)
    spec = hookwire.HookSpec("fc1", posthook=hookwire.capture("output"))
    async with other_client.model("mlp").hook("fc1", posthook=hookwire.capture(), scope="all"):
        results = await asyncio.gather(
            client.model("mlp").infer(x, hooks=[spec]),
            other_client.model("mlp").infer(x),
            client.model("mlp").infer(x, hooks=[spec, spec]),
        )
    assert [len(r.events) for r in results] == [1, 0, 2]
    for r in results:
        assert all(e.request_id == r.request_id for e in r.events)
    assert await client.list_hooks(model="mlp") == []  # request hooks are gone with their call


async def test_session_end_removes_its_hooks_at_once(server, other_client) -> None:
    async with hookwire.connect(server.target) as c:
        handle = await c.model("mlp").hook("fc*", posthook=hookwire.capture("output"))
        session_id = c.session_id
        assert [h.hook_id for h in await other_client.list_hooks(session_id=session_id)] == [handle.id]
    await until(lambda: _no_hooks(other_client, session_id), "the closed session's hooks are gone")
    module = server.server.registry.get("mlp").module
    await until(lambda: not module.fc1._forward_hooks, "the torch hooks are removed")
    # The closed session is gone: using it is NOT_FOUND.
    stub = hook_service_pb2_grpc.HookServiceStub(other_client._channel)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.RegisterHook(hook_service_pb2.RegisterHookRequest(
            session_id=session_id, spec=hook_pb2.HookSpec(model="mlp", module="fc1", posthook=hook_pb2.HookAction())))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await other_client.model_stub.Infer(model_service_pb2.InferRequest(model="mlp", session_id=session_id))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def _no_hooks(client, session_id: str) -> bool:
    return not await client.list_hooks(session_id=session_id)


async def test_unknown_session_is_not_found(client) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.hook_stub.RegisterHook(hook_service_pb2.RegisterHookRequest(
            session_id="ses_nope", spec=hook_pb2.HookSpec(model="mlp", module="fc1", posthook=hook_pb2.HookAction())))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "session" in info.value.details()


async def test_killed_client_process_loses_its_hooks_within_a_second(server, client) -> None:
    script = textwrap.dedent(f"""
        import asyncio, sys, hookwire
        async def main():
            c = hookwire.connect({server.target!r})
            await c.model("mlp").hook("fc2", posthook=hookwire.capture("output"), scope="all")
            print(c.session_id, flush=True)
            await asyncio.sleep(60)
        asyncio.run(main())
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        session_id = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
        session_id = session_id.strip()
        assert len(await client.list_hooks(session_id=session_id)) == 1
        os.kill(proc.pid, signal.SIGKILL)
        # The dead process's socket closes at once, so the hooks go at once; the bound is a generous liveness guard.
        await until(lambda: _no_hooks(client, session_id), "the session's hooks are gone")
    finally:
        proc.kill()
        proc.wait(10)
    assert (await client.model("mlp").infer(torch.randn(1, 8))).output.shape == (1, 4)


async def test_subscribe_fans_out_with_own_seq(client, other_client) -> None:
    x = torch.randn(1, 8)
    model = client.model("mlp")
    handle = await model.hook("fc1", posthook=hookwire.capture("output"), scope="all")
    await model(x)  # before the subscription: only the owner sees it
    async with other_client.subscribe([handle.id]) as sub:
        r1 = await other_client.model("mlp").infer(x)
        r2 = await model.infer(x)
        got = []
        async for event in sub:
            got.append(event)
            if len(got) == 2:
                break
        assert [e.seq for e in got] == [1, 2]
        assert [e.request_id for e in got] == [r1.request_id, r2.request_id]
        owner = await collect(handle, 3)
        assert [e.seq for e in owner] == [1, 2, 3]
        for a, b in zip(got, owner[1:]):
            assert torch.equal(a.output, b.output)
    with pytest.raises(hookwire.NotFoundError):
        async with other_client.subscribe(["hk_unknown"]):
            pass
    await handle.remove()


async def test_subscription_ends_when_its_hooks_are_removed(client, other_client) -> None:
    handle = await client.model("mlp").hook("fc1", posthook=hookwire.capture("output"))
    async with other_client.subscribe([handle.id]) as sub:
        await handle.remove()
        remaining = [e async for e in sub]
    assert remaining == []


async def test_deregister_is_idempotent(client) -> None:
    handle = await client.model("mlp").hook("fc1", posthook=hookwire.capture())
    assert await client.deregister_hook(handle.id) is True
    assert await client.deregister_hook(handle.id) is False
    assert await client.deregister_hook("hk_never_existed") is False
    assert await handle.remove() is False
    assert await handle.remove() is False
    assert [e async for e in handle.events()] == []  # ended by the removal notice


async def test_events_end_after_removal_with_everything_before_it(client) -> None:
    model = client.model("mlp")
    handle = await model.hook("*", posthook=hookwire.capture("output"))
    for _ in range(5):
        await model(torch.randn(1, 8))
    await handle.remove()
    events = [e async for e in handle.events()]
    assert len(events) == 5 * (len(handle.modules) + 1)  # the ReLU "act" runs twice per pass
    assert [e.seq for e in events] == list(range(1, len(events) + 1))


async def test_block_delivery_waits_for_a_slow_reader_and_loses_nothing(server) -> None:
    """A session with a 1-event buffer that nobody reads: passes wait, then all events arrive."""
    options = [("grpc.max_receive_message_length", 1 << 30), ("grpc.max_send_message_length", 1 << 30)]
    async with grpc.aio.insecure_channel(server.target, options=options) as channel:
        hooks = hook_service_pb2_grpc.HookServiceStub(channel)
        models = model_service_pb2_grpc.ModelServiceStub(channel)
        stream = hooks.OpenSession(hook_service_pb2.OpenSessionRequest(
            delivery=hook_service_pb2.DeliveryOptions(max_events=1)))
        opened = await stream.read()
        session_id = opened.opened.session_id
        hook = await hooks.RegisterHook(hook_service_pb2.RegisterHookRequest(session_id=session_id, spec=hook_pb2.HookSpec(
            model="scale", module="", posthook=hook_pb2.HookAction(capture=[hook_pb2.PART_OUTPUT]))))
        x = hookwire.wire.codec.encode_value(torch.ones(1 << 20))  # 4 MiB per event
        calls = [asyncio.ensure_future(models.Infer(model_service_pb2.InferRequest(
            model="scale", session_id=session_id, args=[x]))) for _ in range(24)]
        await asyncio.sleep(1.5)
        assert sum(c.done() for c in calls) < len(calls), "96 MiB of events cannot all fit: passes must wait"
        seqs: list[int] = []
        ended: list[str] = []
        while len(ended) < len(calls):
            msg = await asyncio.wait_for(stream.read(), 30)
            if msg.WhichOneof("kind") == "call_ended":
                # Each call's marker follows its (one) event and that event's chunks.
                assert len(ended) + 1 == len(seqs) and msg.call_ended.model == "scale"
                ended.append(msg.call_ended.request_id)
                continue
            assert msg.WhichOneof("kind") == "event" and msg.event.hook_id == hook.hook_id
            assert len(seqs) == len(ended), "a call's next event came before the previous call's CallEnded"
            # 4 MiB does not travel inline: the event is followed by its tensor's chunks.
            assembler = hookwire.wire.codec.ChunkAssembler(msg.event)
            while not assembler.done:
                chunk = await asyncio.wait_for(stream.read(), 30)
                assert chunk.WhichOneof("kind") == "chunk" and len(chunk.chunk.data) <= 1 << 20
                assembler.feed(chunk.chunk)
            output = hookwire.wire.codec.decode_value(msg.event.output, chunked=assembler.result())
            assert torch.equal(output, torch.full((1 << 20,), 2.0))
            seqs.append(msg.event.seq)
        responses = await asyncio.wait_for(asyncio.gather(*calls), 30)
        assert seqs == list(range(1, len(calls) + 1))
        assert sorted(ended) == sorted(r.request_id for r in responses)
        stream.cancel()


async def test_removal_notice_is_the_hooks_last_message_under_concurrent_calls(server, other_client) -> None:
    async with grpc.aio.insecure_channel(server.target) as channel:
        hooks = hook_service_pb2_grpc.HookServiceStub(channel)
        stream = hooks.OpenSession(hook_service_pb2.OpenSessionRequest())
        session_id = (await stream.read()).opened.session_id
        hook = await hooks.RegisterHook(hook_service_pb2.RegisterHookRequest(session_id=session_id, spec=hook_pb2.HookSpec(
            model="mlp", module="fc1", posthook=hook_pb2.HookAction(capture=[hook_pb2.PART_OUTPUT]), scope=hook_pb2.SCOPE_ALL)))
        stop = asyncio.Event()

        async def traffic() -> int:
            n = 0
            while not stop.is_set():
                await other_client.model("mlp")(torch.randn(1, 8))
                n += 1
            return n

        load = asyncio.ensure_future(traffic())
        await asyncio.sleep(0.3)
        assert (await hooks.DeregisterHook(hook_service_pb2.DeregisterHookRequest(hook_id=hook.hook_id))).removed
        seqs, after_notice = [], []
        while True:
            msg = await asyncio.wait_for(stream.read(), 10)
            if msg.WhichOneof("kind") == "notice":
                assert msg.notice.kind == hook_service_pb2.NOTICE_KIND_HOOK_REMOVED
                break
            if msg.WhichOneof("kind") == "call_ended":
                continue
            seqs.append(msg.event.seq)
        try:
            while True:
                after_notice.append(await asyncio.wait_for(stream.read(), 0.3))
        except asyncio.TimeoutError:
            pass
        stop.set()
        assert await load > 0
        stream.cancel()
    assert seqs and seqs == list(range(1, len(seqs) + 1))
    assert after_notice == []


@pytest.mark.parametrize("stalled", [False, True], ids=["idle", "stalled-under-block"])
async def test_frozen_client_process_loses_its_hooks_within_the_keepalive_bound(stalled: bool) -> None:
    """A SIGSTOPped client answers no keepalive ping: its session and hooks end within about
    keepalive_time + keepalive_timeout, also when its full BLOCK session holds its calls back."""
    from hookwire_server import ServerSettings
    from support import ServerThread, build_test_registry

    srv = ServerThread(build_test_registry(), ServerSettings(port=0, keepalive_time=1.0, keepalive_timeout=1.0)).start()
    script = textwrap.dedent(f"""
        import asyncio, hookwire, torch
        async def main():
            options = hookwire.ConnectOptions(session_policy="block", session_max_events=1)
            c = hookwire.connect({srv.target!r}, options=options)
            await c.model("scale").hook("", posthook=hookwire.capture("output"))
            x = torch.ones(1 << 20)  # 4 MiB events: many more than the buffers hold once nobody reads
            async def calls():
                while True:
                    await c.model("scale")(x)
            if {stalled!r}:
                tasks = [asyncio.ensure_future(calls()) for _ in range(16)]
                await asyncio.sleep(1)
            print(c.session_id, flush=True)
            await asyncio.sleep(3600)
        asyncio.run(main())
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        async with hookwire.connect(srv.target) as observer:
            session_id = (await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)).strip()
            assert len(await observer.list_hooks(session_id=session_id)) == 1
            os.kill(proc.pid, signal.SIGSTOP)
            if stalled:
                # The frozen client's full BLOCK session holds back its own calls' passes
                # (they wait in the scheduler, stalled); calls of other sessions, which
                # emit nothing into that stream, are not held (#22).
                scheduler = srv.call(lambda: srv.server.engines.scheduler(srv.server.registry.get("scale")))

                def held_back() -> bool:
                    return srv.call(lambda: any(w.stalled_since is not None for w in scheduler._queue))

                await until(held_back, "the frozen client's calls are held back by its full BLOCK stream")
                other = await asyncio.wait_for(observer.model("scale")(torch.ones(2)), LIVENESS)
                assert torch.equal(other, torch.full((2,), 2.0))
            # Generous against keepalive 1 s + 1 s (the default, 10 s + 5 s, took 60-70 s before).
            await until(lambda: _no_hooks(observer, session_id), "the session's hooks are gone", timeout=30)
            if stalled:
                await until(lambda: not held_back(), "the ended session no longer holds its calls back")
            assert (await observer.model("scale")(torch.ones(2))).shape == (2,)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(10)
        srv.stop()
