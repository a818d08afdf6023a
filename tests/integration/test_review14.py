"""Review of issue #14 (researcher ergonomics): failing tests for bugs found in
run_with_cache / ActivationCache, Subscription.events, HookHandle.events(timeout=)
and the synchronous client. Real server on loopback, demo models."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import hookwire
from hookwire_server.model_registry import ModelHost
from support import Recorder, ServerThread, assert_same, build_test_registry

#: A hang guard only, never a speed assertion.
LIVENESS = 60.0


class Twice(nn.Module):
    """One Linear called twice in a pass (a shared module, as tied or recurrent blocks)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.shared = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.shared(torch.tanh(self.shared(x)))))


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    registry = build_test_registry()
    registry.add(ModelHost("twice", Twice()))
    srv = ServerThread(registry).start()
    yield srv
    srv.stop()


@pytest.fixture
async def client(server: ServerThread) -> Any:
    async with hookwire.connect(server.target) as c:
        yield c


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (2, 7), generator=gen)
    mask = torch.ones(2, 7, dtype=torch.bool)
    return ids, mask


# ---------------------------------------------------------------- run_with_cache keys


async def test_cache_gradient_of_a_shared_module_is_keyed_with_its_forward_call(client: Any) -> None:
    """Bug: the server counts backward call_index in autograd order (the second forward
    call's gradient fires first), and ActivationCache keys it as it comes, so
    cache["shared:grad_output"] is the gradient of the call keyed "shared#1", not of
    the call keyed "shared". activation x gradient (attribution patching) then pairs
    the wrong calls."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    local = Twice().eval()
    recorder = Recorder()
    recorder.hook(local, "shared", "forward")
    recorder.hook(local, "shared", "backward")
    local(x).sum().backward()
    recorder.remove()
    forward = [e for e in recorder.events if e["phase"] == "forward"]
    backward = [e for e in recorder.events if e["phase"] != "forward"]
    # In-process: the first backward firing is the second forward call's (autograd order).
    assert len(forward) == 2 and len(backward) == 2

    _, cache = await client.model("twice").run_with_cache(
        x, modules="shared", parts=("output", "grad_output"), backward=hookwire.Backward(),
    )
    assert_same(cache["shared"], forward[0]["output"], "shared")
    # The gradient keyed like the first call must be the first call's gradient.
    assert_same(cache["shared:grad_output"], backward[1]["grad_output"], "shared:grad_output")


async def test_cache_holds_only_what_it_was_asked_to_cache(client: Any) -> None:
    """Bug: ActivationCache.from_result keys every event of the call, the captures of
    the caller's own ``hooks=`` included: a reduced capture of another module lands in
    the cache as if run_with_cache had cached it, and stack() over the layers fails."""
    ids, mask = _inputs()
    side = hookwire.HookSpec("encoder.layers.0", posthook=hookwire.capture("output", select="[:, -1]"))
    _, cache = await client.model("tiny-transformer").run_with_cache(
        ids, attention_mask=mask, modules="encoder.layers.1", hooks=[side],
    )
    assert list(cache) == ["encoder.layers.1"]


# ---------------------------------------------------------------- events across timeouts / cancels


async def test_sessionless_hook_keeps_events_across_idle_timeouts(client: Any) -> None:
    """Bug: HookHandle.events(timeout=) says events that come after a timeout "stay
    queued for the next one"; for a hook without a session (ttl_seconds) every
    events() call opens a new Subscribe and closes it on the timeout, so a call that
    runs between two iterations is lost."""
    ids, mask = _inputs()
    model = client.model("tiny-transformer")
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


async def test_subscription_survives_a_cancelled_read(client: Any, server: ServerThread) -> None:
    """Bug: a read of Subscription.events without a timeout awaits the stream's own
    iterator; cancelling it (a task cancelled, the sync client's Ctrl-C) throws
    CancelledError into stream_items and grpc cancels the RPC, and every later
    iteration ends at once, silently, as if all hooks were removed. The timeout path
    keeps its read in a future (self._next) and survives."""
    ids, mask = _inputs()
    model = client.model("tiny-transformer")
    async with hookwire.connect(server.target) as other:
        async with model.hook("encoder.layers.0", posthook=hookwire.capture("output"), scope="all") as hook:
            async with client.subscribe([hook.id]) as sub:
                reader = asyncio.ensure_future(sub.events().__anext__())
                await asyncio.sleep(0.3)  # let it block on the stream (nothing is coming)
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader
                call = await other.model("tiny-transformer").infer(ids, attention_mask=mask)
                seen = [e.request_id async for e in sub.events(until=call, timeout=LIVENESS)]
                assert seen == [call.request_id]


# ---------------------------------------------------------------- the synchronous client


def test_a_call_started_while_close_drains_does_not_hang(server: ServerThread) -> None:
    """Bug: SyncClient.close() cancels the tasks that exist when _drain starts, then
    stops the loop. A call another thread starts meanwhile (or between loop.stop and
    loop.close) gets a task nobody cancels or finishes: its thread waits on
    future.result() forever. It should get its result or "client is closed"."""
    client = hookwire.connect_sync(server.target)
    assert client.list_models()
    draining = threading.Event()

    async def slow_to_cancel() -> None:  # a call whose cleanup takes a moment (a stream ending)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            draining.set()
            await asyncio.sleep(1.0)
            raise

    def hold() -> None:
        with contextlib.suppress(BaseException):
            client.run(slow_to_cancel())

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    closer = threading.Thread(target=client.close, daemon=True)
    closer.start()
    assert draining.wait(LIVENESS)
    outcome: list[Any] = []

    def late_call() -> None:
        try:
            outcome.append(client.run(asyncio.sleep(3.0, result="done")))
        except BaseException as exc:  # noqa: BLE001 - any answer is fine, only a hang is not
            outcome.append(exc)

    late = threading.Thread(target=late_call, daemon=True)
    late.start()
    late.join(LIVENESS)
    closer.join(LIVENESS)
    assert not late.is_alive(), "a call made while the client was closing never returned"
    assert outcome


def test_removing_a_hook_after_the_client_closed_is_a_no_op(server: ServerThread) -> None:
    """Bug: the async HookHandle.remove() answers False once the session is gone ("safe
    to repeat"), but SyncHookHandle.remove / __exit__ go through _Loop.run, which raises
    RuntimeError("this hookwire client is closed") first: a hook's ``with`` left after
    the client closed (or a cleanup remove() in a finally) raises, masking any error."""
    with hookwire.connect_sync(server.target) as client:
        hook = client.model("tiny-transformer").hook("encoder.layers.0", posthook=hookwire.capture("output"))
    assert hook.remove() is False  # the session's end removed it
