"""The pass protocol, written once: every forward pass a model runs for hookwire (an
Infer call, a Generate step, a harvest batch; alone or shared by several calls) goes
through ``running``, and every batch of joined calls through ``run_joined``.

One pass, on the model's worker thread:

1. a shared pass holds each call's events (``Pass.hold``), so that a failed pass can be
   run again per call as if it never ran;
2. the hooks of the work attach (per pass: Infer's request-scoped hooks, a harvest
   batch's; a Generate call attaches its own once, for all its steps, and passes none);
3. ``host.current_batch`` names the calls and their rows, which every hook reads;
4. the body runs the model (inside ``model_errors``, or through ``call_model``: an
   exception out of the model, other than hookwire's own, becomes one naming the
   failing module);
5. asynchronous captures still in flight are finished (their events delivered in
   firing order, before the calls' results), then the compact readout events are sent
   (hooks.compact);
6. on failure, a shared pass is undone (held events dropped, hooks' counters and
   sampling put back), a pass of one call delivers what its hooks captured before the
   failure; either way the hooks detach and ``current_batch`` is cleared.

Delivery after the pass (held events released, events kept for a full stream flushed,
CallEnded markers) belongs to the call (passes.Pass): the pass itself never waits for a
reader.
"""

from __future__ import annotations

import contextlib
import logging
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from ..errors import HookwireServerError, InvalidArgument, ResourceExhausted
from .batching import Batch

log = logging.getLogger("hookwire.batching")

T = TypeVar("T")


@contextlib.contextmanager
def running(host: Any, batch: Batch, records: Sequence[Any] = ()) -> Iterator[Batch]:
    """One pass over ``batch`` on ``host``'s worker thread, with ``records`` attached for
    its duration (see the module docstring). The body runs the model; when it returns,
    the pass's asynchronous captures are finished before the ``with`` ends."""
    shared = batch.shared
    if shared:
        for p in batch.passes:
            p.hold()
    fires = host.fires
    try:
        for record in records:
            record.attach()
        host.current_batch = batch
        yield batch
        batch.deferred.finish()  # asynchronous captures: their events, before the calls' results
        batch.compact.send(fail=batch.fail_call)  # compact readouts: one event per hook and call, at the end
    except BaseException:
        if shared:
            batch.undo()  # its calls run again alone, as if this pass never ran
            host.fires = fires
        else:
            batch.deferred.finish(raise_errors=False)  # what was captured before the failure still goes out
            batch.compact.send(raise_errors=False, fail=batch.fail_call)
        raise
    finally:
        host.current_batch = None
        for record in records:
            record.detach()


def run_joined(
    host: Any, calls: list[T], shared: Callable[[list[T]], list[Any]], alone: Callable[[T], Any], *, what: str,
    logger: logging.Logger = log,
) -> list[Any]:
    """Runs calls the scheduler joined: one shared pass (``shared``: one result or
    exception per call), or, when it fails as a whole (one call's failing hook or rule,
    a tensor that cannot be split), each call again alone (``alone``), so that one
    caller's failure reaches only that caller. Each call has a ``p`` (its Pass), rolled
    back before it runs again; the fall-back is logged (INFO) to ``logger`` as "a
    ``what`` of N calls on MODEL failed (why); they run again alone". Worker thread."""
    if len(calls) > 1:
        try:
            return shared(calls)
        except Exception as exc:
            logger.info("a %s of %d calls on %s failed (%s); they run again alone", what, len(calls), host.name, exc)
            for call in calls:
                call.p.rollback()  # type: ignore[attr-defined]
    results: list[Any] = []
    for call in calls:
        try:
            results.append(alone(call))
        except Exception as exc:
            results.append(exc)
    return results


@contextlib.contextmanager
def model_errors(host: Any, what: str) -> Iterator[None]:
    """Runs the body (forward or backward, ``what``) turning a model's exception into one
    naming the module (``model_error``): ``call_model`` as a ``with`` block, so that the
    model's caller needs no call-back."""
    try:
        yield
    except Exception as exc:
        error = model_error(host, what, exc)
        if error is exc:
            raise
        raise error from None


def call_model(host: Any, what: str, fn: Callable[[], T]) -> T:
    """Runs forward or backward, turning a model's exception into one naming the module
    (``model_error``)."""
    try:
        return fn()
    except Exception as exc:
        error = model_error(host, what, exc)
        if error is exc:
            raise
        raise error from None


def model_error(host: Any, what: str, exc: Exception) -> Exception:
    """The exception a failed forward or backward (``what``) of ``host`` raises: hookwire's
    own as it is, running out of memory as ResourceExhausted, anything else as
    InvalidArgument naming the innermost module of the model it failed in."""
    if isinstance(exc, HookwireServerError):
        return exc
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or _cpu_allocation_failed(exc):
        return ResourceExhausted(f"{what} of model {host.name!r} ran out of memory: {exc}")
    where = _failing_module(host, exc)
    log.info("%s of %s failed in %r: %r", what, host.name, where, exc)
    return InvalidArgument(f"{what} failed in {where}: {type(exc).__name__}: {exc}")


def _cpu_allocation_failed(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's CPU allocator failing (a RuntimeError, not an
    OutOfMemoryError: "DefaultCPUAllocator: can't allocate memory"), as under a memory
    limit (RLIMIT_AS, a cgroup) that the memory budget's estimate did not foresee."""
    return isinstance(exc, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(exc)


def _failing_module(host: Any, exc: BaseException) -> str:
    """The innermost module of ``host`` whose forward() is on the exception's traceback."""
    found = None
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        owner = frame.f_locals.get("self")
        if owner is not None and frame.f_code.co_name == "forward":
            path = host.path_of(owner)
            if path is not None:
                found = (path, type(owner).__name__)
    if found is None:
        return f"model {host.name!r}"
    path, kind = found
    return f"module {path!r} ({kind})" if path else f"the root module ({kind})"
