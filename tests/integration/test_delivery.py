"""Production delivery: BLOCK under load, drop policies with exact accounting and bounded
memory, chunked large tensors, sampling, summaries, TTL hooks, cleanup and fault isolation."""

from __future__ import annotations

import asyncio
import ctypes
import math
import time

from typing import Any

import grpc
import pytest
import torch

import hookwire
from hookwire.wire import codec, framing
from hookwire.v1 import hook_pb2, hook_service_pb2, hook_service_pb2_grpc, model_service_pb2, tensor_pb2
from support import LIVENESS, assert_same, local_models, take, until

X = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))


def _rss_bytes() -> int:
    """Resident memory after returning the allocator's free heap to the OS: what is really
    held, not what glibc keeps cached (which varies with which threads allocated)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


async def test_block_8_callers_4_subscribers_nothing_lost(server) -> None:
    callers, per_caller, subscribers = 8, 150, 4
    total = callers * per_caller
    async with hookwire.connect(server.target, options=hookwire.ConnectOptions(session_policy="block")) as owner:
        handle = await owner.model("mlp").hook("fc1", posthook=hookwire.capture("output"), scope="all")
        subs = [owner.subscribe([handle.id], policy="block", max_events=16) for _ in range(subscribers)]
        for sub in subs:
            await sub.start()
        clients = [hookwire.connect(server.target) for _ in range(callers)]

        async def call(c: hookwire.Client) -> None:
            for _ in range(per_caller):
                await c.model("mlp")(X)

        async def drain(iterator, n) -> list[int]:
            seqs = []
            async for event in iterator:
                seqs.append(event.seq)
                if len(seqs) == n:
                    break
            return seqs

        readers = [asyncio.ensure_future(drain(sub, total)) for sub in subs]
        readers.append(asyncio.ensure_future(drain(handle.events(), total)))
        await asyncio.gather(*(call(c) for c in clients))
        results = await asyncio.wait_for(asyncio.gather(*readers), 60)
        for c in clients:
            await c.close()
        for seqs in results:
            assert seqs == list(range(1, total + 1))
        (info,) = await owner.list_hooks(session_id=owner.session_id)
        assert info.fire_count == total
        assert info.events_sent == total * (subscribers + 1) and info.events_dropped == 0
        for sub in subs:
            await sub.aclose()


async def test_drop_policies_count_exactly_with_a_stalled_subscriber_and_memory_stays_bounded(server, client) -> None:
    # No session: only the two stalled subscribers receive (the test process is also the server).
    handle = await client.model("scale").hook("", posthook=hookwire.capture("output"), scope="all", ttl_seconds=600)
    x = torch.ones(256 * 1024)  # 1 MiB per event
    calls = 150
    async with grpc.aio.insecure_channel(server.target) as channel:
        stub = hook_service_pb2_grpc.HookServiceStub(channel)
        stalled = {}
        for name, policy in (("newest", hook_service_pb2.DELIVERY_POLICY_DROP_NEWEST),
                             ("oldest", hook_service_pb2.DELIVERY_POLICY_DROP_OLDEST)):
            stalled[name] = stub.Subscribe(hook_service_pb2.SubscribeRequest(
                hook_ids=[handle.id], delivery=hook_service_pb2.DeliveryOptions(policy=policy, max_events=8, max_bytes=4 << 20)))
            assert (await stalled[name].read()).WhichOneof("kind") == "subscribed"
        rss_before = _rss_bytes()
        caller = hookwire.connect(server.target)

        async def call_all() -> None:
            for _ in range(calls):
                await caller.model("scale")(x)

        # Stalled DROP streams never hold the pass (BLOCK would: forever); LIVENESS is a hang guard.
        await asyncio.wait_for(call_all(), LIVENESS)
        growth = _rss_bytes() - rss_before
        # 150 MiB were offered to each stalled stream; each holds at most 4 MiB (+ what gRPC buffers).
        assert growth < 80 << 20, f"server memory grew by {growth >> 20} MiB"

        async def read_event(queue: asyncio.Queue) -> hook_service_pb2.SessionMessage | None:
            # Through a queue: cancelling a grpc read (a timeout) would cancel the whole call.
            while True:
                try:
                    msg = await asyncio.wait_for(queue.get(), 1.0)
                except asyncio.TimeoutError:
                    return None
                if msg.WhichOneof("kind") == "notice":
                    notices.append(msg.notice)
                    continue
                if msg.WhichOneof("kind") == "call_ended":
                    continue
                assembler = codec.ChunkAssembler(msg.event)
                while not assembler.done:
                    assembler.feed((await queue.get()).chunk)
                return msg

        async def pump(call, queue: asyncio.Queue) -> None:
            while (msg := await call.read()) is not grpc.aio.EOF:
                queue.put_nowait(msg)

        offered = calls
        for name, call in stalled.items():
            queue: asyncio.Queue = asyncio.Queue()
            reader = asyncio.ensure_future(pump(call, queue))
            events, notices = [], []
            while (msg := await read_event(queue)) is not None:
                events.append(msg.event.seq)
            assert len(set(events)) == len(events) and events == sorted(events)
            dropped = offered - len(events)
            assert dropped > 0, name
            assert notices[0].kind == hook_service_pb2.NOTICE_KIND_DROPS_STARTED
            if name == "oldest":
                assert max(events) == offered  # the newest survive
            # Reading made room: the next event ends the run of drops, and says exactly how many.
            await caller.model("scale")(x)
            offered += 1
            msg = await read_event(queue)
            assert msg is not None and msg.event.seq == offered
            assert notices[-1].kind == hook_service_pb2.NOTICE_KIND_DROPS_ENDED
            assert msg.event.dropped == notices[-1].dropped == dropped, name
            call.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        await caller.close()
    (info,) = [h for h in await client.list_hooks() if h.hook_id == handle.id]
    assert info.fire_count == calls + 2 and info.events_dropped > 0
    assert info.events_sent + info.events_dropped == (calls + 2) * 2 - 1  # two subscribers, one was cancelled
    await handle.remove()


async def test_a_slow_stream_never_slows_other_callers(server, client) -> None:
    """The owner's session stream is not read at all; other callers' passes still never wait."""
    async with grpc.aio.insecure_channel(server.target) as channel:
        stub = hook_service_pb2_grpc.HookServiceStub(channel)
        session = stub.OpenSession(hook_service_pb2.OpenSessionRequest(delivery=hook_service_pb2.DeliveryOptions(max_events=2)))
        session_id = (await session.read()).opened.session_id
        await stub.RegisterHook(hook_service_pb2.RegisterHookRequest(session_id=session_id, spec=hook_pb2.HookSpec(
            model="scale", module="", scope=hook_pb2.SCOPE_ALL, posthook=hook_pb2.HookAction(capture=[hook_pb2.PART_OUTPUT]))))
        x = torch.ones(256 * 1024)
        stream = server.call(lambda: server.server.hooks._sessions[session_id].stream)

        async def call_all() -> list[torch.Tensor]:
            return [await client.model("scale")(x) for _ in range(60)]

        outputs = await asyncio.wait_for(call_all(), LIVENESS)  # a hang guard: the stalled stream never holds the pass
        assert all(torch.equal(out, x * 2) for out in outputs)
        # The unread stream filled up and dropped what did not fit; no pass ever waited for it.
        assert server.call(lambda: stream.dropped) > 0
        assert server.call(lambda: stream.waiting_producers) == 0
        session.cancel()


def _assert_exact_drops(events: list[hookwire.InterceptEvent]) -> None:
    """One hook on the stream: each event's ``dropped`` is exactly the seqs missing before it."""
    for received_before, event in enumerate(events):
        assert event.dropped == event.seq - 1 - received_before, (event.seq, event.dropped, received_before)


@pytest.mark.parametrize(("stream", "policy"), [("subscription", "drop_oldest"), ("session", "drop_oldest"),
                                                ("session", "drop_newest")])
async def test_a_drop_policy_protects_a_slow_sdk_reader_end_to_end(server, stream: str, policy: str) -> None:
    """Regression guard (issue 34): the SDK read every event into memory as it came (a session's
    unbounded inboxes; a subscription's reads left gRPC's flow-control window to grow), so a
    slow drop_oldest reader dropped nothing and, after traffic ended, had every event still to
    read. The SDK's own buffer of the stream is bounded and applies the stream's policy."""
    calls, bound = 200, 8
    options = hookwire.ConnectOptions(session_policy=policy, session_max_events=bound)  # type: ignore[arg-type]
    async with hookwire.connect(server.target, options=options) as reader:
        if stream == "subscription":
            hook = await reader.model("mlp").hook("fc1", posthook=hookwire.capture("output"), scope="all",
                                                  ttl_seconds=600)
            source: Any = reader.subscribe([hook.id], policy=policy, max_events=bound)  # type: ignore[arg-type]
            await source.start()
            router, caller, own = source._router, hookwire.connect(server.target), False
        else:
            hook = await reader.model("mlp").hook("fc1", posthook=hookwire.capture("output"))
            router, caller, own = (await reader.session()).router, reader, True
        # The reader pauses: every call is made before it reads anything.
        results = [await caller.model("mlp").infer(X, use_session=own) for _ in range(calls)]
        last = results[-1].request_id
        await until(lambda: router.calls.position(last) is not None, "the last call's end marker in the SDK")
        assert router.held_events <= bound  # what the SDK holds is bounded, whatever the traffic
        got = [e async for e in (source.events(until=last) if stream == "subscription" else hook.events(until=last))]
        # The reader gets at most a buffer's worth, not every event, and each says exactly how many it missed.
        assert 0 < len(got) <= bound, len(got)
        _assert_exact_drops(got)
        if policy == "drop_oldest":
            assert got[-1].seq == calls  # the latest events survive
        else:
            assert got[0].seq == 1  # the first ones do; the next event counts the drops after them
        after = (await caller.model("mlp").infer(X, use_session=own)).request_id
        (following,) = [e async for e in (source.events(until=after) if stream == "subscription"
                                          else hook.events(until=after))]
        assert following.seq == calls + 1
        _assert_exact_drops(got + [following])
        if stream == "subscription":
            await source.aclose()
            await caller.close()
        await hook.remove()


@pytest.mark.parametrize("stream", ["session", "subscription"])
async def test_a_block_stream_that_is_not_read_fills_the_servers_buffer_not_the_sdks(server, stream: str) -> None:
    """Regression guard (issue 34): the SDK read a session stream into unbounded inboxes, so the
    server never saw back-pressure and a BLOCK stream's buffer never filled: the SDK's memory
    grew instead. Now the SDK stops reading at its bound, the server's buffer fills, and the
    owner's calls wait for the reader; nothing is lost. (A subscription read one message
    ahead before; it must stay that way through the SDK's buffer.)"""
    bound = 8
    options = hookwire.ConnectOptions(session_policy="block", session_max_events=bound)
    async with hookwire.connect(server.target, options=options) as owner, hookwire.connect(server.target) as other:
        if stream == "session":
            # The owner's calls made outside the session (another connection of the same
            # principal) fill it: while a call *in* the session is in flight the SDK reads on
            # (test_an_own_call_whose_events_outgrow_both_buffers_still_completes).
            hook = await owner.model("scale").hook("", posthook=hookwire.capture("output"), scope="all")
            session = await owner.session()
            router = session.router
            found = server.call(lambda: server.server.hooks._sessions[session.session_id].stream)
            source: Any = hook
        else:
            hook = await owner.model("scale").hook("", posthook=hookwire.capture("output"), scope="all",
                                                   ttl_seconds=600)
            source = owner.subscribe([hook.id], policy="block", max_events=bound)
            await source.start()
            router = source._router
            (found,) = server.call(lambda: [s.stream for s in server.server.hooks._subscriptions if hook.id in s.hook_ids])
        x = torch.ones(4, 16 * 1024)  # 256 KiB an event: gRPC's window holds only a few of them
        made: list[str] = []
        stop = asyncio.Event()

        async def produce() -> None:
            while not stop.is_set():
                made.append((await other.model("scale").infer(x)).request_id)

        producer = asyncio.ensure_future(produce())
        try:
            await until(lambda: server.call(lambda: found.occupancy()[0]) >= bound, "the server's buffer to fill")
            assert router.held_events <= bound  # the SDK stopped reading at its bound
            stop.set()
            got = []

            async def read() -> None:
                async for event in source.events():
                    got.append(event)

            reader = asyncio.ensure_future(read())
            await asyncio.wait_for(producer, LIVENESS)  # the waiting call goes on once the reader reads
            await until(lambda: len(got) == len(made), "every event read")
            reader.cancel()
        finally:
            stop.set()
            producer.cancel()
        assert [e.seq for e in got] == list(range(1, len(made) + 1)) and all(e.dropped == 0 for e in got)
        assert [e.request_id for e in got] == made
        if stream == "subscription":
            await source.aclose()
        await hook.remove()


async def test_an_own_call_whose_events_outgrow_both_buffers_still_completes(server) -> None:
    """A session hook on every module of mlp, both buffers (the server's and the SDK's)
    holding 2 events under BLOCK: one call in the session makes more (and larger) events
    than both and gRPC's flow-control window hold. Awaiting the call before reading its events (the quickstart's pattern) must not
    wait for ever: while the session's own call is in flight the SDK reads on."""
    options = hookwire.ConnectOptions(session_policy="block", session_max_events=2)
    async with hookwire.connect(server.target, options=options) as client:
        hook = await client.model("mlp").hook("**", posthook=hookwire.capture("output"))
        # 4 MiB an event (fc1's and the ReLU's outputs): gRPC's window does not hold them all.
        result = await asyncio.wait_for(client.model("mlp").infer(torch.ones(32768, 8)), LIVENESS)
        events = [e async for e in hook.events(until=result)]
        assert len(events) > 4 and all(e.dropped == 0 for e in events), [e.module for e in events]
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        await hook.remove()


async def test_chunked_tensors_round_trip_for_a_client_with_grpc_default_limits(server) -> None:
    options = hookwire.ConnectOptions(max_message_bytes=4 * 1024 * 1024)
    big = torch.randn(3, 1024, 1024, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).transpose(0, 2)
    assert not big.is_contiguous() and big.numel() * 2 > 4 * (1 << 20)
    async with hookwire.connect(server.target, options=options) as small:
        model = small.model("scale")
        async with model.hook("", prehook=hookwire.capture("args"), posthook=hookwire.capture("output")) as hook:
            result = await model.infer(big, backward=None)
            events = [e async for e in take(hook, 2)]
        assert_same(result.output, big * 2)
        assert_same(events[0].args[0], big)
        assert_same(events[1].output, big * 2)
        f32 = torch.randn(2, 1536, 1024)  # 12 MiB float32, 12 chunks
        assert_same((await model.infer(f32)).output, f32 * 2)


async def test_a_kind_of_call_whose_reply_was_large_streams_the_next_time(server) -> None:
    """The SDK sends a call over InferStream when the last reply of its kind (model, mode,
    request-scoped hooks) was over 4 MiB, and over Infer again once a reply is small; the
    results are the same either way."""
    async with hookwire.connect(server.target) as c:
        sent: list[str] = []

        def counting(name, method):  # type: ignore[no-untyped-def]
            def call(*args, **kwargs):  # type: ignore[no-untyped-def]
                sent.append(name)
                return method(*args, **kwargs)
            return call

        c.tensor_calls.infer = counting("Infer", c.tensor_calls.infer)
        c.tensor_calls.infer_stream = counting("InferStream", c.tensor_calls.infer_stream)
        model = c.model("scale")
        x = torch.randn(50_000, generator=torch.Generator().manual_seed(3))  # 200 KB: sent inline
        hooks = [hookwire.HookSpec(module="", posthook=hookwire.capture("args", "output")) for _ in range(12)]
        first = await model.infer(x, hooks=hooks)  # a 4.8 MB reply
        second = await model.infer(x, hooks=hooks)
        other_kind = await model.infer(x)
        small = await model.infer(x[:10], hooks=hooks)  # streams (the last reply of its kind was large) ...
        again = await model.infer(x[:10], hooks=hooks)  # ... and was small
        assert sent == ["Infer", "InferStream", "Infer", "InferStream", "Infer"]
        # Both ways, the large tensors were read out of the received bytes, not by protobuf.
        assert first.raw.events[0].output.tensor.chunk_id and second.raw.events[0].output.tensor.chunk_id
        for result in (first, second, other_kind):
            assert_same(result.output, x * 2)
        for result in (first, second):
            assert len(result.events) == 12
            for event in result.events:
                assert_same(event.args, (x,))
                assert_same(event.output, x * 2)
        assert [e.seq for e in second.events] == [e.seq for e in first.events]
        for result in (small, again):
            assert_same(result.output, x[:10] * 2)
            assert_same(result.events[-1].output, x[:10] * 2)


async def test_infer_stream_reads_chunks_in_any_valid_encoding(server) -> None:
    """The server reads canonical chunk messages by hand and leaves any other valid encoding
    (here: TensorChunk's fields in reverse order, and the chunk field sent in two pieces,
    which protobuf merges) to protobuf; the results are the same."""
    x = torch.randn(300_000, generator=torch.Generator().manual_seed(5))  # 1.2 MB: two chunks
    request = model_service_pb2.InferRequest(model="scale")
    chunker = codec.Chunker(snapshot=False)
    codec.encode_value_into(x, request.args.add(), chunker=chunker)
    canonical = list(chunker.frames(framing.INFER_STREAM_CHUNK, 1 << 20))
    assert len(canonical) == 2

    def reversed_fields(chunk: tensor_pb2.TensorChunk) -> bytes:
        body = (b"\x1a" + framing.varint(len(chunk.data)) + chunk.data
                + (b"\x10" + framing.varint(chunk.offset) if chunk.offset else b"")
                + b"\x08" + framing.varint(chunk.chunk_id))
        return b"\x12" + framing.varint(len(body)) + body

    def in_two_pieces(chunk: tensor_pb2.TensorChunk) -> bytes:
        header = tensor_pb2.TensorChunk(chunk_id=chunk.chunk_id, offset=chunk.offset)
        return (model_service_pb2.InferStreamRequest(chunk=header).SerializeToString()
                + model_service_pb2.InferStreamRequest(chunk=tensor_pb2.TensorChunk(data=chunk.data)).SerializeToString())

    async with grpc.aio.insecure_channel(server.target) as channel:
        call = channel.stream_stream("/hookwire.v1.ModelService/InferStream")  # bytes in, bytes out
        for encode in (None, reversed_fields, in_two_pieces):
            chunks = canonical if encode is None else [encode(c) for c in chunker.chunks(1 << 20)]
            if encode is not None:
                assert all(framing.read_frame(c, framing.INFER_STREAM_CHUNK) is None for c in chunks)

            async def messages():  # type: ignore[no-untyped-def]
                yield model_service_pb2.InferStreamRequest(request=request).SerializeToString()
                for c in chunks:
                    yield c

            replies = [model_service_pb2.InferStreamResponse.FromString(m) async for m in call(messages())]
            assembler = codec.ChunkAssembler(replies[0].response)
            for reply in replies[1:]:
                assembler.feed(reply.chunk)
            assert_same(codec.decode_value(replies[0].response.output, chunked=assembler.result()), x * 2)


async def test_grpc_default_client_without_the_sdk_gets_chunks_not_errors(server) -> None:
    async with grpc.aio.insecure_channel(server.target) as channel:  # 4 MiB receive limit
        stub = hook_service_pb2_grpc.HookServiceStub(channel)
        session = stub.OpenSession(hook_service_pb2.OpenSessionRequest())
        session_id = (await session.read()).opened.session_id
        await stub.RegisterHook(hook_service_pb2.RegisterHookRequest(session_id=session_id, spec=hook_pb2.HookSpec(
            model="scale", module="", posthook=hook_pb2.HookAction(capture=[hook_pb2.PART_OUTPUT]))))
        async with hookwire.connect(server.target) as sdk:
            sdk._session = None
            request_x = torch.arange(3_000_000, dtype=torch.float32)
            from hookwire.v1 import model_service_pb2, model_service_pb2_grpc
            models = model_service_pb2_grpc.ModelServiceStub(sdk._channel or (sdk._open() or sdk._channel))
            await models.Infer(model_service_pb2.InferRequest(model="scale", session_id=session_id,
                                                              args=[codec.encode_value(request_x)]))
        header = await session.read()
        assembler = codec.ChunkAssembler(header.event)
        chunks = 0
        while not assembler.done:
            assembler.feed((await session.read()).chunk)
            chunks += 1
        assert chunks == math.ceil(12_000_000 / (1 << 20))
        assert torch.equal(codec.decode_value(header.event.output, chunked=assembler.result()), request_x * 2)
        session.cancel()


async def test_every_n_and_max_events_are_exact(client) -> None:
    model = client.model("mlp")
    async with model.hook("fc1", posthook=hookwire.capture("output"), sampling=hookwire.Sampling(every_n=3, max_events=4)) as h:
        results = [await model.infer(X) for _ in range(20)]
        marker = await model.hook("fc2", posthook=hookwire.capture())
        await h.remove()
        seen = [e.request_id async for e in h.events()]
        await marker.remove()
    assert seen == [results[i].request_id for i in (0, 3, 6, 9)]


async def test_seeded_probability_is_reproducible(client) -> None:
    async def picks(seed: int) -> list[int]:
        model = client.model("mlp")
        sampling = hookwire.Sampling(probability=0.3, seed=seed)
        async with model.hook("fc1", posthook=hookwire.capture(), prehook=hookwire.capture("args"), sampling=sampling) as h:
            ids = [(await model.infer(X)).request_id for _ in range(40)]
            await h.remove()
            events = [e async for e in h.events()]
        return [ids.index(e.request_id) for e in events]

    first, again, other = await picks(7), await picks(7), await picks(8)
    assert first == again and first != other
    assert 3 <= len(first) <= 25


async def test_summaries_equal_torchs_reductions(client) -> None:
    local = local_models()["mlp"]
    out = local.fc1(X).detach()
    result = await client.model("mlp").infer(X, hooks=[hookwire.HookSpec(
        "fc1", posthook=hookwire.capture("args", "output", summarize=True, histogram_bins=8))])
    (event,) = result.events
    s = event.output
    assert isinstance(s, hookwire.TensorSummary)
    x = out.double()
    assert (s.dtype, s.shape, s.numel) == ("float32", (2, 32), 64)
    assert s.min == x.min().item() and s.max == x.max().item()
    assert s.mean == x.mean().item() and s.std == x.std().item()
    assert s.l2_norm == torch.linalg.vector_norm(x).item()
    assert (s.nan_count, s.inf_count) == (0, 0)
    assert list(s.histogram) == [int(c) for c in torch.histc(x, 8, x.min().item(), x.max().item()).tolist()]
    assert sum(s.histogram) == 64
    assert isinstance(event.args[0], hookwire.TensorSummary)
    assert len(event.raw.SerializeToString()) < 600


async def test_summaries_count_nan_and_inf(client) -> None:
    x = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 2.0])
    result = await client.model("scale").infer(x, hooks=[hookwire.HookSpec("", prehook=hookwire.capture("args", summarize=True))])
    s = result.events[0].args[0]
    assert (s.nan_count, s.inf_count) == (1, 2) and math.isnan(s.mean)


async def test_select_and_cast_before_sending(client, tokens) -> None:
    ids, mask = tokens
    local = local_models()["tiny-transformer"]
    seen = {}
    local.encoder.layers[1].register_forward_hook(lambda m, a, out: seen.setdefault("out", out.detach().clone()))
    with torch.no_grad():
        local(ids, attention_mask=mask)
    result = await client.model("tiny-transformer").infer(ids, attention_mask=mask, hooks=[hookwire.HookSpec(
        "encoder.layers.1", posthook=hookwire.capture("output", select="[:, -1]", cast="bfloat16"))])
    assert_same(result.events[0].output, seen["out"][:, -1].to(torch.bfloat16))
    assert len(result.events[0].raw.output.tensor.data) == 2 * 32 * 2


async def test_bad_capture_options_are_rejected(client) -> None:
    model = client.model("mlp")
    with pytest.raises(hookwire.InvalidArgumentError, match="posthook.select"):
        await model.hook("fc1", posthook=hookwire.capture("output", select="[0,"))
    with pytest.raises(hookwire.InvalidArgumentError, match="sampling.probability"):
        await model.hook("fc1", posthook=hookwire.capture("output"), sampling=hookwire.Sampling(probability=1.5))
    with pytest.raises(hookwire.InvalidArgumentError, match="histogram_bins"):
        await model.hook("fc1", posthook=hookwire.capture("output", histogram_bins=100_000))


async def test_ttl_hook_outlives_its_client_and_expires_telling_subscribers(server, client) -> None:
    async with hookwire.connect(server.target) as operator:
        handle = await operator.model("mlp").hook("fc2", posthook=hookwire.capture("output"), scope="all", ttl_seconds=2)
        assert handle.info.session_id == "" and handle.info.expires is not None
    # The operator is gone; the hook is not.
    (info,) = [h for h in await client.list_hooks() if h.hook_id == handle.id]
    async with client.subscribe([handle.id]) as sub:
        r = await client.model("mlp").infer(X)
        got = []
        async for event in sub:
            got.append(event.request_id)
            if len(got) == 1:
                break
        assert got == [r.request_id]
        rest = [e async for e in sub]  # ends when the TTL removes the hook
    assert rest == []
    assert any(n.kind == "hook_removed" and "TTL" in n.message for n in sub.notices)
    assert handle.id not in [h.hook_id for h in await client.list_hooks()]


async def test_ttl_rules(client) -> None:
    model = client.model("mlp")
    with pytest.raises(hookwire.InvalidArgumentError, match="SCOPE_ALL or SCOPE_TAGGED"):
        await model.hook("fc1", posthook=hookwire.capture(), ttl_seconds=5)
    stub = client.hook_stub
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.RegisterHook(hook_service_pb2.RegisterHookRequest(spec=hook_pb2.HookSpec(
            model="mlp", module="fc1", scope=hook_pb2.SCOPE_ALL, posthook=hook_pb2.HookAction())))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "needs a TTL" in info.value.details()


async def test_subscriber_disconnect_frees_its_buffer_at_once(server, client) -> None:
    handle = await client.model("mlp").hook("fc1", posthook=hookwire.capture("output"), scope="all")
    record = server.call(lambda: server.server.hooks.get(handle.id))
    async with hookwire.connect(server.target) as watcher:
        sub = watcher.subscribe([handle.id])
        await sub.start()
        assert len(record.streams) == 2
        stream = record.streams[1]
        await sub.aclose()
        deadline = time.monotonic() + 60  # a hang guard; detaching itself is immediate
        while len(record.streams) != 1:
            assert time.monotonic() < deadline, "subscriber not detached within 60 s"
            await asyncio.sleep(0.01)
        assert stream.closed and stream.occupancy() == (0, 0)
    await handle.remove()


async def test_a_failing_capture_never_fails_another_clients_call(client, other_client) -> None:
    async with client.model("mlp").hook("fc1", posthook=hookwire.capture("output", select="[5]"), scope="all") as hook:
        out = await other_client.model("mlp")(X)  # batch of 2: [5] is out of range
        assert_same(out, local_models()["mlp"](X).detach())
        (info,) = [h for h in await client.list_hooks() if h.hook_id == hook.id]
        assert info.errors == 1 and "could not capture" in info.disabled_reason
        session = await client.session()
        for _ in range(3000):  # up to 60 s: a hang guard
            if any(n.kind == "capture_failed" and n.hook_id == hook.id for n in session.router.notices):
                break
            await asyncio.sleep(0.02)
        else:
            pytest.fail("no capture_failed notice")
        assert_same(await other_client.model("mlp")(X), out)


async def test_list_hooks_shows_stats(client) -> None:
    model = client.model("mlp")
    async with model.hook("fc*", posthook=hookwire.capture("output")) as hook:
        for _ in range(3):
            await model(X)
        await asyncio.wait_for(_drain(hook, 6), 5)
        (info,) = await client.list_hooks(session_id=client.session_id)
    assert (info.scope, info.modules, info.fire_count, info.events_sent, info.events_dropped, info.errors) == (
        "session", ("fc1", "fc2"), 6, 6, 0, 0)
    assert info.last_fired is not None and info.expires is None


async def _drain(hook, n):
    got = 0
    async for _ in hook.events():
        got += 1
        if got == n:
            return


async def test_every_n_counts_each_module_on_its_own(client) -> None:
    model = client.model("mlp")
    async with model.hook("fc*", posthook=hookwire.capture(), prehook=hookwire.capture("args"),
                          sampling=hookwire.Sampling(every_n=2)) as h:
        results = [await model.infer(X) for _ in range(6)]
        await h.remove()
        seen = [(e.module, e.request_id) async for e in h.events()]
    expected = [(m, results[i].request_id) for i in (0, 2, 4) for m in ("fc1", "fc2")]
    assert seen == expected


async def test_removing_a_hook_releases_a_pass_blocked_on_a_stalled_block_subscriber(server, client, other_client) -> None:
    handle = await client.model("scale").hook("", posthook=hookwire.capture("output"), scope="all", ttl_seconds=600)
    async with grpc.aio.insecure_channel(server.target) as channel:
        stalled = hook_service_pb2_grpc.HookServiceStub(channel).Subscribe(hook_service_pb2.SubscribeRequest(
            hook_ids=[handle.id], delivery=hook_service_pb2.DeliveryOptions(
                policy=hook_service_pb2.DELIVERY_POLICY_BLOCK, max_events=1)))
        await stalled.read()
        x = torch.ones(1 << 20)  # 4 MiB events: gRPC's own buffers fill quickly too
        calls = [asyncio.ensure_future(other_client.model("scale")(x)) for _ in range(12)]
        await asyncio.sleep(1.0)
        assert not all(c.done() for c in calls), "BLOCK must hold the passes"
        assert await asyncio.wait_for(client.deregister_hook(handle.id), 10)
        await asyncio.wait_for(asyncio.gather(*calls), 20)  # the model is free again
        stalled.cancel()


async def test_max_events_is_not_used_up_while_nobody_listens(client, other_client) -> None:
    handle = await client.model("mlp").hook("fc1", posthook=hookwire.capture("output"), scope="all",
                                            ttl_seconds=600, sampling=hookwire.Sampling(max_events=2))
    for _ in range(3):
        await other_client.model("mlp")(X)  # nobody subscribed yet
    async with client.subscribe([handle.id]) as sub:
        results = [await other_client.model("mlp").infer(X) for _ in range(3)]
        got = []
        async for event in sub:
            got.append(event.request_id)
            if len(got) == 2:
                break
    assert got == [r.request_id for r in results[:2]]
    await handle.remove()


async def test_fail_call_on_a_shared_hook_needs_shared_rules(client) -> None:
    with pytest.raises(hookwire.PermissionDeniedError, match="ON_ERROR_FAIL_CALL on a shared hook"):
        await client.model("mlp").hook("fc1", posthook=[hookwire.rules.save("output", "s", index="[1000]")],
                                       scope="all", on_error="fail_call")
