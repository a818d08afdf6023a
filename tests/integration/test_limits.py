"""Every limit answers with a clear status naming it, and the server goes on serving."""

from __future__ import annotations

import asyncio
from typing import Iterator

import pytest
import torch

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

import hookwire
from hookwire.v1 import hook_pb2, model_service_pb2
from hookwire_server import ServerSettings
from support import ServerThread, serving

X = torch.randn(1, 8)


@pytest.fixture(scope="module")
def tight() -> Iterator[ServerThread]:
    settings = ServerSettings(
        port=0, max_hooks_per_session=2, max_hooks_per_principal=3, max_rules_per_action=2,
        max_sessions_per_principal=3, max_streams_per_principal=4, max_buffered_bytes=3 * 1024 * 1024,
        max_infer_elements=1000, max_queued_infers=1, infer_timeout=0.5, max_message_bytes=8 * 1024 * 1024,
        max_request_hooks=3, max_events_per_call=5,
    )
    with serving(settings=settings) as srv:
        yield srv


def _small(srv: ServerThread) -> hookwire.Client:
    return hookwire.connect(srv.target, options=hookwire.ConnectOptions(session_max_bytes=512 * 1024))


async def _healthy(srv: ServerThread) -> None:
    async with _small(srv) as c:
        assert (await c.model("mlp")(X)).shape == (1, 4)


async def test_hooks_per_session_and_rules_per_action(tight) -> None:
    async with _small(tight) as c:
        model = c.model("mlp")
        await model.hook("fc1", posthook=hookwire.capture())
        await model.hook("fc2", posthook=hookwire.capture())
        with pytest.raises(hookwire.ResourceExhaustedError, match="max_hooks_per_session"):
            await model.hook("out", posthook=hookwire.capture())
        with pytest.raises(hookwire.InvalidArgumentError, match="rules: 3 (or more )?rules, over the limit of 2"):
            await model.infer(X, hooks=[hookwire.HookSpec("fc1", posthook=[hookwire.rules.scale("output", 1.0)] * 3)])
    await _healthy(tight)


async def test_sessions_streams_and_buffer_budget(tight) -> None:
    clients = [_small(tight) for _ in range(4)]
    try:
        for c in clients[:3]:
            await c.session()
        with pytest.raises(hookwire.ResourceExhaustedError, match="max_sessions_per_principal"):
            await clients[3].session()
    finally:
        for c in clients:
            await c.close()
    async with hookwire.connect(tight.target, options=hookwire.ConnectOptions(session_max_bytes=4 * 1024 * 1024)) as big:
        with pytest.raises(hookwire.ResourceExhaustedError, match="max_buffered_bytes"):
            await big.session()
    await _healthy(tight)


async def test_hooks_per_principal(tight) -> None:
    clients = [_small(tight) for _ in range(2)]
    try:
        await clients[0].model("mlp").hook("fc1", posthook=hookwire.capture())
        await clients[0].model("mlp").hook("fc2", posthook=hookwire.capture())
        await clients[1].model("mlp").hook("fc1", posthook=hookwire.capture())
        with pytest.raises(hookwire.ResourceExhaustedError, match="max_hooks_per_principal"):
            await clients[1].model("mlp").hook("fc2", posthook=hookwire.capture())
    finally:
        for c in clients:
            await c.close()


async def test_infer_elements(tight) -> None:
    async with _small(tight) as c:
        with pytest.raises(hookwire.ResourceExhaustedError, match="1001 elements, over the limit of 1000"):
            await c.model("scale")(torch.zeros(1001))
    await _healthy(tight)


async def test_infer_deadline_and_queue(tight) -> None:
    async with _small(tight) as c:
        # The pass takes 1.2 s and infer_timeout is 0.5 s: only the deadline can end the call with this error.
        with pytest.raises(hookwire.DeadlineExceededError, match="infer_timeout"):
            await c.model("sleeper")(torch.tensor(1.2))
        await _healthy(tight)  # other models are served meanwhile
        await asyncio.sleep(1.0)  # let the stray pass end
        slow = [asyncio.ensure_future(c.model("sleeper")(torch.tensor(0.3))) for _ in range(3)]
        results = await asyncio.gather(*slow, return_exceptions=True)
        assert any(isinstance(r, hookwire.ResourceExhaustedError) and "max_queued_infers" in str(r) for r in results)
    await _healthy(tight)


async def test_message_size_limit(tight) -> None:
    async with hookwire.connect(tight.target, options=hookwire.ConnectOptions(max_message_bytes=64 << 20)) as c:
        request = hookwire.v1.model_service_pb2.InferRequest(model="scale")
        request.args.add().string_value = "x" * (9 * 1024 * 1024)
        with pytest.raises(Exception) as info:
            await c.model_stub.Infer(request)
        assert "RESOURCE_EXHAUSTED" in str(info.value)
    await _healthy(tight)


# ------------------------------------------------------------------ wide requests (issue #9, break 2)


def _wide_list(n: int) -> bytes:
    """An InferRequest for "scale" whose argument is a list of ``n`` empty Values, encoded
    directly (building n messages in Python would take the test longer than the server)."""
    items = b"\x0a\x00" * n  # ValueList.items: n empty Values
    value_list = b"\x12" + _varint(len(items)) + items  # Value.list
    return b"\x0a\x05scale" + b"\x12" + _varint(len(value_list)) + value_list


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


async def _raw_infer(target: str, payload: bytes) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(target, options=[("grpc.max_send_message_length", 1 << 30)]) as channel:
        call = channel.unary_unary("/hookwire.v1.ModelService/Infer")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(payload, timeout=120)
        return info.value


async def test_wide_flat_value_list(tight) -> None:
    # 1M empty Values (2 MB, no tensor elements): refused by count, not decoded.
    error = await _raw_infer(tight.target, _wide_list(1_000_000))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    assert "over the limit of 65536 (max_request_values)" in error.details()
    async with _small(tight) as c:
        wide_map = model_service_pb2.InferRequest(model="scale")
        entries = wide_map.args.add().map.entries
        for i in range(70_000):
            entries[str(i)].SetInParent()
        with pytest.raises(grpc.aio.AioRpcError, match="max_request_values") as info:
            await c.model_stub.Infer(wide_map)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        stream = c.model_stub.InferStream()
        wide = model_service_pb2.InferRequest(model="scale")
        wide.args.add().list.items.extend([hookwire.v1.tensor_pb2.Value()] * 70_000)
        await stream.write(model_service_pb2.InferStreamRequest(request=wide))
        await stream.done_writing()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stream.read()
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_request_values" in info.value.details()
    await _healthy(tight)


async def test_huge_wide_request_leaves_the_server_responsive(server) -> None:
    # 20M empty Values in 40 MB: once never answered and took 2.4 GB. Now it is refused
    # after a bounded scan off the event loop, and health checks answer meanwhile.
    big = asyncio.ensure_future(_raw_infer(server.target, _wide_list(20_000_000)))
    async with grpc.aio.insecure_channel(server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while not big.done():
            reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=60)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            await asyncio.sleep(0.01)
    error = await big
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    assert "max_request_values" in error.details()


# ------------------------------------------------------------------ request-scoped hooks (issue #9, break 7)


def _request_hook(module: str) -> hook_pb2.HookSpec:
    return hook_pb2.HookSpec(module=module, posthook=hook_pb2.HookAction(capture=[hook_pb2.PART_OUTPUT]))


async def test_request_hooks_per_call(tight) -> None:
    async with _small(tight) as c:
        request = model_service_pb2.InferRequest(model="mlp", args=[hookwire.wire.codec.encode_value(X)])
        request.hooks.extend([_request_hook("fc1")] * 4)
        with pytest.raises(grpc.aio.AioRpcError, match="over the limit of 3 \\(max_request_hooks\\)") as info:
            await c.model_stub.Infer(request)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        del request.hooks[3:]
        response = await c.model_stub.Infer(request)
        assert len(response.events) == 3
    await _healthy(tight)


async def test_events_per_call(tight) -> None:
    async with _small(tight) as c:
        # mlp has 6 modules (root, fc1, act, drop, fc2, out): a hook on ** makes 6 events, over 5.
        request = model_service_pb2.InferRequest(model="mlp", args=[hookwire.wire.codec.encode_value(X)],
                                                 hooks=[_request_hook("**")])
        with pytest.raises(grpc.aio.AioRpcError, match="more than 5 events.*max_events_per_call") as info:
            await c.model_stub.Infer(request)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        del request.hooks[:]
        request.hooks.extend([_request_hook("fc*"), _request_hook("fc*"), _request_hook("out")])
        response = await c.model_stub.Infer(request)
        assert len(response.events) == 5  # exactly at the limit: allowed
    await _healthy(tight)


async def test_many_request_hooks_leave_other_calls_served(server) -> None:
    # The most request hooks allowed, on every module: health and other models are answered meanwhile.
    async with hookwire.connect(server.target) as c, grpc.aio.insecure_channel(server.target) as channel:
        request = model_service_pb2.InferRequest(
            model="tiny-transformer", args=[hookwire.wire.codec.encode_value(torch.zeros(1, 4, dtype=torch.int64))],
            hooks=[_request_hook("**")] * 64,
        )
        busy = asyncio.ensure_future(c.model_stub.Infer(request))
        health = health_pb2_grpc.HealthStub(channel)
        while not busy.done():
            reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=60)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            assert (await c.model("scale")(torch.ones(2))).tolist() == [2.0, 2.0]
        response = await busy
        assert 0 < len(response.events) <= 4096
