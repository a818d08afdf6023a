"""Generate calls, the call side: validate a GenerateRequest (prompts or ids, decoding
options, stop strings, limits), admit it, submit it once to the model's scheduler as
one Work of kind "generate" for its whole life (seam.GenerateCall), and stream what the
engine puts in the call's mailbox: the start, the events its hooks captured (batched),
each step's new tokens with their text deltas, and at the end a GenerateDone. Starting
the call (on the torch engine transformers' own ``generate()`` prepares it through its
``custom_generate`` hook), its steps (alone or joined with other calls') and its end are
the engine's (engine/decoding.py, engine/vllm_engine.py).

The server runs at most one step ahead of what the stream has taken (the call allows
its next step once it took the last one), so a client that reads slowly pauses its own
call, and only it; a reader that takes nothing for generate_idle_timeout (the response
stream, or a stream of the call's own events that a step's kept events wait for) ends
the call with DEADLINE_EXCEEDED. Cancellation and shutdown take effect at step
boundaries.

Sampling draws from a generator of the call's own, seeded from ``seed`` (or a fresh
random seed, reported): the same draws as ``torch.manual_seed(seed)`` before an
in-process ``generate()``, and no other call's randomness in between can change them.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import secrets
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping
from typing import Any

import torch

from hookwire.wire import codec as _codec
from hookwire.wire.framing import GENERATE_RESPONSE_CHUNK, Framing
from hookwire.v1 import hook_pb2, model_service_pb2, tensor_pb2

from ..rpc_context import current_front, take_request_id
from ..auth import ANONYMOUS, Principal
from .. import wakeups
from ..engine.core import Engines
from .admission import Admission, captured_modules
from ..engine.seam import FINISHED, GENERATE, GenerateCall, GenerateOptions, StepResult, TokenLogprobs
from ..engine.scheduler import Work, in_own_thread
from ..errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    Unavailable,
    Unimplemented,
    release_failure,
)
from ..hooks.event_bus import (
    BATCH_EVENT_MAX_BYTES,
    BATCH_MAX_BYTES,
    BATCH_MAX_EVENTS,
    DEFAULT_MAX_MESSAGE_BYTES,
    MIN_MAX_MESSAGE_BYTES,
    chunk_bytes_for,
)
from ..hooks.hook_manager import HookManager
from ..hooks.hook_record import HookRecord
from ..hooks.hook_specs import hook_modules
from .. import limits
from ..memory_budget import Claim
from ..models.model_registry import ModelHost
from ..models.positions import check_positions, position_limit
from ..hooks.passes import Pass
from .tokenization import check_texts, no_tokenizer_message, tokenize_texts

log = logging.getLogger("hookwire.generate")

#: Wire dtypes Generate accepts for input_ids and attention_mask.
_INTEGER_DTYPES = frozenset({
    tensor_pb2.DTYPE_INT8, tensor_pb2.DTYPE_INT16, tensor_pb2.DTYPE_INT32, tensor_pb2.DTYPE_INT64, tensor_pb2.DTYPE_UINT8,
})


class TextDeltas:
    """Incremental detokenization of one sequence: each step's text is what decoding
    the tokens so far adds to what was already sent, held back while it ends in an
    incomplete character (U+FFFD). The deltas concatenate to the final text."""

    def __init__(self) -> None:
        self.sent = ""
        self._prefix = 0  # tokens before this offset are no longer re-decoded
        self._read = 0  # tokens before this offset produced the text sent so far

    def add(self, tokenizer: Any, tokens: list[int], *, final: bool = False) -> str:
        """The text the new tokens add (decode with special tokens skipped)."""
        before = tokenizer.decode(tokens[self._prefix:self._read], skip_special_tokens=True)
        now = tokenizer.decode(tokens[self._prefix:], skip_special_tokens=True)
        # A character takes at most 4 bytes, so at most 4 tokens: text still ending in
        # U+FFFD after that is invalid bytes for good, and holding it longer would only
        # make every step decode a longer window.
        held = len(tokens) - self._read
        if len(now) <= len(before) or (now.endswith("\ufffd") and not final and held < 4):
            return ""
        delta = now[len(before):]
        self._prefix, self._read = self._read, len(tokens)
        self.sent += delta
        return delta


class _Mailbox:
    """Messages of one call from the model's worker thread to its stream, in order:
    ("event", event, chunker), ("notice", notice), ("step", StepResult) at the end of
    each step, and ("ended", exception or None) when the engine ended the call other than
    by its last step (seam.GenerateCall.put).

    Small events wait in the mailbox until the step ends (or until BATCH_MAX_BYTES of
    them are waiting) and then go out together; an event with large (chunked) tensors,
    a notice and the end of the step wake the stream at once. Waking the event loop for
    every small event cost the worker a self-pipe write and a GIL hand-over, and the
    loop a gRPC message, each about as much as encoding the event: measured, a step
    capturing every block of a 26M-parameter GPT-2 ran 1.5x slower than in-process
    hooks that way (see docs/benchmarks.md).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, held: Any = None, principal: str = "") -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: collections.deque[tuple[Any, ...]] = collections.deque()
        self._small_bytes = 0
        self._woken = False
        self._ready = asyncio.Event()
        #: Step ends ("step") queued and not yet taken: events that come after one belong to a step
        #: that ran ahead of the stream (an engine that advances every request in each
        #: step, vLLM), and count against the principal's held bytes (HeldBytes) until the
        #: stream takes them.
        self._ends = 0
        self._held = held
        self._principal = principal
        #: Bytes counted so far; the failure once counting more was refused (the call ends
        #: with it at its next step, and keeps nothing more).
        self._counted = 0
        self.failure: BaseException | None = None
        #: Set once the call ended (release): later messages (an engine's steps still in
        #: flight) are dropped, and nothing more is counted.
        self._closed = False

    def put(self, item: tuple[Any, ...]) -> None:
        """Adds a message; any thread, never waits."""
        small = item[0] == "event" and item[2] is None
        if small:  # its serialized size, computed once: _messages batches by it
            item = (*item, item[1].ByteSize())
        with self._lock:
            if self._closed:
                return
            if item[0] == "event" and self._ends and self._held is not None:
                if self.failure is not None:
                    return  # a step ahead of the stream, past the principal's limit: dropped
                nbytes = item[3] if small else item[1].ByteSize() + item[2].nbytes
                try:
                    self._held.take(self._principal, nbytes)
                except Exception as exc:
                    self.failure = exc
                    return
                self._counted += nbytes
                item = (*item[:3], item[3] if small else 0, nbytes)
            if item[0] == "step":
                self._ends += 1
            self._items.append(item)
            if small:
                self._small_bytes += item[3]
            wake = not self._woken and (not small or self._small_bytes >= BATCH_MAX_BYTES)
            if wake:
                self._woken = True
        if wake:
            try:
                if item[0] == "step":  # the end of a step: woken with the plan's other calls, when it is done
                    wakeups.call_soon(self._loop, self._ready.set)
                else:  # large events and notices go out while the pass still runs
                    self._loop.call_soon_threadsafe(self._ready.set)
            except RuntimeError:  # the loop has closed: nobody reads any more
                pass

    async def take(self, timeout: float | None = None) -> list[tuple[Any, ...]]:
        """The messages queued when the stream was woken, and since, up to the end of the
        first step among them or the call's end (event loop); [] when nothing came for
        ``timeout`` s. What follows that end stays queued for the next take: on an engine
        that advances every request in each step (vLLM) a call's next step can end before
        the stream took this one's messages."""
        while True:
            if not self._ready.is_set():
                try:
                    await asyncio.wait_for(self._ready.wait(), timeout)
                except asyncio.TimeoutError:
                    return []
            with self._lock:
                items: list[tuple[Any, ...]] = []
                given = 0
                while self._items:
                    item = self._items.popleft()
                    items.append(item)
                    if item[0] == "event" and len(item) > 4:
                        given += item[4]  # counted while it waited ahead of the stream
                    if item[0] == "step":
                        self._ends -= 1
                        break
                    if item[0] == "ended":
                        break
                if given and self._held is not None:
                    self._held.give(self._principal, given)
                    self._counted -= given
                rest = bool(self._items)
                self._small_bytes = sum(i[3] for i in self._items if i[0] == "event" and i[2] is None)
                self._woken = rest
                if not rest:
                    self._ready.clear()
            if items:
                return items

    def release(self) -> None:
        """Gives back what is still counted and takes no more messages (the call ended).
        Any thread."""
        with self._lock:
            counted, self._counted = self._counted, 0
            self._items.clear()
            self._closed = True
            self._ends = 0
        if counted and self._held is not None:
            self._held.give(self._principal, counted)


def _messages(items: list[tuple[Any, ...]], chunk_bytes: int) -> Iterator[model_service_pb2.GenerateResponse | bytes]:
    """The stream messages of the events and notices a take gave (up to its step's end:
    "step" and "ended" are the caller's).

    Small events waiting together go out as one EventBatch (gRPC's cost per message,
    on both ends, is far above that of a small event), as on session streams; an
    event with chunked tensors goes out alone, followed by its chunks.
    """
    run: list[hook_pb2.InterceptEvent] = []
    size = 0
    for item in items:
        kind = item[0]
        if kind == "event" and item[2] is None:
            wire = item[3]
            if wire <= BATCH_EVENT_MAX_BYTES:
                if run and (len(run) >= BATCH_MAX_EVENTS or size + wire > BATCH_MAX_BYTES):
                    yield _event_run(run)
                    run, size = [], 0
                run.append(item[1])
                size += wire
                continue
        if run:
            yield _event_run(run)
            run, size = [], 0
        if kind == "notice":
            yield model_service_pb2.GenerateResponse(notice=item[1])
        elif kind == "event":
            event, chunker = item[1], item[2]
            yield model_service_pb2.GenerateResponse(event=event)
            if chunker is not None:  # wire bytes, built as the event was captured (Pass.framing)
                for chunk in chunker.frames(GENERATE_RESPONSE_CHUNK, chunk_bytes):
                    yield chunk
    if run:
        yield _event_run(run)


def _event_run(events: list[hook_pb2.InterceptEvent]) -> model_service_pb2.GenerateResponse:
    """One message for a run of small events: the event itself, or an EventBatch."""
    if len(events) == 1:
        return model_service_pb2.GenerateResponse(event=events[0])
    out = model_service_pb2.GenerateResponse()
    for event in events:
        out.batch.events.append(event)
    return out


class Generation:
    """Runs Generate calls."""

    def __init__(self, admission: Admission, hooks: HookManager, *, engines: Engines) -> None:
        self._admission = admission
        self._state = admission.state
        self._hooks = hooks
        #: Each model's engine and scheduler (shared with Infer and harvest jobs).
        self._engines = engines
        self.limits = admission.state.limits
        #: Running calls by model name, and by principal name.
        self._active: dict[str, int] = {}
        self._by_principal: dict[str, int] = {}
        self._idle = asyncio.Event()
        self._idle.set()

    async def drained(self, timeout: float) -> bool:
        """Waits until no Generate call runs (at most ``timeout`` s); True if none does.
        Calls end at their next step boundary once the server drains."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    # ------------------------------------------------------------------ checks

    def _options(self, request: model_service_pb2.GenerateRequest, host: ModelHost) -> GenerateOptions:
        """The decoding settings; InvalidArgument naming the field for a bad one. Cheap."""
        limit = self.limits.max_new_tokens
        if request.max_new_tokens == 0:
            raise InvalidArgument("max_new_tokens: required, and must be > 0")
        if request.max_new_tokens > limit:
            raise limits.exceeded("max_new_tokens", f"{request.max_new_tokens} new tokens", limit, "max_new_tokens",
                                  error=InvalidArgument)
        if request.stream_interval > self.limits.max_stream_interval:
            raise limits.exceeded("stream_interval", f"{request.stream_interval} steps a message",
                                  self.limits.max_stream_interval, "max_stream_interval", error=InvalidArgument)
        overrides: dict[str, Any] = {}
        if request.HasField("do_sample"):
            overrides["do_sample"] = request.do_sample
        if request.HasField("temperature"):
            if not (math.isfinite(request.temperature) and request.temperature > 0):
                raise InvalidArgument(f"temperature: {request.temperature} must be a finite number > 0")
            overrides["temperature"] = request.temperature
        if request.HasField("top_k"):
            overrides["top_k"] = request.top_k
        if request.HasField("top_p"):
            if not (0 < request.top_p <= 1):
                raise InvalidArgument(f"top_p: {request.top_p} must be in (0, 1]")
            overrides["top_p"] = request.top_p
        stop = tuple(request.stop)
        if len(stop) > self.limits.max_stop_strings:
            raise limits.exceeded("stop", f"{len(stop)} stop strings", self.limits.max_stop_strings, "max_stop_strings",
                                  error=InvalidArgument)
        if any(not s for s in stop):
            raise InvalidArgument(f"stop[{stop.index('')}]: a stop string cannot be empty")
        chars = sum(len(s) for s in stop)
        if chars > self.limits.max_stop_chars:
            raise limits.exceeded("stop", f"{chars} characters in all", self.limits.max_stop_chars, "max_stop_chars",
                                  error=InvalidArgument)
        if stop and host.tokenizer is None:
            raise FailedPrecondition(f"stop: stop strings need a tokenizer: {no_tokenizer_message(host)}")
        configured = getattr(getattr(host.module, "generation_config", None), "stop_strings", None)
        if not stop and configured and host.tokenizer is not None:
            # The model's own stop strings (its operator's choice, so not the request's limits):
            # generate() cannot build them here (see start_call), the call's criteria carry them.
            stop = (configured,) if isinstance(configured, str) else tuple(configured)
        top = self.limits.max_top_logprobs
        if request.top_logprobs and not request.logprobs:
            raise InvalidArgument("top_logprobs: goes with logprobs (set logprobs to report log-probabilities)")
        if request.top_logprobs > top:
            raise limits.exceeded("top_logprobs", f"{request.top_logprobs} tokens a position", top, "max_top_logprobs",
                                  error=InvalidArgument)
        if request.HasField("prompt_logprobs") and request.prompt_logprobs > top:
            raise limits.exceeded("prompt_logprobs", f"{request.prompt_logprobs} tokens a position", top,
                                  "max_top_logprobs", error=InvalidArgument)
        if request.min_new_tokens > request.max_new_tokens:
            raise InvalidArgument(
                f"min_new_tokens: {request.min_new_tokens} is more than max_new_tokens {request.max_new_tokens}"
            )
        if request.n > self.limits.max_generate_n:
            raise limits.exceeded("n", f"{request.n} sequences a prompt", self.limits.max_generate_n, "max_generate_n",
                                  error=InvalidArgument)
        seed = request.seed if request.HasField("seed") else secrets.randbits(64)
        if request.max_response_message_bytes and request.max_response_message_bytes < MIN_MAX_MESSAGE_BYTES:
            raise InvalidArgument(
                f"max_response_message_bytes: {request.max_response_message_bytes} is below the minimum "
                f"{MIN_MAX_MESSAGE_BYTES} (0 for 4 MiB)"
            )
        return GenerateOptions(
            request.max_new_tokens, overrides, seed, stop,
            logprobs=request.top_logprobs if request.logprobs else None,
            prompt_logprobs=request.prompt_logprobs if request.HasField("prompt_logprobs") else None,
            ignore_eos=request.ignore_eos, min_new_tokens=request.min_new_tokens,
        )

    def _check_prompt_source(self, request: model_service_pb2.GenerateRequest, host: ModelHost) -> None:
        has_ids = request.HasField("input_ids")
        if request.prompts and has_ids:
            raise InvalidArgument("prompts and input_ids: give the prompts one way, as texts or as token ids")
        if not request.prompts and not has_ids:
            raise InvalidArgument("prompts: no prompt: set prompts (texts) or input_ids")
        if request.HasField("attention_mask") and not has_ids:
            raise InvalidArgument("attention_mask: goes with input_ids (prompts are padded on the server)")
        if request.prompts:
            if host.tokenizer is None:
                why = f" ({host.tokenizer_problem})" if host.tokenizer_problem else ""
                raise FailedPrecondition(
                    f"prompts: model {host.name!r} has no tokenizer{why}; tokenize on the client and send input_ids instead"
                )
            for i, prompt in enumerate(request.prompts):
                if not prompt:
                    raise InvalidArgument(f"prompts[{i}]: the prompt is empty")
            check_texts(list(request.prompts), self.limits, field="prompts")

    def _decode_ids(self, request: model_service_pb2.GenerateRequest, host: ModelHost) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids and attention_mask of a request that sent ids; InvalidArgument or
        ResourceExhausted naming what is wrong, before the model sees them."""
        batch, length = self._matrix_shape(request.input_ids, "input_ids")
        if request.HasField("attention_mask"):
            mask_shape = self._matrix_shape(request.attention_mask, "attention_mask")
            if mask_shape != (batch, length):
                raise InvalidArgument(
                    f"attention_mask: shape {list(mask_shape)} does not match input_ids' shape {[batch, length]}"
                )
        # The limits hold before anything is decoded: the ids may take up to a message's size.
        if batch > self.limits.max_tokenize_texts:
            raise limits.exceeded("input_ids", f"{batch} sequences", self.limits.max_tokenize_texts, "max_tokenize_texts")
        if length > self.limits.max_prompt_tokens:
            raise limits.exceeded("input_ids", f"{length} tokens per sequence", self.limits.max_prompt_tokens,
                                  "max_prompt_tokens")
        ids = self._decode_int_matrix(request.input_ids, "input_ids")
        vocab = _vocab_size(host)
        if vocab is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise InvalidArgument(f"input_ids: token id {bad} is outside the model's vocabulary [0, {vocab})")
        if request.HasField("attention_mask"):
            mask = self._decode_int_matrix(request.attention_mask, "attention_mask")
            if not bool(((mask == 0) | (mask == 1)).all()):
                raise InvalidArgument("attention_mask: values must be 0 (padding) or 1 (a token)")
            empty = (mask.sum(dim=1) == 0).nonzero()
            if len(empty):
                raise InvalidArgument(f"attention_mask: sequence {int(empty[0])} has no token (all zeros)")
            # A causal LM appends each new token after the last position: padding on the right
            # would put pads between the prompt and its continuation (transformers only warns,
            # and the tokens come out wrong).
            right = (mask[:, 1:] < mask[:, :-1]).any(dim=1).nonzero()
            if len(right):
                raise InvalidArgument(
                    f"attention_mask: sequence {int(right[0])} has padding (0) after a token (1): Generate needs "
                    "prompts padded on the left (a causal LM continues after the last position); pad on the left, "
                    "or tokenize with padding_side='left' (the server's default for this model)"
                )
        else:
            mask = torch.ones_like(ids)
        return ids, mask

    def _matrix_shape(self, tensor: Any, field: str) -> tuple[int, int]:
        """The [batch, seq] shape of an integer tensor message, from its header alone
        (nothing decoded); InvalidArgument for another dtype or shape."""
        if tensor.dtype not in _INTEGER_DTYPES:
            raise InvalidArgument(
                f"{field}: integer token ids expected, got {tensor_pb2.DType.Name(tensor.dtype)}"
                if tensor.dtype in tensor_pb2.DType.values() else f"{field}: unknown dtype {tensor.dtype}"
            )
        shape = tuple(tensor.shape)
        if len(shape) != 2 or shape[0] <= 0 or shape[1] <= 0:
            raise InvalidArgument(f"{field}: expected a non-empty [batch, seq] matrix, got shape {list(shape)}")
        return int(shape[0]), int(shape[1])

    def _decode_int_matrix(self, tensor: Any, field: str) -> torch.Tensor:
        try:
            _codec.check_tensor(tensor, field)
            if tensor.chunk_id:
                raise InvalidArgument(f"{field}: chunked tensors are not accepted by Generate")
            value = _codec.decode_tensor(tensor, where=field)
        except _codec.CodecError as exc:
            raise InvalidArgument(str(exc)) from None
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise InvalidArgument(f"{field}: integer token ids expected, got {value.dtype}")
        if value.dim() != 2 or value.shape[0] == 0 or value.shape[1] == 0:
            raise InvalidArgument(f"{field}: expected a non-empty [batch, seq] matrix, got shape {list(value.shape)}")
        return value.to(torch.int64)

    # ------------------------------------------------------------------ the call

    async def generate(
        self, request: model_service_pb2.GenerateRequest, principal: Principal = ANONYMOUS,
    ) -> AsyncIterator[model_service_pb2.GenerateResponse | bytes]:
        """Runs one Generate call, yielding its stream's messages (chunk messages as their
        wire bytes, see _framing). Everything the client
        can get wrong raises (a HookwireServerError) before the first message. Steps run
        on the model's worker thread, at most one ahead of the messages the stream has
        taken (a slow reader pauses its own call). Cancelling the iteration (the client
        went away) ends the call at once (a running step completes, a queued one never
        runs); once the server drains, the call ends at the next step boundary with
        finish_reason "shutdown"."""
        host, session = self._admission.enter_call(
            "Generate", principal, request.model, hooks=len(request.hooks), session_id=request.session_id,
            refuse=(("generate", "Generate"),),
        )
        if not host.can_generate:
            raise Unimplemented(
                f"model {host.name!r} cannot generate: Generate needs a causal language model "
                "(a transformers *ForCausalLM); use Infer"
            )
        self._check_prompt_source(request, host)
        options = self._options(request, host)
        n = max(1, request.n)
        if n > 1:  # counted before anything is tokenized or decoded
            count = len(request.prompts) or (int(request.input_ids.shape[0]) if request.input_ids.shape else 0)
            if count * n > self.limits.max_tokenize_texts:
                raise limits.exceeded("n", f"{count} prompts times n {n}: {count * n} sequences",
                                      self.limits.max_tokenize_texts, "max_tokenize_texts")
        positions = position_limit(host.module)
        active = self._active.get(host.name, 0)
        limits.check(active, self.limits.max_active_generations,
                     f"model {host.name!r} has {active} Generate calls running", "max_active_generations")
        mine = self._by_principal.get(principal.name, 0)
        limits.check(mine, self.limits.max_generations_per_principal,
                     f"{principal.name!r} has {mine} Generate calls running", "max_generations_per_principal")
        # The call counts from its check on: the awaits below (tokenizing, compiling hooks)
        # let other calls in, which must see it, or calls arriving together all pass the limit.
        self._active[host.name] = active + 1
        self._by_principal[principal.name] = mine + 1
        self._idle.clear()
        try:
            if request.prompts:
                # Padded on the left: a causal LM continues after the last position (it can
                # generate: checked above).
                batch = await host.run_tokenizer(
                    tokenize_texts, host, list(request.prompts), add_special_tokens=None,
                    padding_side="left", max_prompt_tokens=self.limits.max_prompt_tokens, field="prompts",
                )
                ids, mask = batch.input_ids, batch.attention_mask
            else:
                ids, mask = self._decode_ids(request, host)
            if n > 1:  # each prompt's n sequences together, as num_return_sequences lays them out
                ids, mask = ids.repeat_interleave(n, dim=0), mask.repeat_interleave(n, dim=0)
            # Prompt and new tokens must fit, as serving engines require.
            check_positions(positions, host.name, ids.shape[1] + options.max_new_tokens,
                            f"max_new_tokens: the prompt's {ids.shape[1]} tokens and {options.max_new_tokens} new tokens")
            stop_criteria = None
            if options.stop:  # built on the tokenizer's thread: it reads the tokenizer's vocabulary
                stop_criteria = await host.run_tokenizer(_stop_criteria, host.tokenizer, options.stop)
            request_id = take_request_id()  # the RPC's: its audit line names it too
            records, group = await self._admission.request_hooks(host, request.hooks, request_id, session, principal)
            # Its prompt pass and its KV cache at full length, claimed in the server's memory
            # budget for the call's life: one that can never fit is refused before it starts.
            rows, prompt, captures = int(ids.shape[0]), int(ids.shape[1]), captured_modules(records)
            claim = await self._admission.claim_memory(
                host, self._engines.engine(host), f"Generate on {host.name!r}",
                lambda estimator: estimator.generate(rows, prompt, options.max_new_tokens, captures=captures),
            )
            run = self._run(request, host, principal, options, ids, mask, request_id, records, stop_criteria,
                            session.stream if session is not None else None,
                            group=group, claim=claim)
            try:
                async for message in run:
                    yield message
            finally:
                # Closed now, not when collected: its cleanup (detaching the call's hooks,
                # CallEnded markers, freeing the KV cache) must run when the call ends.
                try:
                    await run.aclose()
                finally:  # (a cleanup that fails must not keep the call's bytes in the budget)
                    if claim is not None:
                        claim.release()
        finally:
            self._active[host.name] -= 1
            self._by_principal[principal.name] -= 1
            if not self._by_principal[principal.name]:
                del self._by_principal[principal.name]
            if not any(self._active.values()):
                self._idle.set()

    async def _take(self, mailbox: _Mailbox, work: Work, host: ModelHost) -> list[tuple[Any, ...]]:
        """The mailbox's next messages, up to a step's end or the call's. A call whose next
        step a full stream of the call's holds back (its reader stalled: see scheduler.py)
        for generate_idle_timeout fails with DEADLINE_EXCEEDED; a call that waits for a
        busy model waits as long as it takes."""
        idle = self.limits.generate_idle_timeout
        while True:
            since = work.stalled_since
            wait = idle if since is None else max(0.0, since + idle - time.perf_counter())
            items = await mailbox.take(wait)
            if items:
                return items
            since = work.stalled_since
            if since is not None and time.perf_counter() - since >= idle:
                raise _idle_error(host, "one of its event streams stayed full (its reader took too little)", idle)

    async def _backlog_delivered(self, p: Pass, host: ModelHost) -> None:
        """Waits until the step's events that a full stream could not take during the step
        are delivered (a thread of its own waits for the reader); DEADLINE_EXCEEDED after
        generate_idle_timeout."""
        idle = self.limits.generate_idle_timeout
        try:
            await asyncio.wait_for(in_own_thread(p.flush_backlog, f"backlog:{p.request_id}"), idle)
        except asyncio.TimeoutError:
            raise _idle_error(host, "a reader of one of its event streams took nothing", idle) from None

    async def _run(
        self, request: model_service_pb2.GenerateRequest, host: ModelHost, principal: Principal,
        options: GenerateOptions, ids: torch.Tensor, mask: torch.Tensor, request_id: str, records: list[HookRecord],
        stop_criteria: Any, session_stream: Any, *, group: str | None = None, claim: Claim | None = None,
    ) -> AsyncGenerator[model_service_pb2.GenerateResponse | bytes, None]:
        mailbox = _Mailbox(asyncio.get_running_loop(), self._hooks.held_bytes, principal.name)
        front = current_front()  # the metrics' label: the call's RPC context, read once
        put = mailbox.put
        p = Pass(
            request_id, request.session_id, frozenset(request.tags), principal=principal.name,
            max_events=self.limits.max_events_per_call, model=host.name,
            sink=lambda event, chunker: put(("event", event, chunker)), session_stream=session_stream,
        )
        p.notices = lambda notice: put(("notice", notice))
        p.held_bytes = self._hooks.held_bytes
        chunk_bytes = chunk_bytes_for(request.max_response_message_bytes or DEFAULT_MAX_MESSAGE_BYTES)
        p.framing = Framing(GENERATE_RESPONSE_CHUNK, chunk_bytes)
        detokenizer = host.detokenizer
        started = tokens_at = time.perf_counter()
        batch = int(ids.shape[0])
        # What the stream sent: the call's tokens and why each sequence ended, as of the
        # last step streamed (GenerateDone reports these: an engine may have run ahead).
        tokens: list[list[int]] = [[] for _ in range(batch)]
        reasons = [""] * batch
        stopped: Mapping[int, tuple[str, str, int]] = {}  # sequences a stop rule ended (GenerateDone names it)
        texts = [TextDeltas() for _ in range(batch)]
        streamed = 0  # steps whose tokens the stream took (sent, or waiting in `grouped`)
        # GenerateRequest.stream_interval: steps' tokens sent together, as one `steps` message.
        interval = request.stream_interval
        grouped: list[model_service_pb2.GeneratedTokens] = []
        began = False  # the engine started the call (its `started` went out)
        outcome = "error"
        call = GenerateCall(p, records, ids, mask, options, stop_criteria, put, group)
        work = Work(GENERATE, call, key=self._engines.engine(host).generate_key(call), rows=batch, group=group, caller=(request.session_id, principal.name),
                    running=True)
        # Submitted once: the engine starts the call, runs its steps as the stream allows
        # them and ends it; what it produced, and how the call ended if not by its last
        # step ("ended"), come through the mailbox.
        items: list[tuple[Any, ...]] = []
        last: tuple[Any, ...] = ()
        queued = False
        try:
            self._engines.start(host, work)
            queued = True
            step = 0
            while True:
                items = await self._take(mailbox, work, host)
                if not began and call.decoder is not None:
                    # The engine started the call (its decoding state is set before anything
                    # of the call reaches the mailbox): `started` goes before the rest.
                    began = True
                    msg = model_service_pb2.GenerateResponse()
                    msg.started.request_id = request_id
                    _codec.encode_tensor_into(ids, msg.started.input_ids)
                    _codec.encode_tensor_into(mask, msg.started.attention_mask)
                    msg.started.hook_ids.extend(r.hook_id for r in records)
                    for modules in hook_modules(records):
                        msg.started.hook_modules.add().modules.extend(modules)
                    msg.started.seed = options.seed
                    msg.started.do_sample = bool(call.decoder.do_sample)
                    yield msg
                for out in _messages(items, chunk_bytes):
                    yield out
                last = items[-1]
                if last[0] == "ended":  # ended without its last step: the failure that ended it
                    if grouped:  # the steps it holds go first (their events went already)
                        yield model_service_pb2.GenerateResponse(steps=model_service_pb2.GeneratedSteps(steps=grouped))
                        grouped = []
                    raise last[1] or Unavailable(f"model {host.name!r} ended the Generate call (it is shutting down)")
                if last[0] != "step":
                    continue
                result: StepResult = last[1]
                if mailbox.failure is not None:  # steps ahead of the stream kept more than the principal may
                    if grouped:
                        yield model_service_pb2.GenerateResponse(steps=model_service_pb2.GeneratedSteps(steps=grouped))
                        grouped = []
                    raise mailbox.failure
                if p.backlog:  # a stream that blocks for the call was full: wait for its reader here, alone
                    await self._backlog_delivered(p, host)
                final = result.finished or step == options.max_new_tokens - 1
                stopping = not final and self._state.draining
                if not final and not stopping:
                    # The next step runs while this one's tokens are decoded and sent: at most
                    # one step ahead of the reader, who still pauses the call (and only it).
                    call.allowed = step + 1
                    work.queued_at = time.perf_counter()  # its wait for the model starts now
                    call.wake()
                    # Let the other calls of the pass allow theirs too, so that the scheduler
                    # starts the next pass before the streams decode and send this one's tokens
                    # (Scheduler._loop): the model runs while the event loop writes.
                    await asyncio.sleep(0)
                for i, token in enumerate(result.tokens):
                    if token != FINISHED:
                        tokens[i].append(token)
                reasons = list(result.reasons)
                stopped = result.stopped
                streamed = step + 1
                # TTFT and inter-token latency, as each step's tokens go to the stream.
                tokens_at, since = time.perf_counter(), tokens_at
                self._state.metrics.observe_tokens(host.name, tokens_at - since, first=step == 0, front=front)
                deltas = [""] * batch
                if detokenizer is not None:  # a sequence that ended now flushes its held-back text
                    deltas = [
                        texts[i].add(detokenizer, tokens[i], final=final or stopping or bool(result.reasons[i]))
                        if (token != FINISHED or final or stopping) else ""
                        for i, token in enumerate(result.tokens)
                    ]
                chosen = model_service_pb2.GeneratedTokens(step=step, token_ids=result.tokens, texts=deltas)
                if result.logprobs is not None or result.prompt_logprobs is not None:
                    _encode_logprobs(chosen, result)
                if interval <= 1 or step == 0:  # the first tokens at once: time to first token unchanged
                    yield model_service_pb2.GenerateResponse(tokens=chosen)
                else:  # after this step's events (yielded above), with the steps before it
                    grouped.append(chosen)
                    if len(grouped) == interval or final or stopping:
                        yield model_service_pb2.GenerateResponse(steps=model_service_pb2.GeneratedSteps(steps=grouped))
                        grouped = []
                if final or stopping:
                    call.ended = "length" if final else "shutdown"
                    reasons = [r or call.ended for r in reasons]
                    break
                step += 1
            done = model_service_pb2.GenerateDone(steps=streamed)
            for i, reason in enumerate(reasons):
                sequence = done.sequences.add(token_ids=tokens[i], text=texts[i].sent, finish_reason=reason or "length")
                if reason == "rule" and i in stopped:
                    hook_id, module, fired = stopped[i]
                    sequence.stopped_by.hook_id, sequence.stopped_by.module, sequence.stopped_by.step = hook_id, module, fired
            outcome = "ok" if "shutdown" not in reasons else "shutdown"
            yield model_service_pb2.GenerateResponse(done=done)
        except (asyncio.CancelledError, GeneratorExit):
            outcome = call.ended = "cancelled"
            raise
        except BaseException as exc:
            call.ended = "error"
            if grouped:  # a timeout or failure after steps it holds: they go first
                try:
                    yield model_service_pb2.GenerateResponse(steps=model_service_pb2.GeneratedSteps(steps=grouped))
                except Exception:  # the stream itself failed: the failure below is what counts
                    pass  # (its reader closing the stream, GeneratorExit, goes on out)
                grouped = []
            if isinstance(exc, DeadlineExceeded):
                outcome = call.ended = "timeout"
                p.abandon()  # events kept for a stalled reader are dropped with the call
            # The frames of the failing step hold the KV cache and its activations.
            raise release_failure(exc)
        finally:
            mailbox.release()
            if not work.future.done():
                # The engine ends it in its next plan, after the step in flight (if any): a
                # step still waiting never runs; its hooks detach, its events end (CallEnded
                # markers on session streams), its KV cache is freed. Not awaited: the client
                # may be gone, and the model is free for others at once.
                call.ended = call.ended or "cancelled"
                call.wake()
                if claim is not None and queued:  # its step in flight and its KV cache live on
                    claim.hold_until(work.future)  # until then: so does its claim in the budget
            elapsed = time.perf_counter() - started
            metrics = self._state.metrics
            metrics.generate_seconds.labels(host.name, front).observe(elapsed)
            if began:
                metrics.generated_tokens.labels(host.name).inc(sum(len(t) for t in tokens))
            log.info(
                "generate %s", outcome,
                extra={"request_id": request_id, "model": host.name, "session_id": request.session_id,
                       "duration_ms": round(elapsed * 1e3, 3), "hooks": len(records),
                       "steps": streamed},
            )
            # Not kept with this frame, which a failure's traceback (held by gRPC for a while)
            # keeps: the mailbox's items hold the failure, and the call its decoding state.
            del work, call, items, last


def _encode_logprobs(chosen: model_service_pb2.GeneratedTokens, result: StepResult) -> None:
    """A step's log-probabilities (StepResult.logprobs, .prompt_logprobs) into its
    GeneratedTokens message."""
    def fill(out: model_service_pb2.TokenLogprobs, entry: TokenLogprobs | None) -> None:
        if entry is not None:
            out.logprob = entry.logprob
            out.top_token_ids.extend(token for token, _ in entry.top)
            out.top_logprobs.extend(value for _, value in entry.top)

    for entry in result.logprobs or ():
        fill(chosen.logprobs.add(), entry)
    for sequence in result.prompt_logprobs or ():
        run = chosen.prompt_logprobs.add()
        for entry in sequence:
            fill(run.tokens.add(), entry)


def _idle_error(host: ModelHost, what: str, idle: float) -> DeadlineExceeded:
    return DeadlineExceeded(
        f"Generate on {host.name!r}: {what} for {idle:g} s (generate_idle_timeout); the call ended and its "
        "generation slot and KV cache were freed"
    )


def _vocab_size(host: ModelHost) -> int | None:
    embeddings = getattr(host.module, "get_input_embeddings", None)
    try:
        layer = embeddings() if callable(embeddings) else None
    except Exception:
        return None
    size = getattr(layer, "num_embeddings", None)
    return int(size) if isinstance(size, int) else None


def _stop_criteria(tokenizer: Any, stop: tuple[str, ...]) -> Any:
    """transformers' StopStringCriteria for ``stop`` (what generate(stop_strings=...,
    tokenizer=...) builds); InvalidArgument naming a stop string the tokenizer cannot
    spell. Tokenizer thread: its cost grows with the vocabulary times the stop strings'
    length, which max_stop_chars bounds.

    transformers keeps the table it builds in a process-wide cache of 8 entries, each
    vocabulary x characters large; it is dropped again here (the criterion keeps its
    own reference while the call runs), so clients cannot fill that cache.
    """
    from transformers import StoppingCriteriaList, StopStringCriteria
    from transformers.generation import stopping_criteria

    cache = stopping_criteria.STOP_STRING_EMBEDDING_CACHE
    before = set(cache)
    try:
        try:
            return StoppingCriteriaList([StopStringCriteria(tokenizer, list(stop))])
        except Exception as exc:
            for i, text in enumerate(stop):  # which one
                try:
                    StopStringCriteria(tokenizer, [text])
                except Exception as one:
                    raise InvalidArgument(f"stop[{i}]: the tokenizer cannot spell {text!r}: {one}") from None
            raise InvalidArgument(f"stop: the tokenizer cannot match these stop strings: {exc}") from None
    finally:
        for key in set(cache) - before:
            cache.pop(key, None)
