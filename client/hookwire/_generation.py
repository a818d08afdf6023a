"""Generate calls from the client: a lazy stream of tokens and events, with an awaitable result."""

from __future__ import annotations

import asyncio
import collections
import weakref
from types import TracebackType
from typing import Any, AsyncIterator, Callable, Generator, Sequence, Union

import grpc
import numpy as np

from .wire import codec
from ._errors import CancelledError, HookwireError, from_rpc_error
from .wire.framing import RawChunk
from ._session import EventAssembler, assembled, kind_of, notice_of, restored, uncut
from ._specs import HookSpecLike, spec_proto
from ._transport import Transport
from ._types import CallHooks, GeneratedTokens, GenerateResult, InterceptEvent, Notice
from .v1 import model_service_pb2


#: What iterating a GenerateStream yields.
GenerateItem = Union[GeneratedTokens, InterceptEvent]

#: The largest value GenerateRequest.max_response_message_bytes (uint32) carries.
_UINT32_MAX = 2**32 - 1


def generate_request(
    model: str,
    prompt_or_ids: Any,
    max_new_tokens: int,
    *,
    attention_mask: Any,
    hooks: Sequence[HookSpecLike],
    do_sample: bool | None,
    temperature: float | None,
    top_k: int | None,
    top_p: float | None,
    seed: int | None,
    stop: str | Sequence[str],
    tags: Sequence[str],
    session_id: str,
    max_response_message_bytes: int,
    stream_interval: int = 0,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    ignore_eos: bool = False,
    min_new_tokens: int = 0,
    n: int = 1,
) -> model_service_pb2.GenerateRequest:
    """The GenerateRequest for ``RemoteModel.generate``'s arguments; ValueError or
    TypeError for one it cannot send (the server checks the rest)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be an integer > 0, not {max_new_tokens!r}")
    if isinstance(stream_interval, bool) or not isinstance(stream_interval, int) or stream_interval < 0:
        raise ValueError(f"stream_interval must be an integer >= 0, not {stream_interval!r}")
    for name, value, least in (("logprobs", logprobs, 0), ("prompt_logprobs", prompt_logprobs, 0),
                               ("min_new_tokens", min_new_tokens, 0), ("n", n, 1)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            raise ValueError(f"{name} must be an integer >= {least}{' or None' if 'logprobs' in name else ''}, "
                             f"not {value!r}")
    request = model_service_pb2.GenerateRequest(
        model=model, max_new_tokens=max_new_tokens, session_id=session_id,
        max_response_message_bytes=min(max_response_message_bytes, _UINT32_MAX),
        stream_interval=min(stream_interval, _UINT32_MAX),
        ignore_eos=bool(ignore_eos), min_new_tokens=min(min_new_tokens, _UINT32_MAX), n=min(n, _UINT32_MAX),
    )
    if logprobs is not None:
        request.logprobs = True
        request.top_logprobs = min(logprobs, _UINT32_MAX)
    if prompt_logprobs is not None:
        request.prompt_logprobs = min(prompt_logprobs, _UINT32_MAX)
    if isinstance(prompt_or_ids, str):
        request.prompts.append(prompt_or_ids)
    elif isinstance(prompt_or_ids, (list, tuple)) and prompt_or_ids and all(isinstance(p, str) for p in prompt_or_ids):
        request.prompts.extend(prompt_or_ids)
    elif isinstance(prompt_or_ids, (list, tuple)) and not prompt_or_ids:
        raise ValueError("no prompt: give a string, a list of strings, or input_ids [batch, seq]")
    else:
        codec.encode_tensor_into(_ids_matrix(prompt_or_ids, "input_ids"), request.input_ids)
    if attention_mask is not None:
        if request.prompts:
            raise ValueError("attention_mask goes with input_ids: text prompts are tokenized and padded on the server")
        codec.encode_tensor_into(_ids_matrix(attention_mask, "attention_mask"), request.attention_mask)
    for spec in hooks:
        request.hooks.append(spec_proto(spec, model))
    if do_sample is not None:
        request.do_sample = do_sample
    if temperature is not None:
        request.temperature = temperature
    if top_k is not None:
        request.top_k = top_k
    if top_p is not None:
        request.top_p = top_p
    if seed is not None:
        request.seed = seed
    request.stop.extend([stop] if isinstance(stop, str) else stop)
    request.tags.extend(tags)
    return request


def _ids_matrix(value: Any, name: str) -> Any:
    """A tensor or array as given; nested lists of integers as an int64 array."""
    if isinstance(value, (list, tuple)):
        array = np.asarray(value)
        if array.dtype.kind not in "iu":
            raise TypeError(f"{name}: expected integer token ids [batch, seq], got {array.dtype} values")
        return array.astype(np.int64)
    return value


class GenerateStream:
    """A Generate call (``model.generate(...)``): iterate it for what happens as it
    happens, await it for the result.

    ``async for item in stream`` yields, in stream order, each event of the call's own
    hooks (``InterceptEvent``, with its ``step``; chunked tensors are reassembled
    before it is yielded) as it arrives, in firing order, and after the events of
    step s the step's ``GeneratedTokens``. (The server sends large captures as they
    fire, and may hold small ones back to send them together by the end of their
    step.) Iteration ends after the last step. ``await stream`` (or
    ``await stream.result()``) reads whatever has not been read yet and returns the
    ``GenerateResult``; after a full iteration it returns at once. Notices about the
    call's hooks are collected in ``notices`` (and logged as warnings), not yielded.

    Lazy: nothing is sent until the first iteration, ``await``, or ``start()``. Each
    item waits for the server. A reader that falls behind slows only this call: the
    server queues the next step once the transport has taken the last one's messages,
    so it runs ahead of the reader by at most what gRPC buffers. One reader at a
    time: iterate, then await, not both at once from different tasks; iterating
    again continues where the last iteration stopped.

    Raises the SDK's errors, mapped from the call's status, where it is read:
    NotFoundError (model), UnimplementedError (the model cannot generate),
    FailedPreconditionError (text prompts or stop strings on a model without a
    tokenizer), InvalidArgumentError / ResourceExhaustedError (bad input or a limit,
    naming it; also a request hook's rule failing with on_error "fail_call"),
    UnavailableError (the model is loading, the server shutting down). A failed call
    raises the same error to every later read.

    Cancelling: ``await stream.aclose()`` (``cancel()`` from synchronous code), leaving
    ``async with model.generate(...) as stream:``, or cancelling the task that is
    iterating or awaiting it, cancels the RPC; the server stops the generation at the
    next step boundary and frees the model at once. Later reads raise
    hookwire.CancelledError. Leaving an ``async for`` early with ``break`` does *not*
    cancel (``await stream`` still gets the result): close the stream, or use
    ``async with``, when you are done with it.
    """

    def __init__(self, client: Transport, request: model_service_pb2.GenerateRequest, *, keep_events: bool = True) -> None:
        self._client = client
        #: The request (escape hatch).
        self.request = request
        self._keep_events = keep_events
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._lock = asyncio.Lock()
        self._assembler = EventAssembler()
        self._started: model_service_pb2.GenerateStarted | None = None
        self._call_hooks: CallHooks | None = None
        self._events: list[InterceptEvent] = []
        #: The steps that carried log-probabilities (generate(logprobs=...)), for the result.
        self._scored: list[GeneratedTokens] = []
        #: Events of a batch message not yet handed out.
        #: Items received and not yet handed out: events of one batch, tokens of one `steps`.
        self._batched: collections.deque[GenerateItem] = collections.deque()
        self._result: GenerateResult | None = None
        self._error: HookwireError | None = None
        self._cancelled = False
        #: Ends the call's count among its session's own calls in flight (EventRouter.own_call).
        self._own: Callable[[], None] = lambda: None
        #: Notices about the call's own hooks received so far (e.g. one disabled by a rule).
        self.notices: list[Notice] = []

    # ------------------------------------------------------------------ what started

    @property
    def request_id(self) -> str:
        """The call's id (its events carry it); "" until the call has started."""
        return self._started.request_id if self._started is not None else ""

    @property
    def seed(self) -> int | None:
        """The seed of the call's random generator; None until the call has started."""
        return self._started.seed if self._started is not None else None

    @property
    def hook_ids(self) -> tuple[str, ...]:
        """The ids given to the call's hooks, in order; () until the call has started."""
        return tuple(self._started.hook_ids) if self._started is not None else ()

    @property
    def done(self) -> bool:
        """Whether the call has ended (with its result, an error, or cancelled)."""
        return self._result is not None or self._error is not None or self._cancelled

    async def start(self) -> GenerateStream:
        """Sends the request, if not yet sent, and waits for the server to start the call
        (after it checked the request); then ``request_id``, ``seed`` and ``hook_ids``
        are known. Idempotent. Raises what the stream raises (see the class)."""
        async with self._lock:
            await self._start()
        return self

    async def _start(self) -> model_service_pb2.GenerateStarted:
        if self._error is not None:
            raise self._error
        if self._started is not None:
            return self._started
        if self._cancelled:
            raise self._fail(CancelledError("the Generate call was cancelled before it started"))
        self._call = self._client.tensor_calls.generate(self.request)
        self._own = self._client.own_call(self.request.session_id)  # its steps wait for the session's reader
        # A stream dropped without being read to its end or closed (``break``, then nothing)
        # must not leave its session stream read past its bound for good.
        weakref.finalize(self, self._own)
        msg = await self._read()
        if msg is grpc.aio.EOF or kind_of(msg) != "started":
            raise self._fail(HookwireError("the Generate stream did not start with `started`", code="DATA_LOSS"))
        msg = restored(*uncut(msg))  # a long prompt's ids: read as usual
        self._started = msg.started
        return msg.started

    async def _read(self) -> Any:
        """The next message; the SDK's error for a failed call; cancels the RPC when the
        reading task is cancelled."""
        assert self._call is not None
        try:
            return await self._call.read()
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED and self._cancelled:
                raise self._fail(CancelledError("the Generate call was cancelled by the client")) from None
            raise self._fail(from_rpc_error(exc, target=self._client.target)) from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._cancelled and (task is None or not task.cancelling()):
                # grpc.aio raises asyncio's CancelledError from a call cancelled locally:
                # here the RPC was (cancel / aclose), not the task that reads it.
                raise self._fail(CancelledError("the Generate call was cancelled by the client")) from None
            self._cancel()  # the reading task was cancelled: the RPC goes with it
            raise

    async def _finish(self) -> None:
        """Reads the call's status after its result (the server's last message): the RPC
        then ends OK on both sides instead of being cancelled when the channel closes
        (the server's audit log and metrics would count a finished call as CANCELLED).
        Its result stands whatever the status says."""
        assert self._call is not None
        self._own()
        try:
            await self._call.read()
        except (grpc.RpcError, asyncio.CancelledError):
            if asyncio.current_task() is not None and asyncio.current_task().cancelling():  # type: ignore[union-attr]
                raise

    def _fail(self, error: HookwireError) -> HookwireError:
        self._own()
        self._error = error
        if self._call is not None:
            self._call.cancel()  # a no-op once it has finished
        return error

    # ------------------------------------------------------------------ reading

    def __aiter__(self) -> AsyncIterator[GenerateItem]:
        return self._items()

    async def _items(self) -> AsyncIterator[GenerateItem]:
        while (item := await self._next()) is not None:
            yield item

    async def _next(self) -> GenerateItem | None:
        """The next event or tokens; None once the call has ended with its result."""
        async with self._lock:
            started = await self._start()
            if self._batched:
                return self._batched.popleft()
            if self._result is not None:
                return None
            if self._error is not None:
                raise self._error
            try:
                while True:
                    msg = await self._read()
                    if msg is grpc.aio.EOF:
                        ended = HookwireError("the Generate stream ended without its result", code="DATA_LOSS")
                        raise self._fail(ended)
                    if type(msg) is RawChunk:  # read by hand (see Client.tensor_calls)
                        complete = self._assembler.chunk(msg)
                        if complete is not None:
                            return self._hand_out([complete])
                        continue
                    msg, views = uncut(msg)
                    kind = msg.WhichOneof("kind")
                    if kind == "tokens":
                        return self._tokens(GeneratedTokens.from_proto(msg.tokens))
                    if kind == "steps":  # stream_interval > 1: several steps' tokens, handed out one by one
                        self._batched.extend(self._tokens(GeneratedTokens.from_proto(t)) for t in msg.steps.steps)
                        if self._batched:
                            return self._batched.popleft()
                        continue
                    if kind == "event":
                        complete = self._assembler.event(msg.event, views)
                    elif kind == "chunk":
                        complete = self._assembler.chunk(msg.chunk)
                    elif kind == "batch":
                        # Small events sent together, exactly as if one by one (never chunked).
                        chunked = assembled(msg.batch, views)
                        if msg.batch.events:
                            return self._hand_out([(event, chunked) for event in msg.batch.events])
                        continue
                    elif kind == "notice":
                        self.notices.append(notice_of(msg.notice))
                        continue
                    elif kind == "done":
                        self._assembler.check_complete()
                        self._result = GenerateResult.from_stream(started, self._events, msg.done, self.notices,
                                                                  self._scored)
                        self._events, self._scored = [], []
                        await self._finish()
                        return None
                    else:
                        continue  # a kind this SDK does not know yet
                    if complete is not None:
                        return self._hand_out([complete])
            except codec.CodecError as exc:
                raise self._fail(HookwireError(f"Generate: {exc}", code="DATA_LOSS")) from None
            except HookwireError as exc:
                if exc is not self._error:  # the assembler's DATA_LOSS
                    raise self._fail(exc) from None
                raise

    def _tokens(self, tokens: GeneratedTokens) -> GeneratedTokens:
        """Keeps a step's log-probabilities for the result (when the call asked for them)."""
        if tokens.logprobs or tokens.prompt_logprobs:
            self._scored.append(tokens)
        return tokens

    def _hand_out(self, received: list[tuple[Any, Any]]) -> InterceptEvent:
        """Decodes received events (a compact readout event expands into the per-module
        events it stands for), keeps them for the result, and returns the first; the rest
        wait in ``_batched``."""
        assert self._started is not None
        if self._call_hooks is None:
            self._call_hooks = CallHooks.of(self.request.model, self._started)
        for msg, chunked in received:
            for event in InterceptEvent.expand(msg, chunked, call=self._call_hooks):
                if self._keep_events:
                    self._events.append(event)
                self._batched.append(event)
        first = self._batched.popleft()
        assert isinstance(first, InterceptEvent)  # the deque was empty: only these events are in it
        return first

    async def result(self) -> GenerateResult:
        """Reads the rest of the stream and returns the GenerateResult (see the class)."""
        while await self._next() is not None:
            pass
        assert self._result is not None
        return self._result

    def __await__(self) -> Generator[Any, None, GenerateResult]:
        return self.result().__await__()

    # ------------------------------------------------------------------ cancelling

    def _cancel(self) -> None:
        self._own()
        if self._result is None and self._error is None:
            self._cancelled = True
        if self._call is not None:
            self._call.cancel()  # a no-op once it has finished

    def cancel(self) -> None:
        """Cancels the call (see the class); a no-op once it has ended. Does not wait."""
        self._cancel()

    async def aclose(self) -> None:
        """Cancels the call unless it has ended (see the class). Idempotent."""
        self._cancel()

    async def __aenter__(self) -> GenerateStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
