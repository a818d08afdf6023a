"""Shared test helpers: extra models, a server in a background thread, in-process oracles."""

from __future__ import annotations

import asyncio
import os
import pathlib
import threading
import time
from typing import Any, Callable

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


def local_models() -> dict[str, nn.Module]:
    """Fresh in-process copies of the demo models (same seeds, same weights as the server's)."""
    return {"mlp": mlp(), "tiny-transformer": tiny_transformer()}


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
