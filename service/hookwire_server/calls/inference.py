"""One Infer call: decode inputs, run forward (and backward) on the model's worker
thread with the call's hooks, encode the output.

Everything that touches the model runs in ``_run_pass`` on the worker thread;
the event loop only validates what is cheap to validate and waits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import time
import dataclasses
import logging
import traceback
from collections.abc import Mapping
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, ParamSpec, TypeVar

import torch

from hookwire.wire import codec as _codec
from hookwire.wire.codec import Chunker
from hookwire.wire.framing import INFER_STREAM_CHUNK, Framing, RawChunk, Splicer
from hookwire.wire.ids import new_id
from hookwire.v1 import model_service_pb2, tensor_pb2

from ..errors import (
    DeadlineExceeded,
    FailedPrecondition,
    HookwireServerError,
    InvalidArgument,
    ResourceExhausted,
    release_failure,
    Unavailable,
    Unimplemented,
)
from ..hooks.event_bus import HeldBytesExceeded
from ..hooks.hook_manager import HookManager
from ..hooks.hook_record import HookRecord
from ..hooks.passes import Pass
from ..engine import batching
from ..engine.scheduler import Work
from ..auth import ANONYMOUS, MINIMUM_ROLE, Principal
from .. import limits
from ..limits import Limits
from ..models.model_registry import ModelHost, ModelRegistry

log = logging.getLogger("hookwire.infer")

#: Plain (non-list, non-map) arguments of a request checked inline, on the event loop.
INLINE_VALUES = 16


def _plain(request: model_service_pb2.InferRequest) -> bool:
    """Whether the request holds a few plain arguments (tensors, scalars: no lists or
    maps), so that walking its Values is a few steps and may run on the event loop."""
    if len(request.args) + len(request.kwargs) > INLINE_VALUES:
        return False
    return all(v.WhichOneof("kind") not in ("list", "map") for v in (*request.args, *request.kwargs.values()))

T = TypeVar("T")
R = TypeVar("R")
P = ParamSpec("P")




@dataclasses.dataclass(frozen=True)
class BackwardPlan:
    """A validated Backward request."""

    path: tuple[str, ...]
    grad: model_service_pb2.Backward | None
    return_input_grads: bool


def parse_output_path(path: str) -> tuple[str, ...]:
    """Splits "0.last_hidden_state" into segments; InvalidArgument when malformed."""
    if path == "":
        return ()
    segments = tuple(path.split("."))
    if any(seg == "" or seg.strip() != seg for seg in segments):
        raise InvalidArgument(
            f"backward.output_path: {path!r} is malformed (dot-separated keys or indices, e.g. '0' or 'last_hidden_state')"
        )
    return segments


def select_output(output: Any, segments: tuple[str, ...]) -> Any:
    """The item of ``output`` that ``segments`` name; InvalidArgument when absent."""
    current = output
    for depth, seg in enumerate(segments):
        where = ".".join(segments[: depth + 1])
        if isinstance(current, Mapping):
            if seg not in current:
                raise InvalidArgument(f"backward.output_path: no key {seg!r} at {where!r} (keys: {list(current)})")
            current = current[seg]
        elif isinstance(current, (tuple, list)):
            if not (seg.isascii() and seg.isdigit() and len(seg) <= 9) or int(seg) >= len(current):
                raise InvalidArgument(
                    f"backward.output_path: {seg!r} at {where!r} is not an index of a sequence of {len(current)} items"
                )
            current = current[int(seg)]
        else:
            raise InvalidArgument(f"backward.output_path: {where!r} goes inside a {type(current).__name__}")
    return current


def _releasing_on_failure(fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """Releases what the frames a failure passed through hold before it propagates
    (errors.release_failure): grpc keeps an aborted call's exception chain alive with
    the call's state, so without this the tensors a failed call had received, and those
    its pass made, would stay in memory after it ended."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await fn(*args, **kwargs)
        except BaseException as exc:
            raise release_failure(exc)

    return wrapper


class Inference:
    """Runs Infer calls."""

    def __init__(self, registry: ModelRegistry, hooks: HookManager, *, limits: Limits | None = None) -> None:
        self._registry = registry
        self._hooks = hooks
        self.limits = limits or Limits()
        self._queued: dict[str, int] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        #: Open InferStream calls by principal name.
        self._streams: dict[str, int] = {}

    async def drained(self, timeout: float) -> bool:
        """Waits until no Infer call is in flight (at most ``timeout`` s); True if none is."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    @contextlib.contextmanager
    def open_stream(self, principal: Principal = ANONYMOUS) -> Iterator[Callable[[], None]]:
        """Counts one InferStream upload of ``principal`` until the block ends or the
        yielded ``release`` is called (once the request is assembled: a call waiting
        for or running on the model holds no upload memory). Call it before reading
        anything: PermissionDenied below the user role, ResourceExhausted when the
        principal already has max_infer_streams_per_principal uploads open."""
        principal.require(MINIMUM_ROLE["InferStream"], "Infer")
        name = principal.name
        count = self._streams.get(name, 0)
        limits.check(count, self.limits.max_infer_streams_per_principal,
                     f"{name!r} has {count} InferStream uploads open", "max_infer_streams_per_principal")
        self._streams[name] = count + 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._streams[name] -= 1
                if not self._streams[name]:
                    del self._streams[name]

        try:
            yield release
        finally:
            release()

    @property
    def open_streams(self) -> dict[str, int]:
        """Open InferStream calls by principal name (a copy)."""
        return dict(self._streams)

    async def idle_limited(self, messages: AsyncIterator[T]) -> AsyncIterator[T]:
        """``messages`` as they come; DeadlineExceeded when the client sends none for
        infer_stream_idle_timeout seconds, or has not finished sending within
        infer_timeout seconds (a client dripping one chunk just inside the idle
        timeout must not hold its upload forever). The call then ends, and whatever
        its messages filled is freed with it. Waits for each message."""
        idle = self.limits.infer_stream_idle_timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.infer_timeout
        iterator = aiter(messages)
        while True:
            left = deadline - loop.time()
            try:
                message = await asyncio.wait_for(anext(iterator), min(idle, max(0.0, left)))
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                if idle < left:
                    raise DeadlineExceeded(
                        f"InferStream: no message from the client for {idle:g} s (infer_stream_idle_timeout); "
                        "the call is ended and what it sent is freed: send the request and its chunks without pausing"
                    ) from None
                raise DeadlineExceeded(
                    f"InferStream: the client was still sending after {self.limits.infer_timeout:g} s (infer_timeout); "
                    "the call is ended and what it sent is freed"
                ) from None
            yield message

    @_releasing_on_failure
    async def infer_chunked(
        self, request: model_service_pb2.InferRequest, chunks: AsyncIterator[tensor_pb2.TensorChunk | RawChunk],
        principal: Principal = ANONYMOUS, *, uploaded: Callable[[], None] | None = None, chunk_bytes: int,
    ) -> tuple[model_service_pb2.InferResponse, Chunker]:
        """InferStream: the request's chunked tensors come from ``chunks``; the response's
        large tensors are left in the returned Chunker, to follow the response in chunks
        of ``chunk_bytes`` (those captured during the pass already framed, see Chunker).
        ``uploaded`` is called once every chunk has arrived (see open_stream)."""
        principal.require(MINIMUM_ROLE["InferStream"], "Infer")
        await self._checked(request)
        try:
            if _plain(request):  # its buffers are allocated here, not in a worker thread's malloc arena
                assembler = _codec.ChunkAssembler(request, max_bytes=self.limits.max_request_bytes)
            else:
                assembler = await asyncio.to_thread(
                    _codec.ChunkAssembler, request, max_bytes=self.limits.max_request_bytes
                )
            async for chunk in chunks:
                if assembler.done:
                    raise InvalidArgument("InferStream: more chunks than the request's chunked tensors hold")
                assembler.feed(chunk)
        except _codec.CodecError as exc:
            if "over the limit" in str(exc):
                raise ResourceExhausted(f"InferStream: {exc}") from None
            raise InvalidArgument(f"InferStream: {exc}") from None
        if not assembler.done:
            raise InvalidArgument("InferStream: the stream ended before every chunked tensor was complete")
        if uploaded is not None:
            uploaded()
        chunker = Chunker(snapshot=True, framing=Framing(INFER_STREAM_CHUNK, chunk_bytes))
        response = await self.infer(
            request, chunked=assembler.result(), chunker=chunker, principal=principal, checked=True
        )
        return response, chunker

    async def _checked(self, request: model_service_pb2.InferRequest) -> bool:
        """_check_elements, inline for a request of a few plain arguments (its walk is a
        few steps), on a worker thread for one with lists or maps (its walk costs
        microseconds per Value, bounded by max_request_values)."""
        if _plain(request):
            return self._check_elements(request)
        return await asyncio.to_thread(self._check_elements, request)

    def _check_elements(self, request: model_service_pb2.InferRequest) -> bool:
        """Validates every tensor's dtype, shape and byte count, and the element limit,
        before anything is queued (nothing is decoded); returns whether a tensor is chunked.

        Walks every Value: the request bounds (max_request_values, checked on the raw
        bytes before the request was parsed) bound its cost. Blocks: call it off the loop.
        """
        elements = 0
        chunked = False
        try:
            for where, tensor in _codec.iter_tensors(request):
                elements += _codec.check_tensor(tensor, where)
                chunked = chunked or bool(tensor.chunk_id)
        except _codec.CodecError as exc:
            raise InvalidArgument(str(exc)) from None
        if elements > self.limits.max_infer_elements:
            raise ResourceExhausted(
                f"the request's tensors hold {elements} elements, over the limit of {self.limits.max_infer_elements} "
                "(max_infer_elements)"
            )
        return chunked

    @_releasing_on_failure
    async def infer(
        self, request: model_service_pb2.InferRequest, *, chunked: Mapping[int, Any] | None = None,
        chunker: Chunker | None = None, principal: Principal = ANONYMOUS, checked: bool = False,
        splicer: Splicer | None = None,
    ) -> model_service_pb2.InferResponse:
        """Runs one call; raises a HookwireServerError for anything the client can act on.

        ``chunked`` holds the request's chunked tensors (InferStream); with a
        ``chunker``, large response tensors are left in it instead of inline; with a
        ``splicer``, they are placed as markers, for ``splicer.serialize`` (Infer).
        ``checked``: the caller already ran the tensor checks (InferStream).
        Validation that walks the request's Values, and compiling its request-scoped
        hooks, run on worker threads: a large request never stalls the event loop.
        """
        principal.require(MINIMUM_ROLE["Infer"], "Infer")
        if self._hooks.draining:
            raise Unavailable("the server is shutting down")
        host = self._registry.get(request.model)
        if len(request.hooks) > self.limits.max_request_hooks:
            raise ResourceExhausted(
                f"hooks: {len(request.hooks)} request-scoped hooks, over the limit of {self.limits.max_request_hooks} "
                "(max_request_hooks)"
            )
        if not checked and await self._checked(request) and chunked is None:
            raise InvalidArgument("a tensor has a chunk_id: chunked tensors travel over InferStream, not Infer")
        if request.mode not in model_service_pb2.Mode.values():
            raise InvalidArgument(f"mode: unknown mode {request.mode}")
        train = request.mode == model_service_pb2.MODE_TRAIN
        if train and not host.training_allowed:
            raise FailedPrecondition(f"model {host.name!r} does not allow MODE_TRAIN")
        session = self._hooks.require_session(request.session_id, principal, owner_only=True) if request.session_id else None
        backward = None
        if request.HasField("backward"):
            backward = BackwardPlan(
                path=parse_output_path(request.backward.output_path),
                grad=request.backward if request.backward.HasField("grad") else None,
                return_input_grads=request.backward.return_input_grads,
            )
            if backward.grad is not None:
                try:
                    _codec.check_tensor(backward.grad.grad, "backward.grad")
                except _codec.CodecError as exc:
                    raise InvalidArgument(str(exc)) from None
        request_id = new_id("req")
        records = []
        if request.hooks:
            # Off the loop: each hook resolves its module glob against every module path.
            records = await asyncio.to_thread(
                self._hooks.request_hooks, host, request.hooks, request_id, session, principal
            )
        p = Pass(
            request_id, request.session_id, frozenset(request.tags), principal=principal.name,
            max_events=self.limits.max_events_per_call, model=host.name,
            session_stream=session.stream if session is not None else None,
        )
        p.chunker = chunker
        p.splicer = splicer if chunker is None else None
        p.held_bytes = self._hooks.held_bytes
        p.response.hook_ids.extend(r.hook_id for r in records)
        seed = request.seed if request.HasField("seed") else None
        shape = None
        if not (train or backward is not None or seed is not None or chunked is not None or chunker is not None):
            shape = batching.request_key(request, host.batching) if _plain(request) else None
        call = InferCall(p, request, records, train, backward, seed, chunked, shape)
        queued = self._queued.get(host.name, 0)
        if queued > self.limits.max_queued_infers:
            raise ResourceExhausted(
                f"model {host.name!r} has {queued - 1} calls waiting, the limit is {self.limits.max_queued_infers} "
                "(max_queued_infers); retry later"
            )
        self._queued[host.name] = queued + 1
        self._idle.clear()
        started = time.perf_counter()
        outcome = "error"
        try:
            slots = any(r.compiled.uses_slots for r in records) or (
                session is not None and self._hooks.session_uses_slots(session)
            )
            work = Work(
                run_infer_batch, call, key=shape.key if shape is not None else None,
                rows=shape.rows if shape is not None else 1, kind="infer",
                avoid=shape.sizes if shape is not None else frozenset(),
                group=request.session_id if slots else None, caller=(request.session_id, principal.name),
            )
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.limits.infer_timeout
            try:
                response = await asyncio.wait_for(host.scheduler.submit(work), self.limits.infer_timeout)
            except HookwireServerError as exc:
                # Failed (e.g. an output with no wire form): the events its pass kept for a full
                # stream still go out before the error, as the others did; but a call that failed
                # because it kept too much for a stalled reader says so at once (its kept events
                # still go out, from their own thread, as the reader takes them).
                if not isinstance(exc, HeldBytesExceeded):
                    await _backlog_delivered(call, max(0.0, deadline - loop.time()))
                raise
            # A stream that blocks for it was full: it waits for that reader here, after its
            # pass and alone (the pass itself never waits for a reader).
            await _backlog_delivered(call, max(0.0, deadline - loop.time()))
            outcome = "ok"
            return response
        except asyncio.TimeoutError:
            outcome = "timeout"
            raise DeadlineExceeded(
                f"Infer on {host.name!r} ran past the server's limit of {self.limits.infer_timeout} s (infer_timeout); "
                "a pass that already started runs to its end, and the model's next calls wait for it"
            ) from None
        finally:
            self._queued[host.name] -= 1
            if not any(self._queued.values()):
                self._idle.set()
            elapsed = time.perf_counter() - started
            self._hooks.metrics.infer_seconds.labels(host.name).observe(elapsed)
            log.info(
                "infer %s", outcome,
                extra={"request_id": request_id, "model": host.name, "session_id": request.session_id,
                       "duration_ms": round(elapsed * 1e3, 3), "hooks": len(records)},
            )


def _decode_inputs(
    request: model_service_pb2.InferRequest, chunked: Mapping[int, Any] | None, device: torch.device,
) -> tuple[list[Any], dict[str, Any]]:
    """The call's inputs as torch values, their tensors on ``device`` (the model's input
    device: on the CPU nothing moves)."""
    try:
        args = [_codec.decode_value(v, where=f"args[{i}]", chunked=chunked) for i, v in enumerate(request.args)]
        kwargs = {k: _codec.decode_value(v, where=f"kwargs[{k!r}]", chunked=chunked) for k, v in request.kwargs.items()}
    except _codec.CodecError as exc:
        raise InvalidArgument(str(exc)) from None
    if device.type != "cpu":
        args = [to_device(v, device) for v in args]
        kwargs = {k: to_device(v, device) for k, v in kwargs.items()}
    return args, kwargs


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it moved to ``device`` (lists, tuples and maps rebuilt)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if type(value) in (list, tuple):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


@dataclasses.dataclass
class InferCall:
    """One Infer call waiting for (or in) a pass: the payload of its scheduler Work."""

    p: Pass
    request: model_service_pb2.InferRequest
    records: list[HookRecord]
    train: bool
    backward: BackwardPlan | None
    seed: int | None
    chunked: Mapping[int, Any] | None
    #: How it joins other calls (None: it runs alone).
    shape: batching.Shape | None
    #: Done once the events its pass left in its backlog (a full stream that blocks for
    #: it) are delivered and the call ended (see _deliver); None when nothing was left.
    flushing: concurrent.futures.Future[None] | None = None


async def _backlog_delivered(call: InferCall, timeout: float) -> None:
    """Waits (up to ``timeout``, then TimeoutError) until the call's backlog is delivered
    and its CallEnded marker queued; at once when it had none."""
    if call.flushing is not None:
        await asyncio.wait_for(asyncio.wrap_future(call.flushing), timeout)


def _deliver(call: InferCall) -> None:
    """After the call's pass (worker thread): delivers its held events (a shared pass's)
    and ends it; events a full stream cannot take now go out from a thread of their own,
    which then ends the call (Pass.finish): ``call.flushing`` is done once it has. Raises
    ResourceExhausted when the held events pass the principal's byte limit (the call
    fails; what was delivered stays delivered, and it still ends)."""
    p = call.p
    try:
        p.release()
    finally:
        call.flushing = p.finish()


def run_infer_batch(host: ModelHost, calls: list[InferCall]) -> list[Any]:
    """Runs Infer calls that the scheduler joined (worker thread): one pass over all
    their rows, each call's output cut back to its rows; a call alone runs exactly as
    before batching. Returns each call's InferResponse, or the exception it fails with.

    When the shared pass fails (one call's failing hook or rule, a tensor that cannot be
    split), every call runs again alone, so one caller's bad input fails only its call.
    """
    results: list[Any] = [None] * len(calls)
    inputs: list[tuple[int, tuple[list[Any], dict[str, Any]]]] = []
    if len(calls) > 1:
        for i, call in enumerate(calls):
            try:
                inputs.append((i, _decode_inputs(call.request, call.chunked, host.device)))
            except Exception as exc:  # its own bad tensor fails only it
                results[i] = exc
    if len(inputs) > 1:
        joined = [calls[i] for i, _ in inputs]
        try:
            outputs = _run_shared(host, joined, [decoded for _, decoded in inputs])
        except Exception as exc:
            log.info("a batch of %d calls on %s failed (%s); they run again alone", len(joined), host.name, exc)
            for call in joined:
                call.p.rollback()
        else:
            for (i, _), output in zip(inputs, outputs):
                results[i] = output
            return results
    for i, call in enumerate(calls):
        if results[i] is None:
            try:
                results[i] = _run_pass(host, call)
            except Exception as exc:
                results[i] = exc
    return results


def _run_shared(
    host: ModelHost, calls: list[InferCall], inputs: list[tuple[list[Any], dict[str, Any]]],
) -> list[Any]:
    """One pass over several calls' rows; each call's response (or failure). Raises
    when the pass itself fails (the caller then runs the calls alone)."""
    settings = host.batching
    lengths = [c.shape.length if c.shape is not None else None for c in calls]
    padded = None
    if len(set(lengths)) > 1:
        rows = sum(c.shape.rows for c in calls if c.shape is not None)
        # Not the row count either: a [tokens, ...] tensor every row shares would be taken for rows.
        padded = batching.padded_length(
            [n for n in lengths if n is not None], host.dimensions | {rows}, host.positions
        )
        if padded is None:
            raise InvalidArgument("the calls' token inputs cannot be padded to a common length within the model's positions")
    args, kwargs = batching.join_inputs(
        inputs, lengths, dim=settings.batch_dim, padded=padded, pad_token_id=settings.pad_token_id,
    )
    segments, start = [], 0
    for call, length in zip(calls, lengths):
        assert call.shape is not None
        segments.append(batching.Segment(call.p, start, start + call.shape.rows, length if padded is not None else None))
        start += call.shape.rows
    batch = batching.Batch(segments, dim=settings.batch_dim, padded=padded)
    model = host.module
    records = [record for call in calls for record in call.records]
    for call in calls:
        call.p.hold()
    fires = host.fires
    try:
        for record in records:
            record.attach()
        host.current_batch = batch
        with torch.no_grad():
            output = _call(host, "forward", lambda: model(*args, **kwargs))
        batch.deferred.finish()  # asynchronous captures: their events, before the calls' outputs
        outputs = batch.split(output, f"the output of model {host.name!r}")
    except BaseException:
        batch.undo()  # its calls run again alone, as if this pass never ran
        host.fires = fires
        raise
    finally:
        host.current_batch = None
        for record in records:
            record.detach()
    del output, args, kwargs
    results: list[Any] = []
    for call, mine in zip(calls, outputs):
        p = call.p
        try:
            try:
                if p.splicer is not None:
                    p.splicer.snapshot = False  # the pass is over: the output no longer changes
                _codec.encode_value_into(mine, p.response.output, chunker=p.splicer, opaque_caches=True)
            except (_codec.CodecError, RuntimeError, NotImplementedError, TypeError) as exc:
                raise Unimplemented(f"the output of model {host.name!r} cannot be sent: {exc}") from None
        except Exception as exc:
            # As alone: its hooks' events are delivered (they fired), then it fails.
            results.append(_delivered(call, exc))
            continue
        results.append(_delivered(call, p.response))
    return results


def _delivered(call: InferCall, result: Any) -> Any:
    """``result`` once the call's held events are delivered (_deliver), or the error
    delivering them failed it with."""
    try:
        _deliver(call)
    except ResourceExhausted as exc:
        return exc
    return result


def _run_pass(host: ModelHost, call: InferCall) -> model_service_pb2.InferResponse:
    """One call alone on the model's worker thread."""
    p, request, records, train, backward, seed, chunked = (
        call.p, call.request, call.records, call.train, call.backward, call.seed, call.chunked
    )
    args, kwargs = _decode_inputs(request, chunked, host.device)
    model = host.module
    if p.splicer is not None:
        p.splicer.snapshot = True  # captures during the pass (see below for the output)
    try:
        for record in records:
            record.attach()
        batch = host.current_batch = batching.Batch.alone(p)
        if train:
            model.train(True)
        with _seeded(seed), torch.set_grad_enabled(backward is not None):
            if backward is not None and backward.return_input_grads:
                for leaf in _tensors(args, kwargs):
                    if leaf.is_floating_point():
                        leaf.requires_grad_(True)
            output = _call(host, "forward", lambda: model(*args, **kwargs))
            if backward is not None:
                _backward(host, output, backward, chunked)
                if backward.return_input_grads:
                    _encode_grads(p.response, args, kwargs, p.chunker or p.splicer)
        batch.deferred.finish()  # asynchronous captures: their events, before the output
        large = p.chunker or p.splicer
        if large is not None:
            large.snapshot = False  # the pass is over: the output no longer changes
        try:
            _codec.encode_value_into(output, p.response.output, chunker=large, opaque_caches=True)
        except (_codec.CodecError, RuntimeError, NotImplementedError, TypeError) as exc:
            # e.g. a type with no wire form, a sparse or meta tensor
            raise Unimplemented(f"the output of model {host.name!r} cannot be sent: {exc}") from None
    finally:
        if host.current_batch is not None:
            # A failed pass: what its hooks captured before the failure still goes out.
            host.current_batch.deferred.finish(raise_errors=False)
        host.current_batch = None
        if train:
            model.eval()
        for record in records:
            record.detach()
        # CallEnded on the session streams that had its events, after the events a full
        # stream could not take during the pass (delivered off this thread: the model goes on).
        _deliver(call)
    return p.response


def _backward(host: ModelHost, output: Any, plan: BackwardPlan, chunked: Mapping[int, Any] | None) -> None:
    target = select_output(output, plan.path)
    where = ".".join(plan.path) or "the output"
    if not isinstance(target, torch.Tensor) or not target.is_floating_point():
        raise InvalidArgument(f"backward.output_path: {where!r} is not a floating-point tensor")
    if not target.requires_grad:
        raise InvalidArgument(f"backward.output_path: {where!r} does not depend on anything that requires grad")
    if plan.grad is not None:
        grad = _codec.decode_tensor(plan.grad.grad, where="backward.grad", chunked=chunked)
        if tuple(grad.shape) != tuple(target.shape):
            raise InvalidArgument(
                f"backward.grad: shape {list(grad.shape)} does not match {where!r}'s shape {list(target.shape)}"
            )
        grad = grad.to(dtype=target.dtype, device=target.device)
    else:
        grad = torch.ones_like(target)
    params = [param for param in host.module.parameters() if param.requires_grad]
    # .grad belongs to no caller: every call starts and ends without it.
    for param in params:
        param.grad = None
    try:
        _call(host, "backward", lambda: torch.autograd.backward(target, grad_tensors=grad))
    finally:
        for param in params:
            param.grad = None


def _call(host: ModelHost, what: str, fn: Any) -> Any:
    """Runs forward or backward, turning a model's exception into one naming the module."""
    try:
        return fn()
    except HookwireServerError:
        raise
    except (torch.OutOfMemoryError, MemoryError) as exc:
        raise ResourceExhausted(f"{what} of model {host.name!r} ran out of memory: {exc}") from None
    except Exception as exc:
        where = _failing_module(host, exc)
        log.info("%s of %s failed in %r: %r", what, host.name, where, exc)
        raise InvalidArgument(f"{what} failed in {where}: {type(exc).__name__}: {exc}") from None


def _failing_module(host: ModelHost, exc: BaseException) -> str:
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


def _tensors(*values: Any) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (tuple, list)):
            yield from _tensors(*value)
        elif isinstance(value, Mapping):
            yield from _tensors(*value.values())


def _grads_of(value: Any) -> Any:
    """``value`` with every tensor replaced by its gradient (None where it has none)."""
    if isinstance(value, torch.Tensor):
        return value.grad
    if isinstance(value, (tuple, list)):
        return type(value)(_grads_of(v) for v in value)
    if isinstance(value, Mapping):
        return {k: _grads_of(v) for k, v in value.items()}
    return None


def _encode_grads(
    response: model_service_pb2.InferResponse, args: list[Any], kwargs: dict[str, Any],
    chunker: Chunker | Splicer | None,
) -> None:
    for arg in args:
        _codec.encode_value_into(_grads_of(arg), response.input_grads.add(), chunker=chunker)
    for key, value in kwargs.items():
        _codec.encode_value_into(_grads_of(value), response.input_kwargs_grads[key], chunker=chunker)


@contextlib.contextmanager
def _seeded(seed: int | None) -> Iterator[None]:
    if seed is None:
        yield
        return
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield
