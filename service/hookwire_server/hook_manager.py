"""Hooks, sessions and subscriptions: the remote form of a local ``Hook`` object.

A HookRecord is one registered HookSpec. On each module its pattern resolves to,
it installs one real torch hook per action, with the spec's options (prepend,
with_kwargs, always_call), so ordering and visibility are torch's own. Each torch
hook checks at call time whether the hook applies to the running pass (scope),
counts the call, gates on the module's ``training`` flag, and captures.

Torch hook dictionaries are changed only on the model's worker thread, between
passes (see model_registry). A hook nobody listens to costs a counter bump: no
tensor is copied unless an event will be delivered.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable

from google.protobuf import timestamp_pb2
from torch.utils.hooks import RemovableHandle

from hookwire import _codec
from hookwire._codec import Chunker
from hookwire.v1 import hook_pb2, hook_service_pb2, rule_pb2

from . import limits
from .auth import ANONYMOUS, MINIMUM_ROLE, Principal, TokenStore
from .capture import CaptureOptions, Sampler
from .errors import InvalidArgument, NotFound, PermissionDenied, ResourceExhausted, Unavailable, Unimplemented
from .event_bus import DeliveryLimits, EventStream, HookCounters
from .metrics import Metrics
from .model_registry import ModelHost, ModelRegistry
from .rules import CompiledRule, RuleFailure, apply_rules, compile_rules, operand_tensors
from .limits import Limits
from .slots import DEFAULT_MAX_SLOT_BYTES, SlotStore

if TYPE_CHECKING:
    from .inference import Pass

log = logging.getLogger("hookwire.hooks")

SCOPE_REQUEST = -1  # internal: InferRequest.hooks, which have no wire scope value
_NO_METRICS = Metrics()  # for records built without a server (unit tests)
SHUTDOWN_REASON = "the server is shutting down"


@dataclasses.dataclass(frozen=True)
class PhaseInfo:
    """What one hook phase is called and what it can see."""

    phase: hook_pb2.Phase
    field: str  # the HookSpec field holding its action
    options_field: str
    parts: frozenset[int]


PHASES: tuple[PhaseInfo, ...] = (
    PhaseInfo(hook_pb2.PHASE_FORWARD_PRE, "prehook", "prehook_kwargs", frozenset({hook_pb2.PART_ARGS, hook_pb2.PART_KWARGS})),
    PhaseInfo(
        hook_pb2.PHASE_FORWARD, "posthook", "posthook_kwargs",
        frozenset({hook_pb2.PART_ARGS, hook_pb2.PART_KWARGS, hook_pb2.PART_OUTPUT}),
    ),
    PhaseInfo(hook_pb2.PHASE_BACKWARD_PRE, "backward_prehook", "backward_prehook_kwargs", frozenset({hook_pb2.PART_GRAD_OUTPUT})),
    PhaseInfo(
        hook_pb2.PHASE_BACKWARD, "backward_hook", "backward_hook_kwargs",
        frozenset({hook_pb2.PART_GRAD_INPUT, hook_pb2.PART_GRAD_OUTPUT}),
    ),
)


def _part_name(part: int) -> str:
    try:
        return hook_pb2.Part.Name(part)
    except ValueError:
        return f"unknown part {part}"


@dataclasses.dataclass(frozen=True)
class Action:
    """One validated hook action: the phase, the parts to capture and the torch options."""

    phase: hook_pb2.Phase
    capture: tuple[hook_pb2.Part, ...]
    with_kwargs: bool = False
    prepend: bool = False
    always_call: bool = False
    rules: tuple[CompiledRule, ...] = ()
    capture_before_rules: bool = False
    options: CaptureOptions = CaptureOptions()

    @property
    def modifies(self) -> bool:
        """Whether a rule changes values (save only reads)."""
        return any(rule.modifies for rule in self.rules)

    @property
    def uses_slots(self) -> bool:
        """Whether a rule saves or patches."""
        return any(rule.kind in ("save", "patch") for rule in self.rules)


@dataclasses.dataclass(frozen=True)
class CompiledSpec:
    """A HookSpec checked against its model: what to install where."""

    modules: tuple[str, ...]
    actions: tuple[Action, ...]
    train_update: bool
    eval_update: bool
    scope: int
    tags: frozenset[str]
    fail_call_on_error: bool

    @property
    def uses_slots(self) -> bool:
        """Whether a rule saves or patches (it then needs a session)."""
        return any(action.uses_slots for action in self.actions)


def compile_spec(
    spec: hook_pb2.HookSpec, host: ModelHost, *, request_scoped: bool, allow_shared_rules: bool = False,
    max_rules: int = 64,
) -> CompiledSpec:
    """Validates ``spec`` for ``host``; raises InvalidArgument, NotFound or PermissionDenied naming the field."""
    actions: list[Action] = []
    for info in PHASES:
        if not spec.HasField(info.field):  # type: ignore[arg-type]
            continue
        action_msg: hook_pb2.HookAction = getattr(spec, info.field)
        options = getattr(spec, info.options_field)
        with_kwargs = bool(getattr(options, "with_kwargs", False))
        parts: list[hook_pb2.Part] = []
        for i, part in enumerate(action_msg.capture):
            if part not in info.parts:
                visible = ", ".join(_part_name(p) for p in sorted(info.parts))
                raise InvalidArgument(
                    f"{info.field}.capture[{i}]: {_part_name(part)} is not visible to a {info.field} (it sees {visible})"
                )
            if part == hook_pb2.PART_KWARGS and not with_kwargs:
                raise InvalidArgument(
                    f"{info.field}.capture[{i}]: capturing PART_KWARGS needs {info.options_field}.with_kwargs "
                    "(without it, torch does not pass kwargs to the hook)"
                )
            if part not in parts:
                parts.append(part)
        if len(action_msg.rules) > max_rules:
            raise InvalidArgument(f"{info.field}.rules: {len(action_msg.rules)} rules, over the limit of {max_rules}")
        if action_msg.capture_stage not in rule_pb2.CaptureStage.values():
            raise InvalidArgument(f"{info.field}.capture_stage: unknown stage {action_msg.capture_stage}")
        actions.append(
            Action(
                phase=info.phase,
                capture=tuple(parts),
                with_kwargs=with_kwargs,
                prepend=bool(options.prepend),
                always_call=bool(getattr(options, "always_call", False)),
                rules=compile_rules(
                    action_msg.rules, phase=info.phase, phase_field=info.field, with_kwargs=with_kwargs,
                    device=host.device,
                ),
                capture_before_rules=action_msg.capture_stage == rule_pb2.CAPTURE_STAGE_BEFORE_RULES,
                options=CaptureOptions.compile(action_msg, info.field),
            )
        )
    if not actions:
        raise InvalidArgument(
            "the hook has no action: set at least one of prehook, posthook, backward_prehook, backward_hook"
        )
    if spec.scope not in hook_pb2.Scope.values():
        raise InvalidArgument(f"scope: unknown scope {spec.scope}")
    if request_scoped:
        if spec.scope not in (hook_pb2.SCOPE_UNSPECIFIED, hook_pb2.SCOPE_SESSION):
            raise InvalidArgument(
                f"scope: hooks in InferRequest.hooks fire for that call only; {hook_pb2.Scope.Name(spec.scope)} needs RegisterHook"
            )
        scope = SCOPE_REQUEST
    else:
        scope = spec.scope or hook_pb2.SCOPE_SESSION
    tags = frozenset(spec.tags)
    if scope == hook_pb2.SCOPE_TAGGED and not tags:
        raise InvalidArgument("tags: a SCOPE_TAGGED hook needs at least one tag")
    if tags and scope != hook_pb2.SCOPE_TAGGED:
        raise InvalidArgument("tags: only SCOPE_TAGGED hooks have tags")
    if "" in tags:
        raise InvalidArgument("tags: a tag cannot be empty")
    shared = scope in (hook_pb2.SCOPE_ALL, hook_pb2.SCOPE_TAGGED)
    if shared and not allow_shared_rules and spec.on_error == rule_pb2.ON_ERROR_FAIL_CALL:
        raise PermissionDenied(
            "on_error: ON_ERROR_FAIL_CALL on a shared hook would fail other callers' calls; this server does not "
            "allow it (start it with --allow-shared-rules)"
        )
    if shared and not allow_shared_rules and any(a.modifies for a in actions):
        raise PermissionDenied(
            f"rules on a {hook_pb2.Scope.Name(scope)} hook change other callers' results; this server does not "
            "allow them (start it with --allow-shared-rules)"
        )
    if spec.on_error not in rule_pb2.OnError.values():
        raise InvalidArgument(f"on_error: unknown policy {spec.on_error}")
    Sampler.compile(spec.sampling)  # validates
    fail_call = spec.on_error == rule_pb2.ON_ERROR_FAIL_CALL or (
        spec.on_error == rule_pb2.ON_ERROR_UNSPECIFIED and not shared
    )
    modules = tuple(host.resolve(spec.module))
    return CompiledSpec(
        modules=modules,
        actions=tuple(actions),
        train_update=spec.train_update if spec.HasField("train_update") else True,
        eval_update=spec.eval_update if spec.HasField("eval_update") else True,
        scope=scope,
        tags=tags,
        fail_call_on_error=fail_call,
    )


def require_hook_roles(principal: Principal, spec: hook_pb2.HookSpec, compiled: CompiledSpec, *, sessionless: bool) -> None:
    """PermissionDenied unless ``principal``'s role allows this hook: checked when it is
    registered, and again when a token reload changes its owner's role."""
    principal.require(MINIMUM_ROLE["RegisterHook"], "registering a hook")
    if compiled.scope in (hook_pb2.SCOPE_ALL, hook_pb2.SCOPE_TAGGED):
        principal.require("observer", "a SCOPE_ALL or SCOPE_TAGGED hook (other callers' traffic)")
        if any(a.modifies for a in compiled.actions) or spec.on_error == rule_pb2.ON_ERROR_FAIL_CALL:
            principal.require("operator", "rules that change or fail other callers' calls")
    if sessionless:
        principal.require("operator", "a hook without a session (it outlives its client)")


class HookRecord:
    """One registered hook and the torch hooks that implement it."""

    def __init__(
        self, hook_id: str, host: ModelHost, spec: hook_pb2.HookSpec, compiled: CompiledSpec,
        *, session_id: str = "", request_id: str = "", slots: SlotStore | None = None,
        metrics: Metrics | None = None, owner: Principal = ANONYMOUS,
    ) -> None:
        self.hook_id = hook_id
        #: Who registered it: only they (or an operator) see, subscribe to and remove it.
        self.owner = owner
        self.host = host
        #: The spec without its operands' bytes: ``compiled`` holds the one (decoded) copy.
        self.spec = _without_operand_data(spec)
        self.compiled = compiled
        self.session_id = session_id
        self.request_id = request_id
        #: Where events go; replaced, never mutated, so hook threads read it without a lock.
        self.streams: tuple[EventStream, ...] = ()
        self.subscriptions: list[Subscription] = []
        #: Where save/patch rules keep tensors: the owner's (or the request's) session.
        self.slots = slots
        self.active = False
        self.removed = False
        #: Set (once) when a failing rule or capture disabled the hook.
        self.disabled_reason = ""
        self.fire_count = 0
        self.errors = 0
        metrics = metrics or _NO_METRICS
        self._fires_metric = metrics.hook_fires.labels(host.name)
        self.counters = HookCounters(on_drop=metrics.events_dropped.labels(host.name).inc)
        self.last_fired_ns = 0
        #: Wall-clock expiry (ns) of a hook without a session; 0 for none.
        self.expires_ns = 0
        self._sampler = Sampler.compile(spec.sampling)
        #: Called once when the hook is removed (cancels a TTL timer).
        self.on_removed: Callable[[], Any] | None = None
        #: The background detach, once removed.
        self.detaching: asyncio.Future[None] | None = None
        self._handles: list[RemovableHandle] = []

    # ---------------------------------------------------------------- worker thread

    def attach(self) -> None:
        """Installs the torch hooks. Runs on the model's worker thread."""
        if self.removed:
            return
        for path in self.compiled.modules:
            module = self.host.modules[path]
            for action in self.compiled.actions:
                self._handles.append(_install(module, action, self._make_hook(action, path)))
        self.active = True

    def detach(self) -> None:
        """Removes the torch hooks. Runs on the model's worker thread; idempotent."""
        self.active = False
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    def _make_hook(self, action: Action, path: str) -> Callable[..., Any]:
        """The torch hook: its signature and return value are torch's for the phase."""
        fire = self._fire
        phase = action.phase
        if phase == hook_pb2.PHASE_FORWARD_PRE:
            if action.with_kwargs:
                def pre_kw(module: Any, args: Any, kwargs: Any) -> Any:
                    new = fire(action, path, module, {"args": args, "kwargs": kwargs})
                    return None if new is None else (new["args"], new["kwargs"])
                return pre_kw

            def pre(module: Any, args: Any) -> Any:
                new = fire(action, path, module, {"args": args})
                return None if new is None else new["args"]
            return pre
        if phase == hook_pb2.PHASE_FORWARD:
            if action.with_kwargs:
                def post_kw(module: Any, args: Any, kwargs: Any, output: Any) -> Any:
                    new = fire(action, path, module, {"args": args, "kwargs": kwargs, "output": output})
                    return None if new is None else new["output"]
                return post_kw

            def post(module: Any, args: Any, output: Any) -> Any:
                new = fire(action, path, module, {"args": args, "output": output})
                return None if new is None else new["output"]
            return post
        if phase == hook_pb2.PHASE_BACKWARD_PRE:
            def backward_pre(module: Any, grad_output: Any) -> Any:
                new = fire(action, path, module, {"grad_output": grad_output})
                return None if new is None else new["grad_output"]
            return backward_pre

        def backward(module: Any, grad_input: Any, grad_output: Any) -> Any:
            new = fire(action, path, module, {"grad_input": grad_input, "grad_output": grad_output})
            return None if new is None else new["grad_input"]
        return backward

    def _applies_to(self, p: Pass) -> bool:
        scope = self.compiled.scope
        if scope == hook_pb2.SCOPE_ALL:
            return True
        if scope == SCOPE_REQUEST:
            return p.request_id == self.request_id
        if scope == hook_pb2.SCOPE_TAGGED:
            return not self.compiled.tags.isdisjoint(p.tags)
        return bool(self.session_id) and p.session_id == self.session_id

    def _fire(self, action: Action, path: str, module: Any, parts: dict[str, Any]) -> dict[str, Any] | None:
        """The body of every torch hook: scope, call index, gating, rules, capture, delivery.

        Returns the parts as the rules left them when a rule changed something, else None.
        """
        p = self.host.current_pass
        if p is None or not self.active or not self._applies_to(p):
            return None
        call_index = p.next_call_index(self.hook_id, path, action.phase)
        training = module.training
        if not (self.compiled.train_update if training else self.compiled.eval_update):
            return None
        self.fire_count += 1
        self._fires_metric.inc()
        self.last_fired_ns = time.time_ns()
        listened = self.compiled.scope == SCOPE_REQUEST or bool(self.streams)
        capture = bool(action.capture) and listened and (self._sampler is None or self._sampler.take(path, action.phase))
        if not action.rules:
            if capture:
                self._capture(action, path, p, call_index, training, parts)
            return None
        if capture and action.capture_before_rules:
            self._capture(action, path, p, call_index, training, parts)
        try:
            new_parts, changed = apply_rules(
                action.rules, parts, self.slots, f"hook {self.hook_id} on module {path!r} of {self.host.name!r}"
            )
        except RuleFailure as failure:
            self.errors += 1
            if self.compiled.fail_call_on_error:
                raise failure.error from None  # through forward/backward: the Infer call fails
            self._disable(str(failure.error), hook_service_pb2.NOTICE_KIND_HOOK_DISABLED)
            return None  # the failing firing changes nothing
        if capture and not action.capture_before_rules:
            self._capture(action, path, p, call_index, training, new_parts)
        return new_parts if changed else None

    def _disable(self, reason: str, kind: hook_service_pb2.NoticeKind) -> None:
        """Stops the hook for good (it stays listed) and tells its streams. Worker thread."""
        self.active = False
        self.disabled_reason = reason
        log.warning("hook %s disabled: %s", self.hook_id, reason)
        notice = _notice(kind, self.hook_id, f"hook disabled: {reason}")
        for stream in self.streams:
            stream.put_notice(notice)

    def _capture(
        self, action: Action, path: str, p: Pass, call_index: int, training: bool, parts: dict[str, Any]
    ) -> None:
        if self.compiled.scope == SCOPE_REQUEST:
            # The request's own hook: a capture failure fails the request (raised through forward),
            # and so does an event past max_events_per_call (Pass.add_event).
            event = p.add_event()
            self._fill_event(event, action, path, p, call_index, training, parts, p.chunker)
            event.seq = p.next_seq(self.hook_id)
            return
        streams = self.streams
        if not streams:
            return  # nobody listens: no copies
        msg = hook_service_pb2.SessionMessage()
        chunker = Chunker(snapshot=True)
        try:
            nbytes = self._fill_event(msg.event, action, path, p, call_index, training, parts, chunker)
        except Exception as exc:  # never break a pass because a capture cannot be made
            self.errors += 1
            detail = f"hook {self.hook_id} on {self.host.name}:{path or '<root>'} could not capture: {exc}"
            self._disable(detail, hook_service_pb2.NOTICE_KIND_CAPTURE_FAILED)
            return
        wire = msg.ByteSize()
        copies = [msg] + [_copy(msg) for _ in streams[1:]]
        kept = chunker if chunker.tensors else None
        for stream, m in zip(streams, copies):
            stream.put_event(
                m, self.hook_id, nbytes, session_id=p.session_id, principal=p.principal, counters=self.counters, chunker=kept,
                wire=wire, cancelled=self._is_removed,
            )

    def _is_removed(self) -> bool:
        return self.removed

    def _fill_event(
        self, event: hook_pb2.InterceptEvent, action: Action, path: str, p: Pass,
        call_index: int, training: bool, parts: dict[str, Any], chunker: Chunker | None,
    ) -> int:
        event.hook_id = self.hook_id
        event.model = self.host.name
        event.module = path
        event.phase = action.phase
        event.call_index = call_index
        event.request_id = p.request_id
        event.training = training
        event.time.CopyFrom(_now())
        nbytes = 0
        options = action.options
        encode = _codec.encode_value_into
        try:
            for part in action.capture:
                if part == hook_pb2.PART_ARGS:
                    for value in parts["args"]:
                        value = options.prepare(value) if options.transforms else value
                        nbytes += encode(value, event.args.add(), chunker=chunker)
                elif part == hook_pb2.PART_KWARGS:
                    for key, value in parts["kwargs"].items():
                        value = options.prepare(value) if options.transforms else value
                        nbytes += encode(value, event.kwargs[key], chunker=chunker)
                elif part == hook_pb2.PART_OUTPUT:
                    value = options.prepare(parts["output"]) if options.transforms else parts["output"]
                    nbytes += encode(value, event.output, chunker=chunker)
                else:
                    field = "grad_input" if part == hook_pb2.PART_GRAD_INPUT else "grad_output"
                    target = getattr(event, field)
                    for value in parts[field]:
                        value = options.prepare(value) if options.transforms else value
                        nbytes += encode(value, target.add(), chunker=chunker)
        except _codec.CodecError as exc:
            raise Unimplemented(f"hook {self.hook_id} on module {path!r} cannot capture {_part_name(part)}: {exc}") from None
        except (IndexError, RuntimeError, ValueError, TypeError) as exc:  # a selection that does not fit, ...
            raise InvalidArgument(
                f"hook {self.hook_id} on module {path!r} cannot capture {_part_name(part)}: {type(exc).__name__}: {exc}"
            ) from None
        return nbytes

    def to_proto(self, *, include_operand_data: bool = False) -> hook_pb2.Hook:
        """The wire description of this hook; rule operand tensors carry their data only
        with ``include_operand_data`` (encoded from the compiled rules: the bytes registered)."""
        msg = hook_pb2.Hook(
            hook_id=self.hook_id, spec=self.spec, modules=list(self.compiled.modules), session_id=self.session_id,
            disabled=bool(self.disabled_reason), disabled_reason=self.disabled_reason,
            fire_count=self.fire_count, events_sent=self.counters.events_sent,
            events_dropped=self.counters.events_dropped, errors=self.errors,
        )
        if self.last_fired_ns:
            msg.last_fired.FromNanoseconds(self.last_fired_ns)
        if self.expires_ns:
            msg.expires.FromNanoseconds(self.expires_ns)
        if include_operand_data:
            fields = {info.phase: info.field for info in PHASES}
            for action in self.compiled.actions:
                rules = {rule.position: rule for rule in action.rules}
                for position, tensor_msg in operand_tensors(getattr(msg.spec, fields[action.phase]).rules):
                    operand = rules[position].tensor
                    if operand is not None:
                        tensor_msg.Clear()  # dtype and shape are set again, with the data
                        _codec.encode_tensor_into(operand, tensor_msg)
        return msg


def _without_operand_data(spec: hook_pb2.HookSpec) -> hook_pb2.HookSpec:
    """A copy of ``spec`` whose rule operand tensors keep their dtype and shape, not their data.

    Clears the data in ``spec`` itself first (the request's message; nobody reads the
    bytes after compile_spec decoded them), so that the copy never holds them: kept
    beside the compiled rules' tensors, they would hold every operand twice (and a
    stored sub-message keeps its whole request alive).
    """
    for info in PHASES:
        if spec.HasField(info.field):  # type: ignore[arg-type]
            for _, tensor_msg in operand_tensors(getattr(spec, info.field).rules):
                tensor_msg.data = b""
    out = hook_pb2.HookSpec()
    out.CopyFrom(spec)
    return out


def _install(module: Any, action: Action, fn: Callable[..., None]) -> RemovableHandle:
    if action.phase == hook_pb2.PHASE_FORWARD_PRE:
        return module.register_forward_pre_hook(fn, prepend=action.prepend, with_kwargs=action.with_kwargs)
    if action.phase == hook_pb2.PHASE_FORWARD:
        return module.register_forward_hook(
            fn, prepend=action.prepend, with_kwargs=action.with_kwargs, always_call=action.always_call
        )
    if action.phase == hook_pb2.PHASE_BACKWARD_PRE:
        return module.register_full_backward_pre_hook(fn, prepend=action.prepend)
    return module.register_full_backward_hook(fn, prepend=action.prepend)


def _copy(msg: hook_service_pb2.SessionMessage) -> hook_service_pb2.SessionMessage:
    out = hook_service_pb2.SessionMessage()
    out.CopyFrom(msg)
    return out


def _now() -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ns = time.time_ns()
    ts.seconds, ts.nanos = divmod(ns, 1_000_000_000)
    return ts


def _notice(kind: hook_service_pb2.NoticeKind, hook_id: str, message: str) -> hook_service_pb2.SessionMessage:
    return hook_service_pb2.SessionMessage(
        notice=hook_service_pb2.Notice(kind=kind, hook_id=hook_id, message=message)
    )


class Session:
    """A client's session: its stream and the hooks it owns."""

    def __init__(
        self, session_id: str, stream: EventStream, max_slot_bytes: int = DEFAULT_MAX_SLOT_BYTES,
        principal: Principal = ANONYMOUS,
    ) -> None:
        self.session_id = session_id
        self.stream = stream
        self.principal = principal
        self.slots = SlotStore(max_slot_bytes)
        self.hook_ids: dict[str, None] = {}  # ordered set
        self.closed = False


class Subscription:
    """A further stream for the events of existing hooks."""

    def __init__(self, stream: EventStream, hook_ids: Iterable[str], principal: Principal = ANONYMOUS) -> None:
        self.stream = stream
        self.principal = principal
        self.hook_ids = dict.fromkeys(hook_ids)


def _lacks(principal: Principal, role: str, what: str) -> str:
    """Why ``principal`` may no longer hold ``what`` ("" when it may)."""
    try:
        principal.require(role, what)
    except PermissionDenied as exc:
        return f"your role changed: {exc}"
    return ""


def new_id(prefix: str) -> str:
    """An unguessable id (128 random bits)."""
    return f"{prefix}_{secrets.token_hex(16)}"


class HookManager:
    """Sessions, registered hooks and subscriptions. Lives on the event loop."""

    def __init__(
        self, registry: ModelRegistry, *, allow_shared_rules: bool = False, limits: Limits | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self._registry = registry
        self.limits = limits or Limits()
        #: True once the server is stopping: nothing new is accepted.
        self.draining = False
        self.metrics = metrics or Metrics()
        self._subscriptions: set[Subscription] = set()
        self.metrics.watch(
            sessions=lambda: len(self._sessions), hooks=lambda: len(self._hooks),
            streams=lambda: len(self._sessions) + len(self._subscriptions), buffered=self._buffered,
        )
        self.allow_shared_rules = allow_shared_rules
        self._hooks: dict[str, HookRecord] = {}
        self._sessions: dict[str, Session] = {}
        self._background: set[asyncio.Future[None]] = set()

    # ---------------------------------------------------------------- sessions

    def _refuse_when_draining(self) -> None:
        if self.draining:
            raise Unavailable(SHUTDOWN_REASON)

    def _admit_stream(self, principal: Principal, delivery: DeliveryLimits) -> None:
        """Limits on streams: per principal, and the server's total buffer budget."""
        streams = [s.stream for s in self._sessions.values()] + [s.stream for s in self._subscriptions]
        mine = sum(1 for s in self._sessions.values() if principal.owns(s.principal))
        mine += sum(1 for s in self._subscriptions if principal.owns(s.principal))
        limits.check(mine, self.limits.max_streams_per_principal, f"{principal.name!r} has {mine} open streams",
                     "max_streams_per_principal")
        own = sum(s.stream.limits.max_bytes for s in self._sessions.values() if principal.owns(s.principal))
        own += sum(s.stream.limits.max_bytes for s in self._subscriptions if principal.owns(s.principal))
        if own + delivery.max_bytes > self.limits.max_buffered_bytes_per_principal:
            raise ResourceExhausted(
                f"{principal.name!r}'s stream buffers would take {own + delivery.max_bytes} bytes, over its limit of "
                f"{self.limits.max_buffered_bytes_per_principal} (max_buffered_bytes_per_principal)"
            )
        budget = sum(s.limits.max_bytes for s in streams) + delivery.max_bytes
        if budget > self.limits.max_buffered_bytes:
            raise ResourceExhausted(
                f"opening a stream with a {delivery.max_bytes}-byte buffer would put the server's stream buffers at "
                f"{budget} bytes, over its limit of {self.limits.max_buffered_bytes} (max_buffered_bytes); "
                "ask for a smaller delivery.max_bytes"
            )

    def open_session(self, delivery: DeliveryLimits, principal: Principal = ANONYMOUS) -> Session:
        """A new session with its own event stream."""
        self._refuse_when_draining()
        principal.require(MINIMUM_ROLE["OpenSession"], "opening a session")
        sessions = sum(1 for s in self._sessions.values() if principal.owns(s.principal))
        limits.check(sessions, self.limits.max_sessions_per_principal,
                     f"{principal.name!r} has {sessions} open sessions", "max_sessions_per_principal")
        self._admit_stream(principal, delivery)
        session_id = new_id("ses")
        stream = EventStream(asyncio.get_running_loop(), delivery, owner_session_id=session_id, owner=principal.name,
                             on_sent=self._count_sent, blocks_others=principal.is_operator)
        session = Session(session_id, stream, self.limits.max_slot_bytes, principal)
        self._sessions[session.session_id] = session
        log.info("session opened", extra={"session_id": session_id, "principal": principal.name})
        return session

    def require_session(self, session_id: str, principal: Principal = ANONYMOUS, *, owner_only: bool = False) -> Session:
        """The open session ``session_id`` of ``principal`` (any, for operators, unless
        ``owner_only``: hooks and calls in a session are its owner's alone); NotFound
        otherwise (Unavailable while the server stops)."""
        self._refuse_when_draining()
        session = self._sessions.get(session_id)
        allowed = principal.owns(session.principal) or (principal.is_operator and not owner_only) if session else False
        if session is None or session.closed or not allowed:
            raise NotFound(f"no open session {session_id!r}")
        return session

    def close_session(self, session_id: str) -> None:
        """Ends a session: its hooks stop firing now and are detached in the background."""
        session = self._sessions.pop(session_id, None)
        if session is None or session.closed:
            return
        session.closed = True
        session.stream.close()
        session.slots.clear()
        for hook_id in list(session.hook_ids):
            self._remove(hook_id, reason=f"session {session_id} ended")
        log.info("session %s closed", session_id)

    @property
    def session_count(self) -> int:
        """Open sessions."""
        return len(self._sessions)

    # ---------------------------------------------------------------- hooks

    async def register(self, session_id: str, spec: hook_pb2.HookSpec, principal: Principal = ANONYMOUS) -> HookRecord:
        """Registers and attaches a hook; returns once it fires for the next pass.

        Without a session, the hook must watch shared traffic (SCOPE_ALL/TAGGED),
        carries a TTL (capped at max_ttl_seconds) and delivers to subscribers only.
        """
        self._refuse_when_draining()
        principal.require(MINIMUM_ROLE["RegisterHook"], "registering a hook")
        session = self.require_session(session_id, principal, owner_only=True) if session_id else None
        host = self._registry.get(spec.model)
        compiled = compile_spec(
            spec, host, request_scoped=False, allow_shared_rules=self.allow_shared_rules,
            max_rules=self.limits.max_rules_per_action,
        )
        require_hook_roles(principal, spec, compiled, sessionless=session is None)
        if session is None:
            if compiled.scope not in (hook_pb2.SCOPE_ALL, hook_pb2.SCOPE_TAGGED):
                raise InvalidArgument("session_id: a hook without a session must have scope SCOPE_ALL or SCOPE_TAGGED")
            if spec.ttl_seconds <= 0:
                raise InvalidArgument("spec.ttl_seconds: a hook without a session needs a TTL")
            if compiled.uses_slots:
                raise InvalidArgument("save and patch rules keep slots in a session: register with a session_id")
        elif spec.ttl_seconds:
            raise InvalidArgument("spec.ttl_seconds: session hooks live as long as their session")
        if session is not None:
            limits.check(len(session.hook_ids), self.limits.max_hooks_per_session,
                         f"session {session_id} has {len(session.hook_ids)} hooks", "max_hooks_per_session")
        owned = sum(1 for r in self._hooks.values() if principal.owns(r.owner))
        limits.check(owned, self.limits.max_hooks_per_principal, f"{principal.name!r} has {owned} hooks",
                     "max_hooks_per_principal")
        record = HookRecord(
            new_id("hk"), host, spec, compiled, session_id=session_id, slots=session.slots if session else None,
            metrics=self.metrics, owner=principal,
        )
        if session is not None:
            record.streams = (session.stream,)
            session.hook_ids[record.hook_id] = None
        else:
            ttl = min(spec.ttl_seconds, self.limits.max_ttl_seconds)
            record.expires_ns = time.time_ns() + ttl * 1_000_000_000
            handle = asyncio.get_running_loop().call_later(
                ttl, functools.partial(self._remove, record.hook_id, reason=f"its TTL of {ttl} s expired")
            )
            record.on_removed = handle.cancel
        # Known before the attach completes, so that a session ending meanwhile removes it.
        self._hooks[record.hook_id] = record
        try:
            await host.run(record.attach)
        except BaseException:
            self._remove(record.hook_id, reason="registration failed")
            raise
        if record.removed:
            self._refuse_when_draining()
            raise NotFound(
                f"hook {record.hook_id} was removed while it was being registered "
                f"({'its session ended' if session is not None and session.closed else 'deregistered'})"
            )
        log.info("hook %s registered on %s:%s", record.hook_id, host.name, ",".join(compiled.modules) or "<root>")
        return record

    async def deregister(self, hook_id: str, principal: Principal = ANONYMOUS) -> bool:
        """Removes a hook; False when unknown, already removed, or not the principal's
        (operators may remove any). Returns once detached."""
        principal.require(MINIMUM_ROLE["DeregisterHook"], "removing a hook")
        existing = self._hooks.get(hook_id)
        if existing is None or not (principal.is_operator or principal.owns(existing.owner)):
            return False
        record = self._remove(hook_id, reason=f"deregistered by {principal.name}")
        if record is None:
            return False
        assert record.detaching is not None
        await asyncio.shield(record.detaching)
        return True

    def _remove(self, hook_id: str, *, reason: str) -> HookRecord | None:
        """Stops a hook at once and schedules its detach; its streams are told after that."""
        record = self._hooks.pop(hook_id, None)
        if record is None:
            return None
        record.removed = True
        record.active = False
        for stream in record.streams:
            stream.wake_producers()  # a pass blocked delivering this hook's event gives up now
        if record.on_removed is not None:
            record.on_removed()
        session = self._sessions.get(record.session_id)
        if session is not None:
            session.hook_ids.pop(hook_id, None)
        task = record.detaching = asyncio.ensure_future(self._detach_and_notify(record, reason))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        log.info("hook %s removed: %s", hook_id, reason)
        return record

    async def _detach_and_notify(self, record: HookRecord, reason: str) -> None:
        # The detach runs on the model's worker after the pass in flight, so every
        # event that pass produced is queued before the removal notice: the notice
        # really is a hook's last message on each stream.
        try:
            await record.host.run(record.detach)
        except RuntimeError:  # the model's worker has shut down: the process is exiting
            record.detach()
        streams, subscriptions = record.streams, record.subscriptions
        record.streams, record.subscriptions = (), []
        notice = _notice(
            hook_service_pb2.NOTICE_KIND_HOOK_REMOVED, record.hook_id, f"hook {record.hook_id} removed: {reason}"
        )
        for stream in streams:
            stream.put_notice(notice)
            stream.forget_hook(record.hook_id)
        for sub in subscriptions:
            sub.hook_ids.pop(record.hook_id, None)
            if not sub.hook_ids:
                sub.stream.end()

    def get(self, hook_id: str, principal: Principal = ANONYMOUS) -> HookRecord:
        """A registered hook of ``principal`` (any, for operators); NotFound otherwise."""
        record = self._hooks.get(hook_id)
        if record is None or not (principal.is_operator or principal.owns(record.owner)):
            raise NotFound(f"no hook {hook_id!r}")
        return record

    def list_hooks(self, *, model: str = "", session_id: str = "", principal: Principal = ANONYMOUS) -> list[HookRecord]:
        """Registered hooks, oldest first, filtered by model and owner session: the
        principal's own, or everyone's for operators. Describe them with
        HookRecord.to_proto (operand data only on request)."""
        principal.require(MINIMUM_ROLE["ListHooks"], "listing hooks")
        return [
            r for r in self._hooks.values()
            if (not model or r.host.name == model) and (not session_id or r.session_id == session_id)
            and (principal.is_operator or principal.owns(r.owner))
        ]

    @property
    def hook_count(self) -> int:
        """Registered hooks."""
        return len(self._hooks)

    def request_hooks(
        self, host: ModelHost, specs: Iterable[hook_pb2.HookSpec], request_id: str, session: Session | None,
        principal: Principal = ANONYMOUS,
    ) -> list[HookRecord]:
        """Compiles InferRequest.hooks; the pass attaches and detaches them on the worker."""
        records = []
        for i, spec in enumerate(specs):
            if spec.model and spec.model != host.name:
                raise InvalidArgument(f"hooks[{i}].model: {spec.model!r} is not the request's model {host.name!r}")
            try:
                compiled = compile_spec(spec, host, request_scoped=True, max_rules=self.limits.max_rules_per_action)
            except (InvalidArgument, NotFound) as exc:
                raise type(exc)(f"hooks[{i}]: {exc}") from None
            if compiled.uses_slots and session is None:
                raise InvalidArgument(f"hooks[{i}]: save and patch rules keep slots in a session: set session_id")
            records.append(HookRecord(
                new_id("hk"), host, spec, compiled, request_id=request_id,
                slots=session.slots if session is not None else None, metrics=self.metrics, owner=principal,
            ))
        return records

    # ---------------------------------------------------------------- slots

    def slots(self, session_id: str, principal: Principal = ANONYMOUS) -> SlotStore:
        """The slots of an open session of ``principal``; NotFound otherwise."""
        principal.require(MINIMUM_ROLE["GetSlot"], "reading slots")  # GetSlot and ListSlots
        return self.require_session(session_id, principal).slots

    # ---------------------------------------------------------------- subscriptions

    def subscribe(self, hook_ids: Iterable[str], delivery: DeliveryLimits, principal: Principal = ANONYMOUS) -> Subscription:
        """A stream for the events of existing hooks of ``principal`` (any, for operators);
        NotFound if any is unknown (or someone else's)."""
        self._refuse_when_draining()
        principal.require(MINIMUM_ROLE["Subscribe"], "subscribing")
        ids = list(dict.fromkeys(hook_ids))
        if not ids:
            raise InvalidArgument("hook_ids: name at least one hook")
        records = [self.get(hook_id, principal) for hook_id in ids]
        self._admit_stream(principal, delivery)
        # BLOCK on a subscription holds its owner's own calls (and, for an operator,
        # everyone's): it has no session, so ownership, not a session, decides.
        sub = Subscription(EventStream(asyncio.get_running_loop(), delivery, owner=principal.name,
                                       on_sent=self._count_sent, blocks_others=principal.is_operator), ids, principal)
        self._subscriptions.add(sub)
        for record in records:
            record.streams = record.streams + (sub.stream,)
            record.subscriptions.append(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        """Detaches a subscription from its hooks and frees its buffer."""
        self._subscriptions.discard(sub)
        sub.stream.close()
        for hook_id in list(sub.hook_ids):
            record = self._hooks.get(hook_id)
            if record is not None:
                record.streams = tuple(s for s in record.streams if s is not sub.stream)
                if sub in record.subscriptions:
                    record.subscriptions.remove(sub)
        sub.hook_ids.clear()

    def reauthorize(self, tokens: TokenStore) -> int:
        """Applies a token reload to what is open; returns how many things ended.

        A session or subscription whose credential (the token or certificate subject
        it was opened with) no longer names its principal ends ("your credentials
        were rotated or revoked"), as do those whose principal's new role may not
        hold them. Otherwise they take the principal's new role for later decisions
        (BLOCK on other sessions' calls is for operators; a subscription keeps only
        the hooks the new role may see). A hook ends when its owner is gone or the
        new role may no longer register it (the same check as register), with a
        notice to its streams saying why.
        """
        ended = 0
        revoked = "your credentials were rotated or revoked"
        for session in list(self._sessions.values()):
            now = tokens.current(session.principal)
            reason = revoked if now is None else _lacks(now, MINIMUM_ROLE["OpenSession"], "a session")
            if reason:
                session.stream.close(reason)
                self.close_session(session.session_id)
                ended += 1
            elif now is not None:
                session.principal = now
                session.stream.blocks_others = now.is_operator
        for sub in list(self._subscriptions):
            now = tokens.current(sub.principal)
            reason = revoked if now is None else _lacks(now, MINIMUM_ROLE["Subscribe"], "a subscription")
            if reason:
                sub.stream.close(reason)
                self.unsubscribe(sub)
                ended += 1
            elif now is not None:
                sub.principal = now
                sub.stream.blocks_others = now.is_operator
                ended += self._narrow(sub)
        principals = tokens.principals
        for record in list(self._hooks.values()):
            if record.owner == ANONYMOUS:
                continue
            owner = principals.get(record.owner.name)
            if owner is None:
                self._remove(record.hook_id, reason="its owner's credentials were revoked")
                ended += 1
                continue
            try:
                require_hook_roles(owner, record.spec, record.compiled, sessionless=not record.session_id)
            except PermissionDenied as exc:
                self._remove(record.hook_id, reason=f"its owner's role changed: {exc}")
                ended += 1
                continue
            record.owner = dataclasses.replace(owner, credential=record.owner.credential)
        return ended

    def _narrow(self, sub: Subscription) -> int:
        """Detaches from ``sub`` the hooks its principal may no longer see (another's,
        once it is no longer an operator; the check of subscribe), with a notice each."""
        lost = 0
        for hook_id in list(sub.hook_ids):
            record = self._hooks.get(hook_id)
            if record is None:
                continue  # being removed: its notice and detach are on their way
            try:
                self.get(hook_id, sub.principal)
                continue
            except NotFound:
                pass
            record.streams = tuple(s for s in record.streams if s is not sub.stream)
            if sub in record.subscriptions:
                record.subscriptions.remove(sub)
            sub.stream.put_notice(_notice(
                hook_service_pb2.NOTICE_KIND_HOOK_REMOVED, hook_id,
                f"hook {hook_id} removed from this subscription: another principal's hooks need the operator role; "
                f"{sub.principal.name!r} has {sub.principal.role}",
            ))
            sub.stream.forget_hook(hook_id)
            del sub.hook_ids[hook_id]
            lost += 1
        if lost and not sub.hook_ids:
            sub.stream.end()
        return lost

    # ---------------------------------------------------------------- metrics

    def _count_sent(self, events: int, nbytes: int) -> None:
        self.metrics.events_sent.inc(events)
        self.metrics.stream_bytes.inc(nbytes)

    def _buffered(self) -> tuple[int, int]:
        streams = [s.stream for s in self._sessions.values()] + [s.stream for s in self._subscriptions]
        occupancy = [stream.occupancy() for stream in streams]
        return sum(e for e, _ in occupancy), sum(b for _, b in occupancy)

    # ---------------------------------------------------------------- shutdown

    def begin_shutdown(self) -> None:
        """Refuses new sessions, subscriptions and hooks, and ends every event stream
        with the reason "server is shutting down" (their hooks are removed)."""
        self.draining = True
        for session in list(self._sessions.values()):
            session.stream.close(SHUTDOWN_REASON)
            self.close_session(session.session_id)
        for sub in list(self._subscriptions):
            sub.stream.close(SHUTDOWN_REASON)

    async def close(self) -> None:
        """Ends every session and stream, then waits for the detaches."""
        for session_id in list(self._sessions):
            self.close_session(session_id)
        for record in list(self._hooks.values()):
            self._remove(record.hook_id, reason="server stopping")
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
