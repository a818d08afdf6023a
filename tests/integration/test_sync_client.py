"""The synchronous client (hookwire.connect_sync) on a real server: it answers as the
async client does, in a plain thread and inside a running event loop (as in a Jupyter
kernel), raises the SDK's errors, cancels a blocked call on Ctrl-C, closes cleanly while
calls are in flight, keeps its client alive through the objects it returns, and runs as
a script that reproduces the README's quickstart."""

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
from typing import Any

import pytest
import torch

import hookwire
from hookwire_server.demo_models import tiny_lm
from support import LIVENESS, ServerThread, assert_same, token_batch

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _sync_session(target: str) -> dict[str, Any]:
    ids, mask = token_batch(3, 7, padded_from=5)
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


async def test_sync_client_matches_the_async_client(sdk_client: Any, sdk_server: ServerThread) -> None:
    ids, mask = token_batch(3, 7, padded_from=5)
    model = sdk_client.model("tiny-transformer")
    expected_out = await model(ids, attention_mask=mask)
    _, expected_cache = await model.run_with_cache(ids, attention_mask=mask, modules="encoder.layers.*")
    expected_gen = await sdk_client.model("tiny-lm").generate("Once upon a time", 4, seed=1)
    # Called from inside this test's running event loop, as a notebook cell would be.
    got = _sync_session(sdk_server.target)
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


def test_sync_client_in_a_plain_thread_and_after_close(sdk_server: ServerThread) -> None:
    box: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: box.update(_sync_session(sdk_server.target)), name="plain")
    worker.start()
    worker.join()
    assert box["thread"] == "plain" and len(box["events"]) == 2
    client = hookwire.connect_sync(sdk_server.target)
    assert [m.name for m in client.list_models()][:2] == ["mlp", "tiny-transformer"]
    client.close()
    client.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        client.list_models()


def test_sync_client_raises_the_sdk_errors_and_keeps_working(sdk_server: ServerThread) -> None:
    with hookwire.connect_sync(sdk_server.target) as client:
        with pytest.raises(hookwire.NotFoundError):
            client.model("nope").info()
        with pytest.raises(hookwire.InvalidArgumentError):
            client.model("mlp")(torch.ones(2, 3))
        assert client.model("mlp")(torch.ones(1, 8)).shape == (1, 4)


def test_ctrl_c_cancels_the_blocked_call(sdk_server: ServerThread) -> None:
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

    with hookwire.connect_sync(sdk_server.target) as client:
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


def test_the_sync_quickstart_script_reproduces_the_readme_quickstart(sdk_server: ServerThread) -> None:
    """docs/examples/quickstart_sync.py (the sync client alone) prints what the README's
    async quickstart prints."""

    def run(code: str) -> str:
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    readme = run(_readme_quickstart().replace("127.0.0.1:50051", sdk_server.target))
    script = (ROOT / "docs/examples/quickstart_sync.py").read_text()
    assert "connect_sync" in script and "async " not in script and "await " not in script
    synced = run(script.replace("127.0.0.1:50051", sdk_server.target))
    assert readme.splitlines() and synced.splitlines() == readme.splitlines()



def test_a_call_started_while_close_drains_does_not_hang(sdk_server: ServerThread) -> None:
    """Regression guard: SyncClient.close() cancels the tasks that exist when _drain starts, then
    stops the loop. A call another thread starts meanwhile (or between loop.stop and
    loop.close) gets a task nobody cancels or finishes: its thread waits on
    future.result() forever. It should get its result or "client is closed"."""
    client = hookwire.connect_sync(sdk_server.target)
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


def test_removing_a_hook_after_the_client_closed_is_a_no_op(sdk_server: ServerThread) -> None:
    """Regression guard: the async HookHandle.remove() answers False once the session is gone ("safe
    to repeat"), but SyncHookHandle.remove / __exit__ go through _Loop.run, which raises
    RuntimeError("this hookwire client is closed") first: a hook's ``with`` left after
    the client closed (or a cleanup remove() in a finally) raises, masking any error."""
    with hookwire.connect_sync(sdk_server.target) as client:
        hook = client.model("tiny-transformer").hook("encoder.layers.0", posthook=hookwire.capture("output"))
    assert hook.remove() is False  # the session's end removed it



def test_sync_objects_keep_their_client_alive(sdk_server: ServerThread) -> None:
    """Regression guard (_sync.py): SyncGenerateStream, SyncHookHandle, SyncSubscription,
    SyncHarvestJob and SyncIterator hold the client's _Loop but not the SyncClient; the
    new weakref finalizer closes the client (session, channel, loop) as soon as the
    SyncClient is collected. So a chained call's stream is dead on arrival:
    ``connect_sync(t).model("tiny-lm").generate(...)`` returns a stream whose result()
    raises "this hookwire client is closed" (and a hook handle returned the same way was
    removed with the session)."""
    stream = hookwire.connect_sync(sdk_server.target).model("tiny-lm").generate("Once upon a time", 2, seed=1)
    gc.collect()
    result = stream.result()
    assert [len(t) for t in result.token_ids] == [2]


def test_a_client_closed_on_its_loop_thread_fails_other_threads_calls(sdk_server: ServerThread) -> None:
    """_Loop.close on the loop's own thread (a callback, or the finalizer when a
    collection runs there) used to only stop the loop: other threads' pending calls were
    never failed and the session and channel stayed open. A thread iterating a hook's
    events must end when the client is closed from the loop thread."""
    client = hookwire.connect_sync(sdk_server.target)
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


def test_sync_client_uploads_names_and_deletes_an_operand(sdk_server: ServerThread) -> None:
    vector = torch.randn(64, generator=torch.Generator().manual_seed(5))
    ids = torch.tensor([[1, 2, 3]])
    with hookwire.connect_sync(sdk_server.target) as client:
        info = client.upload_operand("sync-steer", vector)
        assert (info.kind, info.shape, info.session_id) == ("tensor", (64,), client.session_id)
        model = client.model("tiny-lm")
        spec = hookwire.HookSpec("model.layers.0", posthook=hookwire.edit(capture=("output",)))
        plain = model.infer(ids, hooks=[spec]).events[0].output
        steered = model.infer(ids, hooks=[hookwire.HookSpec("model.layers.0", posthook=hookwire.edit(
            hookwire.rules.add("output", hookwire.rules.operand("sync-steer")), capture=("output",)))]).events[0].output
        assert torch.equal(steered, plain + vector)
        assert "sync-steer" in [op.name for op in client.list_operands()]
        assert client.delete_operand("sync-steer") == 64 * 4
        assert "sync-steer" not in [op.name for op in client.list_operands()]
