"""Asynchronous captures: a capture on an accelerator starts its device-to-host copy and
returns, and the event is encoded once the copy has completed (#15).

Why: a capture that copies a CUDA tensor to the host inside the hook makes the forward
pass wait for the device to finish every kernel queued so far and for the transfer,
at every hooked module. Instead, the hook

- runs the capture's selection and cast on the device (fewer bytes to move),
- starts one copy per tensor into pinned host memory with ``non_blocking=True`` on the
  device's current stream, so the copy is ordered after the kernel that produced the
  tensor and before every kernel queued after the hook (a later in-place kernel cannot
  change what was captured), and records a CUDA event after the copies,
- keeps the device tensors alive until the event has completed, and queues the rest of
  the capture (numbering, encoding, delivery) to run when it has.

The queue belongs to the pass (``batching.Batch.deferred``) and runs on the model's
worker thread, in firing order: the front of the queue is finished whenever a later
hook fires and its copies are done (``poll``), and everything left is finished when
the forward (and backward) pass ends, before the call's response and its CallEnded
marker (``finish``). Events therefore keep their order, numbering and delivery
guarantees; they only leave a little later. A failed shared pass drops the queue with
the held events (``drop``).

On the CPU nothing changes unless the model's ``async_captures`` is "on" (then the
tensors are cloned instead of copied, and encoding leaves the hot path of the forward:
the same queue, exercised without a GPU).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping
from typing import Any, Callable

import torch

@dataclasses.dataclass
class _Pending:
    #: One event per device whose copies it waits for (empty: ready now).
    events: list[Any]
    finish: Callable[[], None]
    #: The device tensors being copied, alive until the copies complete.
    keep: list[torch.Tensor]

    def ready(self) -> bool:
        return all(event.query() for event in self.events)

    def wait(self) -> None:
        for event in self.events:
            event.synchronize()


class DeferredCaptures:
    """A pass's captures whose copies are in flight, finished in firing order. Worker thread only."""

    def __init__(self) -> None:
        self._queue: collections.deque[_Pending] = collections.deque()
        #: Whether a capture is being finished now (a failure in it may disable its hook,
        #: which must not finish the rest of the queue from inside: see HookRecord._disable).
        self.running = False

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, events: list[Any], keep: list[torch.Tensor], finish: Callable[[], None]) -> None:
        """Queues ``finish`` to run once ``events`` have completed (after every capture queued before it)."""
        self._queue.append(_Pending(events, finish, keep))

    def poll(self) -> None:
        """Finishes the captures at the front whose copies are done, without waiting."""
        queue = self._queue
        while queue and queue[0].ready():
            pending = queue.popleft()
            self.running = True
            try:
                pending.finish()
            finally:
                self.running = False

    def finish(self, *, raise_errors: bool = True) -> None:
        """Waits for every copy in flight and finishes every capture, in order. The first
        error (a request-scoped capture that cannot be sent fails its call) is raised after
        the rest are finished, unless ``raise_errors`` is false (a pass that already failed)."""
        error: BaseException | None = None
        while self._queue:
            pending = self._queue.popleft()
            self.running = True
            try:
                pending.wait()
                pending.finish()
            except Exception as exc:  # the others still go out, as they would have without deferral
                error = error or exc
            finally:
                self.running = False
        if error is not None and raise_errors:
            raise error

    def drop(self) -> None:
        """Forgets the queued captures (a failed shared pass: its calls run again alone)."""
        self._queue.clear()


def wants_deferral(mode: str, value: Any) -> bool:
    """Whether a capture of ``value`` is deferred under ``mode``: "auto" when a tensor in
    it is on an accelerator, "on" for any tensor, "off" never."""
    if mode == "off":
        return False
    return _any_tensor(value, accelerator_only=mode == "auto")


def _any_tensor(value: Any, *, accelerator_only: bool) -> bool:
    if isinstance(value, torch.Tensor):
        return value.device.type != "cpu" or not accelerator_only
    if isinstance(value, (tuple, list)):  # named tuples and torch.return_types too
        return any(_any_tensor(v, accelerator_only=accelerator_only) for v in value)
    if isinstance(value, Mapping):
        return any(_any_tensor(v, accelerator_only=accelerator_only) for v in value.values())
    return False


class HostCopies:
    """Starts the copies of one capture's tensors to the host (see the module docstring)."""

    def __init__(self) -> None:
        self.keep: list[torch.Tensor] = []
        self._devices: dict[torch.device, None] = {}

    def copy(self, value: Any) -> Any:
        """``value`` with each tensor replaced by its host copy (in flight for an
        accelerator's tensors; a clone for the CPU's); containers rebuilt."""
        if isinstance(value, torch.Tensor):
            t = value.detach()
            if t.device.type == "cpu":
                return t.clone()
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.device.type == "cuda")
            # Asynchronous only where an event orders it (CUDA); other accelerators copy now.
            host.copy_(t, non_blocking=t.device.type == "cuda")
            self.keep.append(t)
            self._devices[t.device] = None
            return host
        if type(value) in (tuple, list):
            return type(value)(self.copy(v) for v in value)
        if isinstance(value, (tuple, list)):
            # A named tuple or torch.return_types value: rebuilt as a plain tuple (the wire
            # has no other), never kept as the live object a later kernel could change.
            return tuple(self.copy(v) for v in value)
        if isinstance(value, Mapping):
            return {k: self.copy(v) for k, v in value.items()}
        return value

    def events(self) -> list[Any]:
        """One event per CUDA device the copies were queued on, recorded after them on the
        device's current stream; [] when every copy is done already (CPU clones, or a
        device whose copies are synchronous)."""
        events = []
        for device in self._devices:
            if device.type == "cuda":
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                events.append(event)
        return events
