"""Results as small frozen dataclasses built from the wire in one place; ``.raw`` keeps the message."""

from __future__ import annotations

import dataclasses
import datetime
import functools
from typing import Any, ClassVar, Mapping, Sequence

from .wire import codec
from .v1 import hook_pb2, hook_service_pb2, model_service_pb2, tensor_pb2

PHASE_NAMES = {
    hook_pb2.PHASE_FORWARD_PRE: "forward_pre",
    hook_pb2.PHASE_FORWARD: "forward",
    hook_pb2.PHASE_BACKWARD_PRE: "backward_pre",
    hook_pb2.PHASE_BACKWARD: "backward",
}


#: ModelState names; a server older than model states sends UNSPECIFIED, and
#: everything it lists is ready.
_MODEL_STATES = {
    model_service_pb2.MODEL_STATE_UNSPECIFIED: "ready",
    model_service_pb2.MODEL_STATE_LOADING: "loading",
    model_service_pb2.MODEL_STATE_READY: "ready",
    model_service_pb2.MODEL_STATE_FAILED: "failed",
}


@dataclasses.dataclass(frozen=True)
class ParameterInfo:
    """One parameter of a module."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool


@dataclasses.dataclass(frozen=True)
class ModuleInfo:
    """One module: its path ("" = root), class name and own parameters."""

    path: str
    type: str
    parameters: tuple[ParameterInfo, ...]


@dataclasses.dataclass(frozen=True)
class BatchingInfo:
    """How the server joins concurrent calls on a model into shared forward passes
    (docs/batching.md). A hook still sees only its own call's rows either way."""

    #: Whether calls are joined at all.
    enabled: bool
    #: Most rows (summed over the joined calls) in one pass.
    max_batch_size: int
    #: How long the first call of a pass waits for others to join (0: only those already waiting).
    max_batch_delay_ms: float
    #: The dimension calls' rows are stacked and sliced along.
    batch_dim: int
    #: Keyword inputs that make a call run alone.
    reducing_inputs: tuple[str, ...]
    #: Whether token inputs of different lengths join (padded on the right).
    pads_tokens: bool


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """A configured model. ``modules`` is empty in list_models() results, and until
    the model is ready.

    ``state`` is "loading" (calls raise UnavailableError: retry, or wait with
    ``client.wait_ready``), "ready", or "failed" (calls raise
    FailedPreconditionError; ``state_message`` says why).
    """

    name: str
    description: str
    training_allowed: bool
    modules: tuple[ModuleInfo, ...]
    raw: model_service_pb2.Model = dataclasses.field(repr=False, compare=False)
    state: str = "ready"
    #: Why the model failed to load ("" unless state is "failed").
    state_message: str = ""
    #: Whether ``generate`` runs on it (a causal language model); False until it is ready.
    can_generate: bool = False
    #: Whether it has a tokenizer (``tokenize``, text prompts for ``generate``); False
    #: until it is ready.
    has_tokenizer: bool = False
    #: Its batching settings; None until it is ready (or from a server without batching).
    batching: BatchingInfo | None = None
    #: Whether ``RemoteModel.parameters`` may read its weights (the model config's
    #: ``parameters_readable``, off unless the operator sets it).
    parameters_readable: bool = False
    #: Where its modules live when the server loaded it with a device map (module path to
    #: "cpu", "disk" or an accelerator such as "cuda:1"); {} for a model on one device.
    device_map: dict[str, str] = dataclasses.field(default_factory=dict)
    #: The engine that runs it: "torch" (any PyTorch module) or another engine's name;
    #: "" until it is ready.
    engine: str = ""
    #: What that engine does not run: feature ("backward", "train", "generate",
    #: "harvest", "attention_probabilities") -> why; {} when it refuses nothing. Calls
    #: and hooks that need one raise UnimplementedError.
    refused_features: dict[str, str] = dataclasses.field(default_factory=dict)
    #: Whether it runs compiled (vLLM's compiled mode): hooks go only on ``tap_points``
    #: inside the compiled graph (and on modules outside it, such as the logits head).
    compiled: bool = False
    #: A compiled model's tap points, as module paths (empty for an eager model): a hook
    #: on another module inside the graph raises FailedPreconditionError naming them.
    tap_points: tuple[str, ...] = ()

    @classmethod
    def from_proto(cls, msg: model_service_pb2.Model) -> ModelInfo:
        """Builds it from the wire message."""
        return cls(
            name=msg.name,
            description=msg.description,
            training_allowed=msg.training_allowed,
            state=_MODEL_STATES.get(msg.state, "ready"),
            state_message=msg.state_message,
            can_generate=msg.can_generate,
            has_tokenizer=msg.has_tokenizer,
            parameters_readable=msg.parameters_readable,
            device_map=dict(msg.device_map),
            engine=msg.engine,
            refused_features={f.feature: f.reason for f in msg.refused_features},
            compiled=msg.compiled,
            tap_points=tuple(msg.tap_points),
            batching=BatchingInfo(
                enabled=b.enabled, max_batch_size=b.max_batch_size, max_batch_delay_ms=b.max_batch_delay_ms,
                batch_dim=b.batch_dim, reducing_inputs=tuple(b.reducing_inputs), pads_tokens=b.pads_tokens,
            ) if msg.HasField("batching") and (b := msg.batching) is not None else None,
            modules=tuple(
                ModuleInfo(
                    path=m.path,
                    type=m.type,
                    parameters=tuple(
                        ParameterInfo(p.name, tuple(p.shape), codec.dtype_name(p.dtype).removeprefix("DTYPE_").lower(), p.requires_grad)
                        for p in m.parameters
                    ),
                )
                for m in msg.modules
            ),
            raw=msg,
        )


@dataclasses.dataclass(frozen=True)
class InterceptEvent:
    """What a hook saw when it fired. Parts that were not captured are empty / None.

    ``phase`` is one of "forward_pre", "forward", "backward_pre", "backward".
    Tensors are torch tensors, or numpy arrays when torch is not installed.
    """

    hook_id: str
    model: str
    module: str
    phase: str
    seq: int
    call_index: int
    request_id: str
    training: bool
    time: datetime.datetime
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any
    grad_input: tuple[Any, ...]
    grad_output: tuple[Any, ...]
    #: Events the stream had dropped when this one was queued (drop policies).
    dropped: int
    raw: hook_pb2.InterceptEvent = dataclasses.field(repr=False, compare=False)
    #: The server ("host:port") it came from, when read through a fleet client; else "".
    replica: str = ""
    #: The pass of the call it fired in: the step of a Generate call (0 for the prompt
    #: pass, s for the pass that consumed the s-th new token); 0 for Infer calls.
    #: ``call_index`` counts within this one pass.
    step: int = 0
    #: The devices the captured tensors were on in the server's hook ("cpu", "cuda:1"),
    #: each once, in the order of the tensors; () when nothing tensor-valued was captured.
    #: The tensors themselves arrive in host memory.
    devices: tuple[str, ...] = ()
    #: For a request-scoped hook's event: the hook's position in the call's ``hooks=``
    #: list, plus one; 0 for a registered (session or TTL) hook.
    request_hook_index: int = 0

    @classmethod
    def from_proto(cls, msg: hook_pb2.InterceptEvent, chunked: Mapping[int, Any] | None = None) -> InterceptEvent:
        """Decodes the wire message (tensors included; chunked ones from ``chunked``)."""
        decode = functools.partial(codec.decode_value, chunked=chunked, on_summary=TensorSummary.from_proto)
        return cls(
            hook_id=msg.hook_id,
            model=msg.model,
            module=msg.module,
            phase=PHASE_NAMES.get(msg.phase, "unspecified"),
            seq=msg.seq,
            call_index=msg.call_index,
            request_id=msg.request_id,
            training=msg.training,
            time=msg.time.ToDatetime(tzinfo=datetime.timezone.utc),
            args=tuple(decode(v, where=f"args[{i}]") for i, v in enumerate(msg.args)),
            kwargs={k: decode(v, where=f"kwargs[{k!r}]") for k, v in msg.kwargs.items()},
            output=decode(msg.output, where="output") if msg.HasField("output") else None,
            grad_input=tuple(decode(v, where=f"grad_input[{i}]") for i, v in enumerate(msg.grad_input)),
            grad_output=tuple(decode(v, where=f"grad_output[{i}]") for i, v in enumerate(msg.grad_output)),
            dropped=msg.dropped,
            raw=msg,
            step=msg.step,
            devices=tuple(msg.devices),
            request_hook_index=msg.request_hook_index,
        )

    @classmethod
    def expand(
        cls, msg: hook_pb2.InterceptEvent, chunked: Mapping[int, Any] | None = None, *,
        call: CallHooks | None = None, modules: Sequence[str] | None = None,
    ) -> list[InterceptEvent]:
        """The events ``msg`` stands for: itself, decoded (``from_proto``), or, for a
        compact readout event (``module_indices`` set; Readout.compact), one event per
        module it stacks, each with its module's readout, in the stacked order. They share
        the wire event's ``seq``, ``time`` (when its first module fired) and ``raw``; the
        first carries its ``dropped``, the others 0. ``modules`` are the hook's resolved
        modules (``HookInfo.modules``); for a request-scoped hook's event they come from
        ``call``, which also gives what the server left out of such an event in the
        call's own stream (``hook_id``, ``model``, ``request_id``). A module the SDK
        cannot name is "#INDEX"."""
        event = cls.from_proto(msg, chunked)
        if not msg.module_indices:
            return [event]
        fill: dict[str, Any] = {}
        if call is not None and msg.request_hook_index:
            position = msg.request_hook_index - 1
            if modules is None and position < len(call.modules):
                modules = call.modules[position]
            if not msg.hook_id:
                fill = {"hook_id": call.hook_ids[position] if position < len(call.hook_ids) else "",
                        "model": call.model, "request_id": call.request_id}
        names = list(modules or ())
        return [
            dataclasses.replace(
                event, **fill,
                module=names[index] if index < len(names) else f"#{index}",
                args=tuple(_row(v, i) for v in event.args),
                kwargs={k: _row(v, i) for k, v in event.kwargs.items()},
                output=_row(event.output, i),
                grad_input=tuple(_row(v, i) for v in event.grad_input),
                grad_output=tuple(_row(v, i) for v in event.grad_output),
                dropped=event.dropped if i == 0 else 0,  # the drops in front of the wire event, once
            )
            for i, index in enumerate(msg.module_indices)
        ]


@dataclasses.dataclass(frozen=True)
class CallHooks:
    """What a call says about its request-scoped hooks (InferResponse, GenerateStarted):
    what ``InterceptEvent.expand`` reads to expand their compact readout events."""

    model: str
    request_id: str
    hook_ids: tuple[str, ...]
    modules: tuple[tuple[str, ...], ...]

    @classmethod
    def of(cls, model: str, msg: Any) -> CallHooks:
        """From an InferResponse or a GenerateStarted of a call on ``model``."""
        return cls(model, msg.request_id, tuple(msg.hook_ids), tuple(tuple(m.modules) for m in msg.hook_modules))


def _row(value: Any, i: int) -> Any:
    """Module ``i``'s part of a stacked value (tensors along their first dimension)."""
    if value is None or isinstance(value, (str, bytes, bool, int, float, TensorSummary)):
        return value
    if isinstance(value, Mapping):
        return {k: _row(v, i) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_row(v, i) for v in value)
    return value[i]


@dataclasses.dataclass(frozen=True)
class TensorSummary:
    """Statistics the server computed instead of sending a tensor (torch reductions in float64)."""

    dtype: str
    shape: tuple[int, ...]
    numel: int
    min: float
    max: float
    mean: float
    std: float
    l2_norm: float
    nan_count: int
    inf_count: int
    #: Counts of finite values in equal-width bins over [histogram_min, histogram_max]; () if not asked.
    histogram: tuple[int, ...]
    histogram_min: float
    histogram_max: float

    @classmethod
    def from_proto(cls, msg: tensor_pb2.TensorSummary) -> TensorSummary:
        """Builds it from the wire message."""
        return cls(
            codec.dtype_name(msg.dtype).removeprefix("DTYPE_").lower(), tuple(msg.shape), msg.numel, msg.min,
            msg.max, msg.mean, msg.std, msg.l2_norm, msg.nan_count, msg.inf_count, tuple(msg.histogram),
            msg.histogram_min, msg.histogram_max,
        )


@dataclasses.dataclass(frozen=True)
class InferResult:
    """The result of ``RemoteModel.infer``."""

    request_id: str
    output: Any
    #: Events of the call's own hooks, in firing order.
    events: tuple[InterceptEvent, ...]
    #: The ids given to the call's hooks, in the order they were passed.
    hook_ids: tuple[str, ...]
    #: With return_input_grads: per positional argument, its gradient (same structure).
    input_grads: tuple[Any, ...]
    #: With return_input_grads: per keyword argument, its gradient.
    input_kwargs_grads: dict[str, Any]
    #: The reply. Its large tensors (64 KiB and more) carry a chunk_id instead of their
    #: data, which went straight into the decoded tensors (as in an InferStream reply).
    raw: model_service_pb2.InferResponse = dataclasses.field(repr=False, compare=False)

    @classmethod
    def from_proto(
        cls, msg: model_service_pb2.InferResponse, chunked: Mapping[int, Any] | None = None, *, model: str = "",
    ) -> InferResult:
        """Decodes the wire message (chunked tensors from ``chunked``; compact readout
        events expanded, ``model`` naming the call's model in them)."""
        decode = functools.partial(codec.decode_value, chunked=chunked, on_summary=TensorSummary.from_proto)
        return cls(
            request_id=msg.request_id,
            output=decode(msg.output, where="output"),
            events=tuple(
                expanded for e in msg.events
                for expanded in InterceptEvent.expand(e, chunked, call=CallHooks.of(model, msg))),
            hook_ids=tuple(msg.hook_ids),
            input_grads=tuple(decode(v) for v in msg.input_grads),
            input_kwargs_grads={k: decode(v) for k, v in msg.input_kwargs_grads.items()},
            raw=msg,
        )


@dataclasses.dataclass(frozen=True)
class Tokenized:
    """The result of ``RemoteModel.tokenize``: texts tokenized by the model's tokenizer
    and padded into one batch, as transformers' ``tokenizer(texts, padding=True,
    return_tensors="pt")`` returns them. Tensors are torch tensors, or numpy arrays
    where torch is not installed."""

    #: int64 [batch, seq], one row per text, padded with the tokenizer's pad id.
    input_ids: Any
    #: int64 [batch, seq]: 1 for a real token, 0 for padding.
    attention_mask: Any
    #: Each text's token strings (the tokenizer's own spelling, e.g. "Ġthe"), padding
    #: excluded: as many as its row of attention_mask has ones.
    pieces: list[list[str]]
    raw: model_service_pb2.TokenizeResponse = dataclasses.field(repr=False, compare=False)

    @classmethod
    def from_proto(cls, msg: model_service_pb2.TokenizeResponse) -> Tokenized:
        """Decodes the wire message."""
        return cls(
            input_ids=codec.decode_tensor(msg.input_ids, where="input_ids"),
            attention_mask=codec.decode_tensor(msg.attention_mask, where="attention_mask"),
            pieces=[list(t.pieces) for t in msg.tokens],
            raw=msg,
        )


@dataclasses.dataclass(frozen=True)
class HookInfo:
    """A registered hook as the server lists it."""

    hook_id: str
    model: str
    module_pattern: str
    modules: tuple[str, ...]
    session_id: str
    #: Why a failing rule or capture disabled the hook; "" while it is active.
    disabled_reason: str
    #: "session", "all" or "tagged".
    scope: str
    fire_count: int
    events_sent: int
    events_dropped: int
    errors: int
    last_fired: datetime.datetime | None
    #: When a hook without a session expires.
    expires: datetime.datetime | None
    #: The wire message. Its ``spec``'s rule operand tensors have dtype and shape but no
    #: data unless listed with ``list_hooks(include_operand_data=True)``.
    raw: hook_pb2.Hook = dataclasses.field(repr=False, compare=False)

    @classmethod
    def from_proto(cls, msg: hook_pb2.Hook) -> HookInfo:
        """Builds it from the wire message."""
        utc = datetime.timezone.utc
        scope = hook_pb2.Scope.Name(msg.spec.scope or hook_pb2.SCOPE_SESSION).removeprefix("SCOPE_").lower()
        return cls(
            msg.hook_id, msg.spec.model, msg.spec.module, tuple(msg.modules), msg.session_id, msg.disabled_reason,
            scope, msg.fire_count, msg.events_sent, msg.events_dropped, msg.errors,
            msg.last_fired.ToDatetime(tzinfo=utc) if msg.HasField("last_fired") else None,
            msg.expires.ToDatetime(tzinfo=utc) if msg.HasField("expires") else None,
            msg,
        )


@dataclasses.dataclass(frozen=True)
class SlotInfo:
    """A slot of a session: a tensor kept on the server by a ``save`` rule."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @classmethod
    def from_proto(cls, msg: hook_service_pb2.Slot) -> SlotInfo:
        """Builds it from the wire message."""
        return cls(msg.name, codec.dtype_name(msg.dtype).removeprefix("DTYPE_").lower(), tuple(msg.shape), msg.nbytes)


@dataclasses.dataclass(frozen=True)
class Notice:
    """An out-of-band message on a stream: ``kind`` is "hook_removed", "hook_disabled", "capture_failed",
    "drops_started", "drops_ended" or "hook_restored" (a hook without a session came back after a
    server restart; ``message`` says when it captured nothing)."""

    kind: str
    hook_id: str
    message: str
    #: For "drops_started" / "drops_ended": the stream's drop total so far.
    dropped: int = 0

    @classmethod
    def from_proto(cls, msg: hook_service_pb2.Notice) -> Notice:
        """Builds it from the wire message."""
        name = hook_service_pb2.NoticeKind.Name(msg.kind) if msg.kind in hook_service_pb2.NoticeKind.values() else "NOTICE_KIND_UNSPECIFIED"
        return cls(name.removeprefix("NOTICE_KIND_").lower(), msg.hook_id, msg.message, msg.dropped)


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """The log-probabilities at one position of a sequence (``generate(logprobs=...)``,
    ``prompt_logprobs=...``): its token's and the ``top`` most likely tokens', most
    likely first, as (token id, log-probability). float32 log-softmax of the model's
    raw logits, before temperature, top-k, top-p and the other processors."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    @classmethod
    def from_proto(cls, msg: model_service_pb2.TokenLogprobs) -> TokenLogprob:
        """Builds it from the wire message."""
        return cls(msg.logprob, tuple(zip((int(t) for t in msg.top_token_ids), (float(v) for v in msg.top_logprobs))))


@dataclasses.dataclass(frozen=True)
class GeneratedTokens:
    """The tokens one step of a Generate call chose, one entry per sequence (an item of
    ``model.generate``). Step 0 is the pass over the prompt, so the first new tokens
    come with step 0; step s consumed the tokens of step s - 1."""

    #: A ``token_ids`` entry for a sequence that had already finished: it stays in the
    #: batch until the call ends (so event rows keep their meaning) and gets no new
    #: token. In-process ``generate()`` pads it with the pad token instead.
    FINISHED: ClassVar[int] = -1

    step: int
    #: Per sequence: the new token, or FINISHED (-1) for a sequence that had ended.
    token_ids: tuple[int, ...]
    #: Per sequence: the text this step added (special tokens skipped). The texts of all
    #: steps concatenate to the final text; a step may add "" while a multi-byte
    #: character is incomplete.
    texts: tuple[str, ...]
    raw: model_service_pb2.GeneratedTokens = dataclasses.field(repr=False, compare=False)
    #: With ``generate(logprobs=...)``: per sequence, the chosen token's log-probabilities
    #: (None for a FINISHED entry); empty otherwise.
    logprobs: tuple[TokenLogprob | None, ...] = ()
    #: With ``generate(prompt_logprobs=...)``, at step 0 only: per sequence, one entry per
    #: prompt token after the first (padding skipped); empty otherwise.
    prompt_logprobs: tuple[tuple[TokenLogprob, ...], ...] = ()

    @classmethod
    def from_proto(cls, msg: model_service_pb2.GeneratedTokens) -> GeneratedTokens:
        """Builds it from the wire message."""
        logprobs = tuple(None if token == cls.FINISHED else TokenLogprob.from_proto(entry)
                         for token, entry in zip(msg.token_ids, msg.logprobs))
        prompt = tuple(tuple(TokenLogprob.from_proto(t) for t in run.tokens) for run in msg.prompt_logprobs)
        return cls(step=msg.step, token_ids=tuple(msg.token_ids), texts=tuple(msg.texts), raw=msg,
                   logprobs=logprobs, prompt_logprobs=prompt)


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    """The result of a Generate call (``await model.generate(...)``). Tensors are torch
    tensors, or numpy arrays where torch is not installed."""

    request_id: str
    #: The seed of the call's random generator (the one given, or the one the server
    #: drew): pass it back as ``seed=`` to reproduce a sampled generation.
    seed: int
    #: Whether the call sampled (``do_sample``, or the model's generation_config).
    do_sample: bool
    #: The ids given to the call's hooks, in the order they were passed.
    hook_ids: tuple[str, ...]
    #: The prompt ids as the model saw them: int64 [batch, prompt_len], padded on the left.
    input_ids: Any
    #: int64 [batch, prompt_len]: 1 for a real token, 0 for padding.
    attention_mask: Any
    #: Per sequence: the new text (special tokens skipped; "" for a model without a tokenizer).
    texts: tuple[str, ...]
    #: Per sequence: the new token ids, up to and including the one that ended it.
    token_ids: tuple[tuple[int, ...], ...]
    #: Per sequence: "length", "eos", "stop", "rule" (a stop rule: ``stopped_by``),
    #: "cancelled" or "shutdown".
    finish_reasons: tuple[str, ...]
    #: Passes run: steps 0 .. steps - 1.
    steps: int
    #: Events of the call's own hooks, in firing order (empty with ``keep_events=False``).
    events: tuple[InterceptEvent, ...]
    #: The same events grouped by step: ``events_by_step[s]`` holds step s's, in firing
    #: order; one entry per step, empty where no hook fired.
    events_by_step: tuple[tuple[InterceptEvent, ...], ...]
    #: Notices about the call's own hooks (e.g. one disabled by a failing rule).
    notices: tuple[Notice, ...]
    #: The stream's last message (GenerateDone).
    raw: model_service_pb2.GenerateDone = dataclasses.field(repr=False, compare=False)
    #: Per sequence: for one a stop rule ended (finish reason "rule"), the rule that
    #: fired as (hook id, module, step); None for the others.
    stopped_by: tuple[tuple[str, str, int] | None, ...] = ()
    #: With ``generate(logprobs=...)``: per sequence, one entry per token of ``token_ids``;
    #: empty otherwise.
    logprobs: tuple[tuple[TokenLogprob, ...], ...] = ()
    #: With ``generate(prompt_logprobs=...)``: per sequence, one entry per prompt token
    #: after the first (padding skipped); empty otherwise.
    prompt_logprobs: tuple[tuple[TokenLogprob, ...], ...] = ()

    @classmethod
    def from_stream(
        cls, started: model_service_pb2.GenerateStarted, events: Sequence[InterceptEvent],
        done: model_service_pb2.GenerateDone, notices: Sequence[Notice] = (),
        steps: Sequence[GeneratedTokens] = (),
    ) -> GenerateResult:
        """Builds it from the stream's first and last messages and the events between."""
        by_step: list[list[InterceptEvent]] = [[] for _ in range(done.steps)]
        for event in events:
            while event.step >= len(by_step):  # never for a well-formed stream; keep every event anyway
                by_step.append([])
            by_step[event.step].append(event)
        return cls(
            request_id=started.request_id,
            seed=started.seed,
            do_sample=started.do_sample,
            hook_ids=tuple(started.hook_ids),
            input_ids=codec.decode_tensor(started.input_ids, where="input_ids"),
            attention_mask=codec.decode_tensor(started.attention_mask, where="attention_mask"),
            texts=tuple(s.text for s in done.sequences),
            token_ids=tuple(tuple(s.token_ids) for s in done.sequences),
            finish_reasons=tuple(s.finish_reason for s in done.sequences),
            steps=done.steps,
            events=tuple(events),
            events_by_step=tuple(tuple(step) for step in by_step),
            notices=tuple(notices),
            raw=done,
            stopped_by=tuple((s.stopped_by.hook_id, s.stopped_by.module, s.stopped_by.step)
                             if s.HasField("stopped_by") else None for s in done.sequences),
            logprobs=_sequence_logprobs(steps, len(done.sequences)),
            prompt_logprobs=next((step.prompt_logprobs for step in steps if step.prompt_logprobs), ()),
        )


def _sequence_logprobs(steps: Sequence[GeneratedTokens], sequences: int) -> tuple[tuple[TokenLogprob, ...], ...]:
    """Per sequence, the log-probabilities of its tokens over ``steps`` (empty when no
    step carried any)."""
    if not any(step.logprobs for step in steps):
        return ()
    out: list[list[TokenLogprob]] = [[] for _ in range(sequences)]
    for step in steps:
        for i, entry in enumerate(step.logprobs[:sequences]):
            if entry is not None:
                out[i].append(entry)
    return tuple(tuple(run) for run in out)
