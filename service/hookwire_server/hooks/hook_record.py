"""The torch side of a registered hook: a HookRecord installs one real torch hook per
action on each module its pattern resolves to, with the spec's options (prepend,
with_kwargs, always_call), so ordering and visibility are torch's own. Each torch
hook checks at call time whether the hook applies to the running pass (scope),
counts the call, gates on the module's ``training`` flag, applies its rules and
captures.

Torch hook dictionaries are changed only on the model's worker thread, between
passes (see model_registry). A hook nobody listens to costs a counter bump: no
tensor is copied unless an event will be delivered.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Callable

import torch
from google.protobuf import timestamp_pb2
from torch.utils.hooks import RemovableHandle

from hookwire.wire import codec
from hookwire.wire.codec import Chunker
from hookwire.wire.framing import SESSION_MESSAGE_CHUNK, Framing, Splicer
from hookwire.v1 import hook_pb2, hook_service_pb2

from ..auth import ANONYMOUS, Principal
from .capture import Sampler
from .deferred import HostCopies, wants_deferral
from . import compact
from ..errors import HookwireServerError
from .event_bus import EventStream, HookCounters
from .hook_specs import PHASES, SCOPE_REQUEST, Action, CompiledSpec
from ..metrics import Metrics
from ..models.memory_estimate import probing
from ..models.model_registry import ModelHost
from .rules import RuleFailure, Signals, apply_rules, operand_tensors, tensor_fields
from .captured import Captured, capture_error as _capture_error, captured as _captured, prepare as _prepare
from .slots import SlotStore

if TYPE_CHECKING:
    from .passes import Pass

log = logging.getLogger("hookwire.hooks")

_NO_METRICS = Metrics()  # for records built without a server (unit tests)


class Subscription:
    """A further stream for the events of existing hooks (HookManager.subscribe); each
    HookRecord lists the subscriptions that carry its events."""

    def __init__(self, stream: EventStream, hook_ids: Iterable[str], principal: Principal = ANONYMOUS) -> None:
        self.stream = stream
        self.principal = principal
        self.hook_ids = dict.fromkeys(hook_ids)


class HookRecord:
    """One registered hook and the torch hooks that implement it."""

    def __init__(
        self, hook_id: str, host: ModelHost, spec: hook_pb2.HookSpec, compiled: CompiledSpec,
        *, session_id: str = "", request_id: str = "", slots: SlotStore | None = None,
        metrics: Metrics | None = None, owner: Principal = ANONYMOUS, request_index: int = 0,
    ) -> None:
        self.hook_id = hook_id
        #: For a request-scoped hook, its position in the request's hooks plus one
        #: (InterceptEvent.request_hook_index); 0 for a registered hook.
        self.request_index = request_index
        #: Who registered it: only they (or an operator) see, subscribe to and remove it.
        self.owner = owner
        self.host = host
        #: The spec without its operands' bytes: ``compiled`` holds the one (decoded) copy.
        self.spec = _without_operand_data(spec)
        self.compiled = compiled
        #: Bytes of the rule operands ``compiled`` holds (what a listing with their data encodes).
        self.operand_bytes = sum(rule.operand_bytes() for action in compiled.actions for rule in action.rules) + sum(
            t.numel() * t.element_size() for action in compiled.actions if action.options.readout is not None
            for t in action.options.readout.operands.values())
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
        self.counters = HookCounters(on_drop=metrics.events_dropped.labels(host.name).inc)
        self.last_fired_ns = 0
        #: Wall-clock expiry (ns) of a hook without a session; 0 for none.
        self.expires_ns = 0
        #: For a hook restored from the state folder, until a stream subscribes to it: the
        #: gap in its events the restart made (HookManager.subscribe sends it once).
        self.restored_notice = ""
        self._sampler = Sampler.compile(spec.sampling)
        #: Called once when the hook is removed (cancels a TTL timer).
        self.on_removed: Callable[[], Any] | None = None
        #: The background detach, once removed.
        self.detaching: asyncio.Future[None] | None = None
        self._handles: list[RemovableHandle] = []
        #: Each resolved module's position (InterceptEvent.module_indices of compact readouts).
        self._module_indices = {path: i for i, path in enumerate(compiled.modules)}

    # ---------------------------------------------------------------- worker thread

    def attach(self) -> None:
        """Makes the hook live and installs its torch hooks, unless it only captures and
        nobody listens (see sync). Runs on the model's worker thread."""
        if self.removed:
            return
        with self.host.hooks_lock:
            self.active = True
            self.sync()

    @property
    def _needed(self) -> bool:
        """Whether its torch hooks must be installed: it changes values, or someone listens
        (its call, for a request-scoped hook; a session stream or a subscription)."""
        return (
            self.compiled.scope == SCOPE_REQUEST or bool(self.streams)
            or any(action.rules for action in self.compiled.actions)
        )

    def sync(self) -> None:
        """Installs the torch hooks of a live hook that needs them and removes those of one
        that no longer does: a capture-only hook nobody listens to (a sessionless hook
        without subscribers) costs the model nothing, not even torch's hook dispatch, and
        does not count firings. Worker thread (listeners_changed queues it there)."""
        with self.host.hooks_lock:
            self._sync()

    def _sync(self) -> None:
        if self.active and self._needed:
            if not self._handles:
                for path in self.compiled.modules:
                    # An engine may run a module's work inside another module (vLLM's lm_head
                    # inside its logits processor): its torch hooks go there.
                    module = self.host.hook_targets.get(path) or self.host.modules[path]
                    for action in self.compiled.actions:
                        self._handles.append(_install(module, action, self._make_hook(action, path)))
            self.host.live_hooks.add(self)
        else:
            self._remove_handles()

    def _remove_handles(self) -> None:
        self.host.live_hooks.discard(self)
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    def listeners_changed(self) -> None:
        """After ``streams`` changed (a subscription came or went): installs or removes the
        torch hooks on the worker thread, ahead of any pass queued after this call. Event loop."""
        if self.compiled.scope != SCOPE_REQUEST and not any(action.rules for action in self.compiled.actions):
            self.host.submit(self.sync)

    def detach(self) -> None:
        """Removes the torch hooks. Runs on the model's worker thread; idempotent."""
        with self.host.hooks_lock:
            self.active = False
            self._remove_handles()

    def _make_hook(self, action: Action, path: str) -> Callable[..., Any]:
        """The torch hook: its signature and return value are torch's for the phase. It
        says what it reads and whether it may edit (``hookwire_roots``, ``hookwire_edits``):
        an engine that taps the module elsewhere (vLLM's worker processes) sends only that."""
        hook = self._make_torch_hook(action, path)
        setattr(hook, "hookwire_roots", tuple(action.roots))
        setattr(hook, "hookwire_edits", bool(action.rules))
        # What an engine that runs hooks elsewhere (runtime.step, in vLLM's workers) plans from.
        setattr(hook, "hookwire_firing", (self, action, path))
        return hook

    def _make_torch_hook(self, action: Action, path: str) -> Callable[..., Any]:
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
            # An engine may show a module's output as the transformers module returns it
            # (ModelHost.output_views: vLLM's decoder layer returns (hidden, residual), its
            # output projections (out, bias)); a rule's edit goes back through the view.
            view = self.host.output_views.get(path)
            if action.with_kwargs:
                def post_kw(module: Any, args: Any, kwargs: Any, output: Any) -> Any:
                    shown = output if view is None else view.show(output)
                    new = fire(action, path, module, {"args": args, "kwargs": kwargs, "output": shown})
                    return None if new is None else new["output"] if view is None else view.put(output, new["output"])
                return post_kw

            def post(module: Any, args: Any, output: Any) -> Any:
                shown = output if view is None else view.show(output)
                new = fire(action, path, module, {"args": args, "output": shown})
                return None if new is None else new["output"] if view is None else view.put(output, new["output"])
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

    def state(self) -> tuple[Any, ...]:
        """What a firing changes on the hook itself (counts, sampling), for ``restore``."""
        return (self.fire_count, self.errors, self.last_fired_ns,
                self._sampler.state() if self._sampler is not None else None)

    def restore(self, state: tuple[Any, ...]) -> None:
        """Undoes the firings of a failed shared pass (its calls then run again alone)."""
        self.fire_count, self.errors, self.last_fired_ns, sampler = state
        if self._sampler is not None and sampler is not None:
            self._sampler.restore(sampler)

    def applies_to(self, p: Pass) -> bool:
        """Whether it fires for the calls of ``p`` (its scope: every call, its request's,
        its tags', its session's)."""
        return self._applies_to(p)

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
        """The body of every torch hook. In a pass of one call, the call's firing; in a
        pass several calls share (batching), one firing per call the hook applies to,
        each on that call's rows only, as if the call ran alone.

        Returns the parts as the rules left them when a rule changed something, else None.
        """
        batch = self.host.current_batch
        if batch is None or not self.active or probing():  # (a memory estimate's pass on fake tensors)
            return None
        if batch.deferred:
            batch.deferred.poll()  # earlier asynchronous captures whose copies are done go out
        if batch.direct:
            return self._fire_call(action, path, module, parts, batch.segments[0].p)
        batch.note(self)
        where = f"hook {self.hook_id} on module {path!r} of {self.host.name!r}"
        cloned: set[int] = set()
        changed = False
        for seg in batch.segments:
            if not self.active:
                break
            if not self._applies_to(seg.p):
                continue
            # Views of the call's rows (and own token length); Unsplittable fails the shared
            # pass, whose calls then run again alone.
            try:
                mine = {**parts, **{root: batch.take(parts[root], seg, where) for root in action.roots if root in parts}}
                new = self._fire_call(action, path, module, mine, seg.p)
                if new is None:
                    continue
                parts = {**parts, **{
                    root: batch.put(parts[root], mine[root], new[root], seg, where, cloned)
                    for root in action.roots if root in parts
                }}
            except Exception as exc:
                if batch.fail_call(seg.p, exc):  # kept for this call alone (a pass that cannot rerun)
                    continue
                raise
            changed = True
        return parts if changed else None

    def _fire_call(
        self, action: Action, path: str, module: Any, parts: dict[str, Any], p: Pass,
    ) -> dict[str, Any] | None:
        """One call's firing: scope, call index, gating, rules, capture, delivery."""
        if not self._applies_to(p):
            return None
        steps = self.compiled.steps
        if steps is not None and not (steps[0] <= p.step and (steps[1] is None or p.step <= steps[1])):
            return None
        listened = self.compiled.scope == SCOPE_REQUEST or bool(self.streams)
        if not listened and not action.rules:
            # Nobody to tell and nothing to change: count the firing (Hook.fire_count) and go.
            # Its call index is never seen, and a listener that arrives later counts from
            # its first full pass.
            if self.compiled.train_update if module.training else self.compiled.eval_update:
                self.fire_count += 1
                self.host.fires += 1
            return None
        call_index = p.next_call_index(self.hook_id, path, action.phase)
        training = module.training
        if not (self.compiled.train_update if training else self.compiled.eval_update):
            return None
        self.fire_count += 1
        self.host.fires += 1
        self.last_fired_ns = time.time_ns()
        capture = bool(action.capture) and listened and (self._sampler is None or self._sampler.take(path, action.phase))
        if not action.rules:
            if capture:
                self._capture(action, path, p, call_index, training, parts)
            return None
        if capture and action.capture_before_rules:
            self._capture(action, path, p, call_index, training, parts)
        try:
            stops: list[int] = []
            # Signals are kept per owner of the hooks: one principal's hooks never read (or
            # overwrite) another's, also on a shared hook that fires in every call.
            signals = p.signals.get(self.owner.name)
            if signals is None:
                signals = p.signals[self.owner.name] = Signals()
            signals.token_ids = p.token_ids
            new_parts, changed = apply_rules(
                action.rules, parts, self.slots, f"hook {self.hook_id} on module {path!r} of {self.host.name!r}",
                signals, stops,
            )
            for row in stops:  # the first stop rule to fire for a sequence in the pass names it
                p.stops.setdefault(row, (self.hook_id, path, p.step))
        except RuleFailure as failure:
            self.errors += 1
            if self.compiled.fail_call_on_error:
                raise failure.error from None  # through forward/backward: the Infer call fails
            self._disable(str(failure.error), hook_service_pb2.NOTICE_KIND_HOOK_DISABLED, p)
            return None  # the failing firing changes nothing
        if capture and not action.capture_before_rules:
            self._capture(action, path, p, call_index, training, new_parts)
        return new_parts if changed else None

    # ------------------------------------------- firings run elsewhere (runtime.step)

    def runs_elsewhere(self, action: Action) -> bool:
        """Whether a hook runtime without this record (a vLLM worker's) can run ``action``:
        not what needs the front's state while it fires (readouts, heads, sampling). Named
        operands and the session's slots travel with the plan (engine/vllm_runtime.py)."""
        return (action.phase in (hook_pb2.PHASE_FORWARD_PRE, hook_pb2.PHASE_FORWARD)
                and not action.heads and not any(rule.heads for rule in action.rules)
                and action.options.readout is None and self._sampler is None)

    def plan_firing(self, action: Action, path: str, module: Any, p: Pass) -> tuple[int, bool] | None:
        """The decisions of one call's firing that the values do not change, made before
        the step runs elsewhere (``_fire_call`` up to its rules): None when it does not fire
        there (out of scope or steps, gated off, nobody to tell and nothing to change:
        counted here as ``_fire_call`` counts it), else its call index and whether it
        captures. ``finish_firing`` takes its outcome."""
        if not self.active or not self._applies_to(p):
            return None
        steps = self.compiled.steps
        if steps is not None and not (steps[0] <= p.step and (steps[1] is None or p.step <= steps[1])):
            return None
        listened = self.compiled.scope == SCOPE_REQUEST or bool(self.streams)
        gated_on = self.compiled.train_update if module.training else self.compiled.eval_update
        if not listened and not action.rules:
            if gated_on:
                self.fire_count += 1
                self.host.fires += 1
            return None
        call_index = p.next_call_index(self.hook_id, path, action.phase)
        if not gated_on:
            return None
        capture = bool(action.capture) and listened
        if not capture and not action.rules:
            self.fire_count += 1
            self.host.fires += 1
            self.last_fired_ns = time.time_ns()
            return None
        return call_index, capture

    def finish_firing(
        self, action: Action, path: str, p: Pass, call_index: int, training: bool, fired_ns: int,
        before: list[Captured] | None, after: list[Captured] | None, devices: list[str], stops: list[int],
        error: tuple[str, HookwireServerError] | None,
    ) -> None:
        """One firing that ran elsewhere (``plan_firing``), as ``_fire_call`` ends it: its
        counts, its captures' events (``before``/``after`` the rules: values on the host),
        its stops, a failure. Raises the error that fails the call (the caller keeps it
        for the call: PackedBatch.fail_call)."""
        if error is not None and error[0] == "call":
            raise error[1]  # the call's rows could not be cut or put back: the call fails
        if self.disabled_reason:
            return  # disabled by an earlier firing of this step (its edits were made already)
        self.fire_count += 1
        self.host.fires += 1
        self.last_fired_ns = fired_ns
        fired = timestamp_pb2.Timestamp()
        fired.FromNanoseconds(fired_ns)
        for row in stops:  # the first stop rule to fire for a sequence in the pass names it
            p.stops.setdefault(row, (self.hook_id, path, p.step))
        if before is not None:
            self._send_ran(action, path, p, call_index, training, before, devices, fired)
        if error is not None:
            stage, exc = error
            if stage == "rule":
                self.errors += 1
                if self.compiled.fail_call_on_error:
                    raise exc
                self._disable(str(exc), hook_service_pb2.NOTICE_KIND_HOOK_DISABLED, p)
                return
            if self.compiled.scope == SCOPE_REQUEST:
                raise exc  # a request's own capture that cannot be made fails its call
            self.errors += 1
            self._disable(f"hook {self.hook_id} on {self.host.name}:{path or '<root>'} could not capture: {exc}",
                          hook_service_pb2.NOTICE_KIND_CAPTURE_FAILED, p)
            return
        if after is not None:
            self._send_ran(action, path, p, call_index, training, after, devices, fired)

    def _send_ran(self, action: Action, path: str, p: Pass, call_index: int, training: bool,
                  items: list[Captured], devices: list[str], fired: timestamp_pb2.Timestamp) -> None:
        if self.compiled.scope == SCOPE_REQUEST:
            p.count_event()  # past max_events_per_call the call fails here, as it always did
        self._send(action, path, p, call_index, training, {}, (items, list(devices), fired))

    def _disable(self, reason: str, kind: hook_service_pb2.NoticeKind, p: Pass | None = None) -> None:
        """Stops the hook for good (it stays listed) and tells its streams (a request-scoped
        hook of a streaming call, its call's stream). Worker thread."""
        batch = self.host.current_batch
        if batch is not None and batch.deferred and not batch.deferred.running:
            # Captures still in flight go out first: a notice never overtakes an event of the
            # hook (or of another) that fired before it. A request-scoped capture failing here
            # fails the call, as it would have when it fired.
            batch.deferred.finish()
        if batch is not None and batch.compact:
            batch.compact.send(record=self, raise_errors=False)  # its readouts so far, before the notice
        self.active = False
        self.disabled_reason = reason
        log.warning("hook %s disabled: %s", self.hook_id, reason)
        notice = _notice(kind, self.hook_id, f"hook disabled: {reason}")
        for stream in self.streams:
            stream.put_notice(notice)
        if p is not None and self.compiled.scope == SCOPE_REQUEST and p.notices is not None:
            p.notices(notice.notice)

    def _capture(
        self, action: Action, path: str, p: Pass, call_index: int, training: bool, parts: dict[str, Any]
    ) -> None:
        if self.compiled.scope == SCOPE_REQUEST and p.tap is not None:
            p.tap(self.hook_id, action, path, call_index, parts)  # a harvest batch: the tensors themselves, no event
            return
        batch = self.host.current_batch
        readout = action.options.readout
        if batch is not None and readout is not None and readout.compact:
            self._stack(batch, action, path, p, call_index, training, parts)
            return
        # Behind captures still in flight, a capture that needs no copy waits its turn too:
        # events leave in firing order.
        if batch is not None and self.host.defers and (
            batch.deferred or wants_deferral(self.host.async_captures, [v for _, _, _, v in _captured(action, parts)])
        ):
            self._capture_later(batch, action, path, p, call_index, training, parts)
            return
        self._send(action, path, p, call_index, training, parts, None)

    def _capture_later(
        self, batch: Any, action: Action, path: str, p: Pass, call_index: int, training: bool, parts: dict[str, Any]
    ) -> None:
        """An asynchronous capture (deferred.py): selection and cast now, on the device; the
        copies to the host started; numbering, encoding and delivery once they are done."""
        if self.compiled.scope == SCOPE_REQUEST:
            p.count_event()  # past max_events_per_call the pass stops here, as it always did
        copies = HostCopies()
        prepared = self._prepared(action, path, p, parts, copies.copy)
        if prepared is None:
            return
        items, devices = prepared
        self.host.deferred_captures += 1
        # Not ``parts``: the queue must not keep the pass's other tensors alive.
        batch.deferred.add(copies.events(), copies.keep, functools.partial(
            self._send, action, path, p, call_index, training, {}, (items, devices, _now())))

    def _prepared(
        self, action: Action, path: str, p: Pass, parts: dict[str, Any], then: Callable[[Any], Any] | None,
    ) -> tuple[list[Captured], list[str]] | None:
        """A capture's values prepared now (``_prepare``), for a capture finished later; None
        when they cannot be made and the hook is disabled for it (a request-scoped hook's
        failure is raised: its call fails, as a capture failure always did)."""
        try:
            return _prepare(self.hook_id, action, path, parts, then)
        except Exception as exc:
            if self.compiled.scope == SCOPE_REQUEST:
                raise
            self.errors += 1
            self._disable(f"hook {self.hook_id} on {self.host.name}:{path or '<root>'} could not capture: {exc}",
                          hook_service_pb2.NOTICE_KIND_CAPTURE_FAILED, p)
            return None

    def _stack(
        self, batch: Any, action: Action, path: str, p: Pass, call_index: int, training: bool, parts: dict[str, Any],
    ) -> None:
        """A compact readout (Readout.compact, hooks.compact): prepared now, on its device,
        and added to the pass's stack of this hook and call, sent when the pass ends. The
        stack counts as one event of the call when it starts."""
        prepared = self._prepared(action, path, p, parts, None)
        if prepared is None:
            return
        items, devices = prepared
        shape = compact.layout(items)
        stack = batch.compact.stack_for(self, action, p, call_index, shape)
        if stack is None:
            if self.compiled.scope == SCOPE_REQUEST:
                p.count_event()  # past max_events_per_call the pass stops here, as for any capture
            stack = batch.compact.start(compact.Stack(self, action, p, call_index, training, _now()), shape)
        stack.indices.append(self._module_indices[path])
        stack.items.append(items)
        for device in devices:
            if device not in stack.devices:
                stack.devices.append(device)

    def send_compact(self, stack: compact.Stack) -> None:
        """Sends a compact readout event (the pass ended, or the hook is being disabled:
        ``_disable`` sends its stacks before its notice). Worker thread."""
        prepared = (stack.stacked(), stack.devices, stack.fired)
        self._send(stack.action, "", stack.p, stack.call_index, stack.training, {}, prepared, indices=stack.indices)

    def _send(
        self, action: Action, path: str, p: Pass, call_index: int, training: bool, parts: dict[str, Any],
        prepared: Prepared | None, *, indices: list[int] | None = None,
    ) -> None:
        """Numbers, encodes and delivers one capture (``prepared``: its values already
        selected, cast and on the host, the devices and the firing time, from _capture_later)."""
        if self.compiled.scope == SCOPE_REQUEST:
            # The request's own hook: a capture failure fails the request (raised through forward),
            # and so does an event past max_events_per_call (Pass.request_event).
            event, chunker = p.request_event(counted=prepared is not None)
            self._fill_event(event, action, path, p, call_index, training, parts, chunker, prepared, indices)
            event.seq = p.next_seq(self.hook_id)
            p.deliver(event, chunker)
            return
        if prepared is not None and self.disabled_reason:
            # Queued before an earlier queued capture of this hook failed and disabled it: a
            # hook that captured in its hook would never have fired again.
            return
        streams = self.streams
        if streams and not p.holding and not p.backlog:
            # A full DROP_NEWEST stream drops the event whatever it holds: numbered and counted
            # now, never encoded. (Not in a shared pass, nor behind events the call keeps: their
            # events are numbered as they leave, in firing order.)
            open_streams = []
            for stream in streams:
                if stream.drop_if_full(self.hook_id, session_id=p.session_id, principal=p.principal, counters=self.counters):
                    p.offered(stream)  # its CallEnded marker still follows
                else:
                    open_streams.append(stream)
            streams = tuple(open_streams)
        if not streams:
            return  # nobody listens: no copies
        msg = hook_service_pb2.SessionMessage()
        # Large tensors are copied once, here, into their chunk messages (their snapshot):
        # the event loop that sends them then only hands the bytes to gRPC. The smallest
        # chunk size of the streams fits every one of them. (Host copies of an asynchronous
        # capture belong to the event already: no snapshot.)
        chunker = Chunker(snapshot=prepared is None, framing=Framing(
            SESSION_MESSAGE_CHUNK, min(stream.limits.chunk_bytes for stream in streams)))
        try:
            nbytes = self._fill_event(msg.event, action, path, p, call_index, training, parts, chunker, prepared, indices)
        except Exception as exc:  # never break a pass because a capture cannot be made
            self.errors += 1
            detail = f"hook {self.hook_id} on {self.host.name}:{path or '<root>'} could not capture: {exc}"
            self._disable(detail, hook_service_pb2.NOTICE_KIND_CAPTURE_FAILED, p)
            return
        wire = msg.ByteSize()
        copies = [msg] + [_copy(msg) for _ in streams[1:]]
        chunked = chunker if chunker.tensors else None
        for stream, m in zip(streams, copies):
            p.put_event(
                stream, m, self.hook_id, nbytes, counters=self.counters, chunker=chunked, wire=wire, cancelled=self._is_removed,
            )

    def _is_removed(self) -> bool:
        return self.removed

    def _fill_event(
        self, event: hook_pb2.InterceptEvent, action: Action, path: str, p: Pass,
        call_index: int, training: bool, parts: dict[str, Any], chunker: Chunker | Splicer | None,
        prepared: Prepared | None = None, indices: list[int] | None = None,
    ) -> int:
        """Fills ``event``; with ``indices``, a compact readout event of those modules,
        which for a request-scoped hook (its events go to the call's own stream only)
        leaves out what the call says (Readout.compact)."""
        lean = indices is not None and self.compiled.scope == SCOPE_REQUEST
        if not lean:
            event.hook_id = self.hook_id
            event.model = self.host.name
            event.request_id = p.request_id
        event.request_hook_index = self.request_index
        event.module = path
        event.phase = action.phase
        event.call_index = call_index
        event.step = p.step
        event.training = training
        if indices is not None:
            event.module_indices.extend(indices)
        if prepared is None:
            event.time.CopyFrom(_now())
            items, devices = _prepare(self.hook_id, action, path, parts, None)
        else:
            items, devices, fired = prepared
            event.time.CopyFrom(fired)  # when the hook fired, not when the copies completed
        encode = functools.partial(codec.encode_value_into, opaque_caches=True)  # a KV cache in kwargs: null, marked
        nbytes = 0
        for part, field, key, value in items:
            if field == "output":
                target = event.output
            elif field == "kwargs":
                target = event.kwargs[key]
            else:
                target = getattr(event, field).add()
            try:
                nbytes += encode(value, target, chunker=chunker)
            except Exception as exc:
                raise _capture_error(exc, self.hook_id, path, part) from None
        event.devices.extend(devices)
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
                action_msg = getattr(msg.spec, fields[action.phase])
                for position, path, tensor_msg in operand_tensors(action_msg.rules):
                    operand = rules[position].operands.get(path)
                    if operand is not None:
                        tensor_msg.Clear()  # dtype and shape are set again, with the data
                        codec.encode_tensor_into(operand, tensor_msg)
                readout = action.options.readout
                if readout is not None and action_msg.HasField("readout"):
                    for path, tensor_msg in tensor_fields(action_msg.readout, "readout."):
                        operand = readout.operands.get(path)
                        if operand is not None:
                            tensor_msg.Clear()
                            codec.encode_tensor_into(operand, tensor_msg)
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
            action_msg = getattr(spec, info.field)
            for _, _, tensor_msg in operand_tensors(action_msg.rules):
                tensor_msg.data = b""
            if action_msg.HasField("readout"):  # a readout's probe weights or SAE: kept once, decoded
                for _, tensor_msg in tensor_fields(action_msg.readout, "readout."):
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


#: An asynchronous capture's values on the host, their devices, and when its hook fired.
Prepared = tuple[list[Captured], list[str], timestamp_pb2.Timestamp]


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
