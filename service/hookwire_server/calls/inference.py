"""Infer and InferStream calls, the call side: validate the request (cheap checks on
the loop, walks of large requests on threads), admit it (calls/admission.py), make its
Pass and its work item (engine.infer_pass.InferCall), submit it to the model's scheduler
and wait for its response, then for the events its pass kept for a full stream. Running
the model (forward, backward, the hooks) is the engine's: engine/infer_pass.py on the
model's worker thread; the event loop only validates what is cheap and waits.
"""

from __future__ import annotations

import asyncio
import math
import contextlib
import functools
import time
import logging
from collections.abc import Mapping
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, ParamSpec, TypeVar

from hookwire.wire import codec as _codec
from hookwire.wire.codec import Chunker
from hookwire.wire.framing import INFER_STREAM_CHUNK, Framing, RawChunk, Splicer
from hookwire.v1 import model_service_pb2, tensor_pb2

from ..rpc_context import current_front, take_request_id
from ..errors import (
    DeadlineExceeded,
    FailedPrecondition,
    HookwireServerError,
    InvalidArgument,
    ResourceExhausted,
    release_failure,
)
from ..hooks.event_bus import HeldBytesExceeded
from ..hooks.hook_manager import HookManager
from ..hooks.hook_specs import hook_modules
from ..hooks.passes import Pass
from ..engine.core import Engines
from .admission import Admission, captured_modules
from ..engine.infer_pass import BackwardPlan, InferCall
from ..engine.seam import INFER
from ..engine.scheduler import Work
from ..models.memory_estimate import Inputs, Nested, TensorShape
from ..models.positions import check_positions, position_limit
from ..auth import ANONYMOUS, MINIMUM_ROLE, Principal
from .. import limits

log = logging.getLogger("hookwire.infer")

#: Plain (non-list, non-map) arguments of a request checked inline, on the event loop.
INLINE_VALUES = 16


def _plain(request: model_service_pb2.InferRequest) -> bool:
    """Whether the request holds a few plain arguments (tensors, scalars: no lists or
    maps), so that walking its Values is a few steps and may run on the event loop."""
    if len(request.args) + len(request.kwargs) > INLINE_VALUES:
        return False
    return all(v.WhichOneof("kind") not in ("list", "map") for v in (*request.args, *request.kwargs.values()))

_INTEGER_DTYPES = frozenset({
    tensor_pb2.DTYPE_INT64, tensor_pb2.DTYPE_INT32, tensor_pb2.DTYPE_INT16, tensor_pb2.DTYPE_INT8, tensor_pb2.DTYPE_UINT8,
})


def _token_input(request: model_service_pb2.InferRequest) -> tuple[str, int] | None:
    """The request's token input and its positions, read from shapes (nothing decoded):
    ``kwargs['input_ids']``, an integer ``[sequences, positions, ...]`` first argument, or
    ``kwargs['inputs_embeds']`` ``[sequences, positions, width]``; None when it has none."""
    if "input_ids" in request.kwargs:
        field, value, dims = "kwargs['input_ids']", request.kwargs["input_ids"], 2
    elif "inputs_embeds" in request.kwargs:
        field, value, dims = "kwargs['inputs_embeds']", request.kwargs["inputs_embeds"], 3
    elif request.args and request.args[0].WhichOneof("kind") == "tensor" and request.args[0].tensor.dtype in _INTEGER_DTYPES:
        field, value, dims = "args[0]", request.args[0], 2
    else:
        return None
    if value.WhichOneof("kind") != "tensor" or len(value.tensor.shape) < dims:
        return None
    return field, int(value.tensor.shape[1])


def request_inputs(request: model_service_pb2.InferRequest) -> Inputs:
    """The call's top-level inputs as the memory estimate reads them: each tensor's shape
    and dtype, the bytes of the tensors in a list or map, plain values (nothing decoded)."""
    dtypes = _codec.TORCH_DTYPES

    def one(value: tensor_pb2.Value) -> Any:
        kind = value.WhichOneof("kind")
        if kind == "tensor":
            t = value.tensor
            if t.dtype in dtypes:
                return TensorShape(tuple(t.shape), dtypes[t.dtype])
            return Nested(len(t.data))
        if kind in ("list", "map"):
            return Nested(sum(math.prod(t.shape) * _codec.ITEMSIZE.get(t.dtype, 1)
                              for _, t in _codec.iter_tensors(value) if not t.operand))
        if kind in ("float_value", "int_value", "bool_value", "string_value"):
            return getattr(value, kind)
        return None

    return tuple(one(v) for v in request.args), {k: one(v) for k, v in request.kwargs.items()}


T = TypeVar("T")
R = TypeVar("R")
P = ParamSpec("P")


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

    def __init__(self, admission: Admission, hooks: HookManager, *, engines: Engines) -> None:
        self._admission = admission
        self._hooks = hooks
        #: Each model's engine and scheduler (shared with Generate and harvest jobs).
        self._engines = engines
        self.limits = admission.state.limits
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
        self._admission.state.refuse_when_draining()
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

    async def idle_limited(self, messages: AsyncIterator[T], rpc: str = "InferStream") -> AsyncIterator[T]:
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
                        f"{rpc}: no message from the client for {idle:g} s (infer_stream_idle_timeout); "
                        "the call is ended and what it sent is freed: send the request and its chunks without pausing"
                    ) from None
                raise DeadlineExceeded(
                    f"{rpc}: the client was still sending after {self.limits.infer_timeout:g} s (infer_timeout); "
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
                if tensor.operand:  # a named operand of a hook's rule: no data here (compile_spec resolves it)
                    if tensor.dtype or len(tensor.shape) or tensor.chunk_id or tensor.data:
                        raise InvalidArgument(f"{where}: a named operand ({tensor.operand!r}) carries no dtype, shape "
                                              "or data of its own")
                    continue
                elements += _codec.check_tensor(tensor, where)
                chunked = chunked or bool(tensor.chunk_id)
        except _codec.CodecError as exc:
            raise InvalidArgument(str(exc)) from None
        if elements > self.limits.max_infer_elements:
            raise limits.exceeded("the request's tensors", f"{elements} elements", self.limits.max_infer_elements,
                                  "max_infer_elements")
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
        train = request.mode == model_service_pb2.MODE_TRAIN
        refuse = [("infer", "Infer")]
        if train:
            refuse.append(("train", "mode: MODE_TRAIN"))
        if request.HasField("backward"):
            refuse.append(("backward", "backward"))
        host, session = self._admission.enter_call(
            "Infer", principal, request.model, hooks=len(request.hooks), session_id=request.session_id, refuse=refuse,
        )
        if not checked and await self._checked(request) and chunked is None:
            raise InvalidArgument("a tensor has a chunk_id: chunked tensors travel over InferStream, not Infer")
        if request.mode not in model_service_pb2.Mode.values():
            raise InvalidArgument(f"mode: unknown mode {request.mode}")
        token_input = _token_input(request)
        if token_input is not None:  # read from shapes: before the call is queued, not in its pass
            field, length = token_input
            check_positions(position_limit(host.module), host.name, length, f"{field}: {length} positions")
        if train and not host.training_allowed:
            raise FailedPrecondition(f"model {host.name!r} does not allow MODE_TRAIN")
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
        request_id = take_request_id()  # the RPC's: its audit line names it too
        records, group = await self._admission.request_hooks(host, request.hooks, request_id, session, principal)
        p = Pass(
            request_id, request.session_id, frozenset(request.tags), principal=principal.name,
            max_events=self.limits.max_events_per_call, model=host.name,
            session_stream=session.stream if session is not None else None,
        )
        p.chunker = chunker
        p.splicer = splicer if chunker is None else None
        p.held_bytes = self._hooks.held_bytes
        p.response.hook_ids.extend(r.hook_id for r in records)
        for modules in hook_modules(records):
            p.response.hook_modules.add().modules.extend(modules)
        seed = request.seed if request.HasField("seed") else None
        shape = None
        if not (train or backward is not None or seed is not None or chunked is not None or chunker is not None):
            # How it may share a pass is its engine's to say (the torch engine stacks and pads).
            shape = self._engines.engine(host).infer_shape(request) if _plain(request) else None
        call = InferCall(p, request, records, train, backward, seed, chunked, shape)
        queued = self._queued.get(host.name, 0)
        if queued > self.limits.max_queued_infers:
            raise limits.exceeded(f"model {host.name!r}", f"{queued - 1} calls waiting", self.limits.max_queued_infers,
                                  "max_queued_infers", "retry later")
        self._queued[host.name] = queued + 1
        self._idle.clear()
        started = time.perf_counter()
        outcome = "error"
        claim = None
        admitted = False  # past the memory budget (claim stays None for an engine that sizes its own)
        try:
            work = Work(
                INFER, call, key=shape.key if shape is not None else None,
                rows=shape.rows if shape is not None else 1,
                avoid=shape.sizes if shape is not None else frozenset(),
                group=group, caller=(request.session_id, principal.name),
            )
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.limits.infer_timeout
            try:
                async with asyncio.timeout(self.limits.infer_timeout):  # (wait_for would run it in a task of its own)
                    # Its estimated peak, claimed in the server's memory budget before it is
                    # queued: one that can never fit is refused here, before it costs anything.
                    # (a request with lists or maps walks every Value: off the loop, as _checked)
                    inputs = request_inputs(request) if _plain(request) else await asyncio.to_thread(
                        request_inputs, request)
                    captures = captured_modules(records)
                    claim = await self._admission.claim_memory(
                        host, self._engines.engine(host), f"Infer on {host.name!r}",
                        lambda estimator: estimator.infer(inputs, captures=captures), probe=inputs,
                    )
                    admitted = True
                    response = await self._engines.submit(host, work)
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
            if not admitted:  # it never got its memory: nothing of it ran
                raise DeadlineExceeded(
                    f"Infer on {host.name!r} waited past the server's limit of {self.limits.infer_timeout} s "
                    "(infer_timeout) for room in the memory budget (memory_budget_bytes), behind other calls"
                ) from None
            raise DeadlineExceeded(
                f"Infer on {host.name!r} ran past the server's limit of {self.limits.infer_timeout} s (infer_timeout); "
                "a pass that already started runs to its end, and the model's next calls wait for it"
            ) from None
        finally:
            if claim is not None:
                if work.in_flight:  # its caller stopped waiting while its pass may run: it keeps
                    work.on_finished = claim.release  # its memory until the pass is back
                else:
                    claim.release()
            self._queued[host.name] -= 1
            if not any(self._queued.values()):
                self._idle.set()
            elapsed = time.perf_counter() - started
            self._admission.state.metrics.infer_seconds.labels(host.name, current_front()).observe(elapsed)
            log.info(
                "infer %s", outcome,
                extra={"request_id": request_id, "model": host.name, "session_id": request.session_id,
                       "duration_ms": round(elapsed * 1e3, 3), "hooks": len(records)},
            )


async def _backlog_delivered(call: InferCall, timeout: float) -> None:
    """Waits (up to ``timeout``, then TimeoutError) until the call's backlog is delivered
    and its CallEnded marker queued; at once when it had none."""
    if call.flushing is not None:
        await asyncio.wait_for(asyncio.wrap_future(call.flushing), timeout)


