"""The hosted models: one ModelHost per model, each with its own worker thread.

A model's forward passes, and every change to its torch hooks, run on that
model's single worker thread: train/eval mode and the hook dictionaries are
module state, so one thread owning them makes them race-free, while other
models and the event loop carry on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from typing import TYPE_CHECKING, Any, Callable, Iterable, TypeVar

import torch
from torch import nn

from hookwire import _codec
from hookwire.v1 import model_service_pb2

from .errors import InvalidArgument, NotFound
from .module_patterns import match_paths

if TYPE_CHECKING:
    from .inference import Pass

T = TypeVar("T")


def _wire_dtype_or_unspecified(dtype: Any) -> int:
    try:
        return _codec.wire_dtype_of(dtype)
    except _codec.CodecError:
        return 0  # DTYPE_UNSPECIFIED: a parameter dtype the wire cannot carry (e.g. complex)


class ModelHost:
    """One hosted model and the thread that runs it."""

    def __init__(self, name: str, module: nn.Module, *, description: str = "", training_allowed: bool = True) -> None:
        if not name:
            raise ValueError("a model needs a name")
        self.name = name
        self.module = module.eval()
        self.description = description
        self.training_allowed = training_allowed
        self.modules: dict[str, nn.Module] = dict(module.named_modules())
        self.paths: list[str] = list(self.modules)
        self._path_of: dict[int, str] = {id(m): p for p, m in self.modules.items()}
        first = next(module.parameters(), None)
        #: Where rule operands are decoded to (the device of the model's first parameter).
        self.device = first.device if first is not None else torch.device("cpu")
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"model:{name}")
        #: The pass running on the worker thread, read by hooks as they fire.
        self.current_pass: Pass | None = None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs ``fn(*args)`` on the model's worker thread, after what is queued there."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    def resolve(self, pattern: str) -> list[str]:
        """The module paths ``pattern`` names; NotFound when none."""
        try:
            found = match_paths(pattern, self.paths)
        except ValueError as exc:
            raise InvalidArgument(f"module: {exc}") from None
        if not found:
            if "*" in pattern or "?" in pattern:
                raise NotFound(f"pattern {pattern!r} matches no module of model {self.name!r}")
            raise NotFound(f"model {self.name!r} has no module {pattern!r}")
        return found

    def path_of(self, module: nn.Module) -> str | None:
        """The path of one of this model's modules, or None."""
        return self._path_of.get(id(module))

    def describe(self, *, with_modules: bool) -> model_service_pb2.Model:
        """The model as the wire describes it."""
        msg = model_service_pb2.Model(
            name=self.name, description=self.description, training_allowed=self.training_allowed
        )
        if with_modules:
            for path, mod in self.modules.items():
                info = msg.modules.add(path=path, type=type(mod).__name__)
                for pname, param in mod.named_parameters(recurse=False):
                    info.parameters.add(
                        name=pname,
                        shape=list(param.shape),
                        dtype=_wire_dtype_or_unspecified(param.dtype),
                        requires_grad=param.requires_grad,
                    )
        return msg

    def shutdown(self) -> None:
        """Stops the worker thread once queued work is done."""
        self._executor.shutdown(wait=False, cancel_futures=True)


class ModelRegistry:
    """Models by name."""

    def __init__(self, hosts: Iterable[ModelHost] = ()) -> None:
        self._hosts: dict[str, ModelHost] = {}
        for host in hosts:
            self.add(host)

    def add(self, host: ModelHost) -> None:
        """Hosts one more model; ValueError on a duplicate name."""
        if host.name in self._hosts:
            raise ValueError(f"two models are named {host.name!r}")
        self._hosts[host.name] = host

    def get(self, name: str) -> ModelHost:
        """The model named ``name``; NotFound otherwise."""
        if not name:
            raise InvalidArgument("no model named: the model field is empty")
        host = self._hosts.get(name)
        if host is None:
            raise NotFound(f"no model {name!r} (hosted: {', '.join(sorted(self._hosts)) or 'none'})")
        return host

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._hosts.values())

    def __len__(self) -> int:
        return len(self._hosts)

    def shutdown(self) -> None:
        """Stops every model's worker thread."""
        for host in self._hosts.values():
            host.shutdown()
