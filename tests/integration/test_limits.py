"""Every limit answers with a clear status naming it, and the server goes on serving."""

from __future__ import annotations

import asyncio
import time
from typing import Iterator

import pytest
import torch

import hookwire
from hookwire_server import ServerSettings
from support import ServerThread, build_test_registry

X = torch.randn(1, 8)


@pytest.fixture(scope="module")
def tight() -> Iterator[ServerThread]:
    settings = ServerSettings(
        port=0, max_hooks_per_session=2, max_hooks_per_principal=3, max_rules_per_action=2,
        max_sessions_per_principal=3, max_streams_per_principal=4, max_buffered_bytes=3 * 1024 * 1024,
        max_infer_elements=1000, max_queued_infers=1, infer_timeout=0.5, max_message_bytes=8 * 1024 * 1024,
    )
    srv = ServerThread(build_test_registry(), settings).start()
    yield srv
    srv.stop()


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
        with pytest.raises(hookwire.InvalidArgumentError, match="3 rules, over the limit of 2"):
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
        started = time.monotonic()
        with pytest.raises(hookwire.DeadlineExceededError, match="infer_timeout"):
            await c.model("sleeper")(torch.tensor(1.2))
        assert time.monotonic() - started < 1.1
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
