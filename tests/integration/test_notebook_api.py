"""The notebook-facing SDK on a real server: run_with_cache (equal to in-process torch
hooks, bit for bit), event iterators that end (a call's end marker, an idle timeout),
and the synchronous client (hookwire.connect_sync) in a plain thread, inside a running
event loop (as in a Jupyter kernel), with Ctrl-C, and as a script that reproduces the
README's quickstart."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import pathlib
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import hookwire
from hookwire.rules import add
from hookwire_server.demo_models import tiny_lm
from hookwire_server.models.model_registry import ModelHost
from support import Recorder, ServerThread, assert_same, build_test_registry, local_models

ROOT = pathlib.Path(__file__).resolve().parents[2]


class Twice(nn.Module):
    """One Linear called twice in a pass (a shared module): its captures are keyed #0, #1."""

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
    mask[1, 5:] = False
    return ids, mask


# ---------------------------------------------------------------- run_with_cache


async def test_run_with_cache_every_module_equals_in_process_hooks(client: Any) -> None:
    ids, mask = _inputs()
    local = local_models()["tiny-transformer"].eval()
    recorder = Recorder()
    paths = [p for p, _ in local.named_modules()]  # "**" matches the root ("") too
    for path in paths:
        recorder.hook(local, path, "forward")
    with torch.no_grad():
        expected_out = local(ids, attention_mask=mask)
    recorder.remove()

    out, cache = await client.model("tiny-transformer").run_with_cache(ids, attention_mask=mask, modules="**")
    assert_same(out, expected_out, "output")
    # The k-th call of a module that runs more than once (dropout here) is key "path#k";
    # containers (a ModuleList) never run and have none.
    calls: dict[str, int] = {}
    expected = {}
    for seen in recorder.events:
        k = calls[seen["module"]] = calls.get(seen["module"], -1) + 1
        expected[seen["module"] + (f"#{k}" if k else "")] = seen["output"]
    assert any(k > 0 for k in calls.values())
    assert list(cache) == list(expected)
    assert list(cache.modules) == list(calls)
    for key, value in expected.items():
        assert_same(cache[key], value, key)
    layers = cache.stack("encoder.layers.*")
    assert layers.shape == (2, *cache["encoder.layers.0"].shape)
    assert torch.equal(layers[1], cache["encoder.layers.1"])
    assert cache.keys_matching("encoder.layers.*") == ["encoder.layers.0", "encoder.layers.1"]
    assert "encoder.layers.0" in repr(cache) and cache.nbytes > 0


async def test_run_with_cache_args_kwargs_and_gradients(client: Any) -> None:
    ids, mask = _inputs()
    local = local_models()["tiny-transformer"].eval()
    recorder = Recorder()
    for path in ("encoder.layers.0", "encoder.layers.1"):
        recorder.hook(local, path, "forward", with_kwargs=True)
        recorder.hook(local, path, "backward")
    expected = local(ids, attention_mask=mask)
    expected["logits"].sum().backward()
    recorder.remove()

    _, cache = await client.model("tiny-transformer").run_with_cache(
        ids, attention_mask=mask, modules="encoder.layers.*",
        parts=("output", "args", "kwargs", "grad_output", "grad_input"), backward=hookwire.Backward("logits"),
    )
    for seen in recorder.events:
        path = seen["module"]
        if seen["phase"] == "forward":
            assert_same(cache[path], seen["output"], path)
            assert_same(cache[f"{path}:args"], seen["args"], f"{path}:args")
            assert_same(cache[f"{path}:kwargs"], seen["kwargs"], f"{path}:kwargs")
        else:
            assert_same(cache[f"{path}:grad_output"], seen["grad_output"], f"{path}:grad_output")
            assert_same(cache[f"{path}:grad_input"], seen["grad_input"], f"{path}:grad_input")


async def test_run_with_cache_keys_each_call_of_a_shared_module(client: Any) -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    local = Twice().eval()
    recorder = Recorder()
    recorder.hook(local, "shared", "forward")
    with torch.no_grad():
        local(x)
    recorder.remove()
    _, cache = await client.model("twice").run_with_cache(x, modules=["shared", "head"])
    assert list(cache) == ["shared", "shared#1", "head"]
    assert_same(cache["shared"], recorder.events[0]["output"])
    assert_same(cache["shared#1"], recorder.events[1]["output"])
    assert cache.modules == ("shared", "head")


async def test_run_with_cache_select_cast_and_steering_hooks(client: Any) -> None:
    ids, mask = _inputs()
    model = client.model("tiny-transformer")
    _, plain = await model.run_with_cache(ids, attention_mask=mask, modules="encoder.layers.1")
    _, reduced = await model.run_with_cache(
        ids, attention_mask=mask, modules="encoder.layers.1", select="[:, -1]", cast="bfloat16",
    )
    assert torch.equal(reduced["encoder.layers.1"], plain["encoder.layers.1"][:, -1].to(torch.bfloat16))
    # Hooks passed along run first: a steering rule on layer 0 changes what layer 1 caches.
    steer = hookwire.HookSpec("encoder.layers.0", posthook=[add("output", torch.ones(32))])
    _, steered = await model.run_with_cache(ids, attention_mask=mask, modules="encoder.layers.1", hooks=[steer])
    local = local_models()["tiny-transformer"].eval()
    local.encoder.layers[0].register_forward_hook(lambda m, a, o: o + torch.ones(32))
    recorder = Recorder()
    recorder.hook(local, "encoder.layers.1", "forward")
    with torch.no_grad():
        local(ids, attention_mask=mask)
    assert_same(steered["encoder.layers.1"], recorder.events[0]["output"])


async def test_run_with_cache_refuses_bad_arguments_before_sending(client: Any) -> None:
    model = client.model("tiny-transformer")
    ids, _ = _inputs()
    with pytest.raises(ValueError, match="unknown part"):
        await model.run_with_cache(ids, parts="outputs")
    with pytest.raises(ValueError, match="backward"):
        await model.run_with_cache(ids, parts="grad_output")
    with pytest.raises(ValueError, match="modules"):
        await model.run_with_cache(ids, modules=[])
    with pytest.raises(hookwire.NotFoundError):
        await model.run_with_cache(ids, modules="no.such.module")
    _, cache = await model.run_with_cache(ids, modules="encoder.layers.0")
    with pytest.raises(KeyError, match="encoder.layers.0"):
        cache["encoder.layers"]
    with pytest.raises(ValueError, match="no cache key"):
        cache.stack("decoder.*")


# ---------------------------------------------------------------- iterators that end


async def test_events_end_at_the_calls_marker_or_after_an_idle_timeout(client: Any) -> None:
    ids, mask = _inputs()
    model = client.model("tiny-transformer")
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


async def test_subscription_timeout_keeps_the_read_in_flight(client: Any, server: ServerThread) -> None:
    ids, mask = _inputs()
    model = client.model("tiny-transformer")
    async with hookwire.connect(server.target) as other:
        async with model.hook("encoder.layers.0", posthook=hookwire.capture("output"), scope="all") as hook:
            async with client.subscribe([hook.id]) as sub:
                assert [e async for e in sub.events(timeout=0.05)] == []
                call = await other.model("tiny-transformer").infer(ids, attention_mask=mask)
                seen = [e.request_id async for e in sub.events(until=call)]
                assert seen == [call.request_id]


# ---------------------------------------------------------------- the synchronous client


def _sync_session(target: str) -> dict[str, Any]:
    ids, mask = _inputs()
    with hookwire.connect_sync(target) as client:
        model = client.model("tiny-transformer")
        out = model(ids, attention_mask=mask)
        result = model.infer(ids, attention_mask=mask, hooks=[hookwire.HookSpec("encoder.layers.0", posthook=hookwire.capture("output"))])
        _, cache = model.run_with_cache(ids, attention_mask=mask, modules="encoder.layers.*")
        with model.hook("encoder.layers.*", posthook=hookwire.capture("output")) as hook:
            call = model.infer(ids, attention_mask=mask)
            events = list(hook.events(until=call))
            assert client.list_hooks(session_id=client.session_id)
        assert hook.remove() is False  # removed on exit
        weights = client.model("tiny-lm").parameters("model.norm.weight", "lm_head.weight")
        generated = client.model("tiny-lm").generate("Once upon a time", 4, seed=1).result()
        streamed = [type(item).__name__ for item in client.model("tiny-lm").generate("Once", 2, seed=1)]
        return {"out": out, "result": result, "cache": cache, "events": events, "generated": generated,
                "streamed": streamed, "weights": weights, "thread": threading.current_thread().name}


async def test_sync_client_matches_the_async_client(client: Any, server: ServerThread) -> None:
    ids, mask = _inputs()
    model = client.model("tiny-transformer")
    expected_out = await model(ids, attention_mask=mask)
    _, expected_cache = await model.run_with_cache(ids, attention_mask=mask, modules="encoder.layers.*")
    expected_gen = await client.model("tiny-lm").generate("Once upon a time", 4, seed=1)
    # Called from inside this test's running event loop, as a notebook cell would be.
    got = _sync_session(server.target)
    assert_same(got["out"], expected_out)
    assert_same(got["result"].events[0].output, expected_cache["encoder.layers.0"])
    assert list(got["cache"]) == list(expected_cache)
    for key in expected_cache:
        assert_same(got["cache"][key], expected_cache[key], key)
    assert [e.module for e in got["events"]] == ["encoder.layers.0", "encoder.layers.1"]
    assert got["generated"].texts == expected_gen.texts
    assert got["streamed"].count("GeneratedTokens") == 2
    local_lm = tiny_lm()
    assert list(got["weights"]) == ["model.norm.weight", "lm_head.weight"]
    assert torch.equal(got["weights"]["lm_head.weight"], local_lm.lm_head.weight)


def test_sync_client_in_a_plain_thread_and_after_close(server: ServerThread) -> None:
    box: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: box.update(_sync_session(server.target)), name="plain")
    worker.start()
    worker.join()
    assert box["thread"] == "plain" and len(box["events"]) == 2
    client = hookwire.connect_sync(server.target)
    assert [m.name for m in client.list_models()][:2] == ["mlp", "tiny-transformer"]
    client.close()
    client.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        client.list_models()


def test_sync_client_raises_the_sdk_errors_and_keeps_working(server: ServerThread) -> None:
    with hookwire.connect_sync(server.target) as client:
        with pytest.raises(hookwire.NotFoundError):
            client.model("nope").info()
        with pytest.raises(hookwire.InvalidArgumentError):
            client.model("mlp")(torch.ones(2, 3))
        assert client.model("mlp")(torch.ones(1, 8)).shape == (1, 4)


def test_ctrl_c_cancels_the_blocked_call(server: ServerThread) -> None:
    started = threading.Event()
    cancelled = threading.Event()

    async def forever() -> None:
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    def press_ctrl_c() -> None:
        started.wait()
        # A real SIGINT (as a terminal's Ctrl-C or Jupyter's "interrupt kernel" sends):
        # it wakes the main thread from its wait, where _thread.interrupt_main would not.
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

    with hookwire.connect_sync(server.target) as client:
        presser = threading.Thread(target=press_ctrl_c)
        presser.start()
        with pytest.raises(KeyboardInterrupt):
            client.run(forever())
        presser.join()
        assert cancelled.wait(60)
        assert client.model("mlp")(torch.ones(1, 8)).shape == (1, 4)  # the client still works


def test_with_on_the_async_client_says_what_to_use() -> None:
    with pytest.raises(TypeError, match="connect_sync"):
        with hookwire.connect("127.0.0.1:1"):
            pass


def _readme_quickstart() -> str:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Quickstart \(Python SDK\)\s+```python\n(.*?)```", text, re.S)
    assert block is not None
    return block.group(1)


def test_the_sync_quickstart_script_reproduces_the_readme_quickstart(server: ServerThread) -> None:
    """docs/examples/quickstart_sync.py (the sync client alone) prints what the README's
    async quickstart prints."""

    def run(code: str) -> str:
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    readme = run(_readme_quickstart().replace("127.0.0.1:50051", server.target))
    script = (ROOT / "docs/examples/quickstart_sync.py").read_text()
    assert "connect_sync" in script and "async " not in script and "await " not in script
    synced = run(script.replace("127.0.0.1:50051", server.target))
    assert readme.splitlines() and synced.splitlines() == readme.splitlines()


async def test_progress_shows_a_bar_for_a_large_cache_and_streams(
    client: Any, capsys: pytest.CaptureFixture[str],
) -> None:
    x = torch.arange(3 * 2**20, dtype=torch.float32).reshape(3, 2**20)  # 12 MiB in, 12 MiB captured
    model = client.model("scale")
    out, cache = await model.run_with_cache(x, modules="**", progress=True)
    err = capsys.readouterr().err
    assert "scale: reply" in err and "MiB" in err
    assert torch.equal(cache[""], x * 2) and torch.equal(out, x * 2)
    # Small replies draw nothing, and stream=False / True give the same result.
    small = torch.ones(2, 3)
    unary = await model.infer(small, stream=False, hooks=[hookwire.HookSpec("", posthook=hookwire.capture("output"))])
    streamed = await model.infer(small, stream=True, progress=True,
                                 hooks=[hookwire.HookSpec("", posthook=hookwire.capture("output"))])
    assert "reply" not in capsys.readouterr().err
    assert torch.equal(unary.events[0].output, streamed.events[0].output)

# ---------------------------------------------------------------- review findings (#14)

#: A hang guard only, never a speed assertion.
LIVENESS = 60.0


def _full_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """As _inputs, without padding."""
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, 64, (2, 7), generator=gen), torch.ones(2, 7, dtype=torch.bool)


# ---------------------------------------------------------------- run_with_cache keys


async def test_cache_gradient_of_a_shared_module_is_keyed_with_its_forward_call(client: Any) -> None:
    """Bug: the server counts backward call_index in autograd order (the second forward
    call's gradient fires first), and ActivationCache keys it as it comes, so
    cache["shared:grad_output"] is the gradient of the call keyed "shared#1", not of
    the call keyed "shared". activation x gradient (attribution patching) then pairs
    the wrong calls."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    forward, backward = _local_grads(Twice().eval(), x)
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
    ids, mask = _full_inputs()
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
    ids, mask = _full_inputs()
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
    ids, mask = _full_inputs()
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


# ---------------------------------------------------------------- second review (#14 fixes)


def _local_grads(model: nn.Module, x: torch.Tensor) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    recorder = Recorder()
    recorder.hook(model, "shared", "forward")
    recorder.hook(model, "shared", "backward")
    model(x).sum().backward()
    recorder.remove()
    forward = [e for e in recorder.events if e["phase"] == "forward"]
    backward = [e for e in recorder.events if e["phase"] != "forward"]
    return forward, backward


# ---------------------------------------------------------------- run_with_cache gradient keys


async def test_cache_gradient_keys_with_overlapping_module_patterns(client: Any) -> None:
    """Bug (_cache.py from_result): the backward remap counts a module's backward events
    over all the cache's hooks (n), but the server counts call_index per hook. Two
    patterns matching the same module (run_with_cache sends one hook per pattern) give
    n = 2 x calls: Twice's "shared" gradients are keyed #3 and #2, and
    cache["shared:grad_output"] does not exist."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    forward, backward = _local_grads(Twice().eval(), x)
    assert len(forward) == 2 and len(backward) == 2
    _, cache = await client.model("twice").run_with_cache(
        x, modules=["shared", "*"], parts=("output", "grad_output"), backward=hookwire.Backward(),
    )
    assert_same(cache["shared"], forward[0]["output"], "shared")
    assert_same(cache["shared#1"], forward[1]["output"], "shared#1")
    assert "shared:grad_output#2" not in cache and "shared:grad_output#3" not in cache, list(cache)
    assert_same(cache["shared:grad_output"], backward[1]["grad_output"], "shared:grad_output")
    assert_same(cache["shared:grad_output#1"], backward[0]["grad_output"], "shared:grad_output#1")


# ---------------------------------------------------------------- Subscription's read in flight


async def test_subscription_closed_while_another_task_iterates_ends_it(client: Any) -> None:
    """Bug (_client.py Subscription.events/aclose): aclose() cancels self._next and sets
    it to None while a reader awaits asyncio.wait((self._next,)); the reader wakes and
    runs ``self._next.result()`` on None: AttributeError instead of a quiet end. The same
    happens through HookHandle.remove() (it aclose()s the handle's subscription) while
    another task or thread iterates hook.events(), and SyncSubscription.close() from
    another thread."""
    model = client.model("tiny-transformer")
    async with model.hook("encoder.layers.0", posthook=hookwire.capture("output"), scope="all") as hook:
        sub = client.subscribe([hook.id])
        await sub.start()

        async def read() -> list[Any]:
            return [e async for e in sub.events()]

        reader = asyncio.ensure_future(read())
        await asyncio.sleep(0.3)  # blocked on the stream: nothing is coming
        await sub.aclose()
        assert await asyncio.wait_for(reader, LIVENESS) == []


async def test_two_iterations_of_one_subscription_at_once(client: Any, server: ServerThread) -> None:
    """Bug (_client.py Subscription.events): two readers share self._next; the first to
    wake takes the item and sets self._next = None (or a new, pending read), and the
    other then calls .result() on None (AttributeError) or on a pending future
    (InvalidStateError). Each event should go to one reader, with no error."""
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(3))
    model = client.model("tiny-transformer")
    async with hookwire.connect(server.target) as other:
        async with model.hook("encoder.layers.0", posthook=hookwire.capture("output"), scope="all") as hook:
            async with client.subscribe([hook.id]) as sub:

                async def read() -> list[str]:
                    return [e.request_id async for e in sub.events(timeout=3.0)]

                readers = [asyncio.ensure_future(read()) for _ in range(2)]
                await asyncio.sleep(0.3)
                call = await other.model("tiny-transformer").infer(ids)
                got = await asyncio.wait_for(asyncio.gather(*readers), LIVENESS)
                assert sorted(got[0] + got[1]) == [call.request_id]


# ---------------------------------------------------------------- the synchronous client


def test_sync_objects_keep_their_client_alive(server: ServerThread) -> None:
    """Bug (_sync.py): SyncGenerateStream, SyncHookHandle, SyncSubscription,
    SyncHarvestJob and SyncIterator hold the client's _Loop but not the SyncClient; the
    new weakref finalizer closes the client (session, channel, loop) as soon as the
    SyncClient is collected. So a chained call's stream is dead on arrival:
    ``connect_sync(t).model("tiny-lm").generate(...)`` returns a stream whose result()
    raises "this hookwire client is closed" (and a hook handle returned the same way was
    removed with the session)."""
    stream = hookwire.connect_sync(server.target).model("tiny-lm").generate("Once upon a time", 2, seed=1)
    gc.collect()
    result = stream.result()
    assert [len(t) for t in result.token_ids] == [2]


def test_a_client_closed_on_its_loop_thread_fails_other_threads_calls(server: ServerThread) -> None:
    """_Loop.close on the loop's own thread (a callback, or the finalizer when a
    collection runs there) used to only stop the loop: other threads' pending calls were
    never failed and the session and channel stayed open. A thread iterating a hook's
    events must end when the client is closed from the loop thread."""
    client = hookwire.connect_sync(server.target)
    hook = client.model("tiny-transformer").hook("encoder.layers.0", posthook=hookwire.capture("output"))
    outcome: list[Any] = []

    def iterate() -> None:
        try:
            outcome.extend(hook.events())
        except BaseException as exc:  # noqa: BLE001 - any end is fine; hanging is not
            outcome.append(exc)

    reader = threading.Thread(target=iterate, daemon=True)
    reader.start()
    client.loop.call_soon_threadsafe(client.close)
    reader.join(LIVENESS)
    assert not reader.is_alive(), "the reader's call was never failed after the client closed"
    assert hook.remove() is False  # closed: a no-op
