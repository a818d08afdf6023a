"""Sessions, registered hooks and subscriptions: who owns which hook, which streams
its events go to, and their lifetimes (sessions ending, TTLs, revocation, demotion,
shutdown). Lives on the event loop; the torch side of a hook is hook_record, the
checking of its spec hook_specs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import functools
import logging
import threading
import time
from typing import Callable, Iterable

from hookwire.v1 import hook_pb2, hook_service_pb2
from hookwire.wire import ids
from hookwire.wire.ids import new_id

from .. import limits
from ..auth import ANONYMOUS, MINIMUM_ROLE, Principal, TokenStore
from ..errors import FailedPrecondition, HookwireServerError, InvalidArgument, NotFound, PermissionDenied, Unavailable
from .event_bus import DeliveryGate, DeliveryLimits, EventStream, HeldBytes
from .hook_record import HookRecord, Subscription, _notice
from .hook_specs import CompiledSpec, check_slot_stages, compile_spec, require_hook_roles
from .hook_store import HookStore, StoredHook
from ..state import SHUTDOWN_REASON, ServerState
from ..models.model_registry import ModelHost, ModelRegistry, ModelState
from .operands import OperandStore
from .rules import names_operands
from .slots import DEFAULT_MAX_SLOT_BYTES, SlotStore

log = logging.getLogger("hookwire.hooks")

#: Specs (and listings with operand data) up to this size are compiled (encoded) on the
#: event loop; larger ones, whose rule operands take long to decode or encode, on a thread.
OPERAND_BYTES_INLINE = 64 * 1024
#: Request-scoped specs kept compiled (see HookManager._compile_request_spec), and the
#: largest one kept (its operand tensors are decoded in it).
COMPILED_SPECS = 256
COMPILED_SPEC_MAX_BYTES = 64 * 1024


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


@dataclasses.dataclass(frozen=True)
class _Restored:
    """What a hook registered again from the state folder keeps of its first life."""

    #: Its absolute expiry (ns since the epoch).
    expires_ns: int
    #: The gap notice its first subscriber gets.
    notice: str


def _when(ns: int) -> str:
    """A wall-clock time for messages: ISO 8601, UTC, to the second."""
    return datetime.datetime.fromtimestamp(ns / 1e9, datetime.timezone.utc).isoformat(timespec="seconds")


def _lacks(principal: Principal, role: str, what: str) -> str:
    """Why ``principal`` may no longer hold ``what`` ("" when it may)."""
    try:
        principal.require(role, what)
    except PermissionDenied as exc:
        return f"your role changed: {exc}"
    return ""


class HookManager:
    """Sessions, registered hooks and subscriptions. Lives on the event loop."""

    def __init__(
        self, registry: ModelRegistry, *, allow_shared_rules: bool = False, state: ServerState | None = None,
        operands: OperandStore | None = None, store: HookStore | None = None,
    ) -> None:
        self._registry = registry
        #: Where hooks without a session are saved to outlive the server (state_dir); None: nowhere.
        self.store = store
        #: Saved hooks not restored yet: their models were still loading (see restore).
        self._unrestored: list[StoredHook] | None = None
        #: The server's limits, metrics and draining flag (shared with every call).
        self._state = state or ServerState()
        self.limits = self._state.limits
        self.metrics = self._state.metrics
        #: Named operands (OperandService): specs resolve names there; registered hooks hold them.
        self.operands = operands or OperandStore(self.limits)
        self._subscriptions: set[Subscription] = set()
        self.metrics.watch(
            sessions=lambda: len(self._sessions), hooks=lambda: len(self._hooks),
            streams=lambda: len(self._sessions) + len(self._subscriptions), buffered=self._buffered,
        )
        self.allow_shared_rules = allow_shared_rules
        self._hooks: dict[str, HookRecord] = {}
        #: Request-scoped specs already compiled, by model and serialized spec (most calls
        #: repeat the hooks of the calls before them); oldest forgotten first.
        self._compiled: dict[tuple[str, bytes], CompiledSpec] = {}
        self._compiled_lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._background: set[asyncio.Future[None]] = set()
        #: The open streams, which the models' schedulers ask which calls must wait.
        self.gate = DeliveryGate()
        #: Event bytes calls keep for their full streams, per principal (passes.Pass).
        self.held_bytes = HeldBytes(self.limits.max_buffered_bytes_per_principal, self._stream_budget)

    # ---------------------------------------------------------------- sessions

    def refuse_when_draining(self) -> None:
        """Unavailable once the server stops taking calls."""
        self._state.refuse_when_draining()

    def _admit_stream(self, principal: Principal, delivery: DeliveryLimits) -> None:
        """Limits on streams: per principal, and the server's total buffer budget."""
        streams = [s.stream for s in self._sessions.values()] + [s.stream for s in self._subscriptions]
        mine = sum(1 for s in self._sessions.values() if principal.owns(s.principal))
        mine += sum(1 for s in self._subscriptions if principal.owns(s.principal))
        limits.check(mine, self.limits.max_streams_per_principal, f"{principal.name!r} has {mine} open streams",
                     "max_streams_per_principal")
        own = self._stream_budget(principal.name) + self.held_bytes.held(principal.name)
        if own + delivery.max_bytes > self.limits.max_buffered_bytes_per_principal:
            raise limits.exceeded(
                f"stream buffers of {principal.name!r} (and the events its calls keep for full streams)",
                f"{own + delivery.max_bytes} bytes with this stream", self.limits.max_buffered_bytes_per_principal,
                "max_buffered_bytes_per_principal",
            )
        budget = sum(s.limits.max_bytes for s in streams) + delivery.max_bytes
        if budget > self.limits.max_buffered_bytes:
            raise limits.exceeded(
                "the server's stream buffers", f"{budget} bytes with this stream's {delivery.max_bytes}",
                self.limits.max_buffered_bytes, "max_buffered_bytes", "ask for a smaller delivery.max_bytes",
            )

    def _stream_budget(self, principal: str) -> int:
        """The byte budgets of the open streams of the principal named ``principal``. Any
        thread: it reads copies of the tables (taken without running Python code between)."""
        streams = [s for s in list(self._sessions.values()) if s.principal.name == principal]
        subs = [s for s in list(self._subscriptions) if s.principal.name == principal]
        return sum(s.stream.limits.max_bytes for s in streams) + sum(s.stream.limits.max_bytes for s in subs)

    def open_session(self, delivery: DeliveryLimits, principal: Principal = ANONYMOUS) -> Session:
        """A new session with its own event stream."""
        self.refuse_when_draining()
        principal.require(MINIMUM_ROLE["OpenSession"], "opening a session")
        sessions = sum(1 for s in self._sessions.values() if principal.owns(s.principal))
        limits.check(sessions, self.limits.max_sessions_per_principal,
                     f"{principal.name!r} has {sessions} open sessions", "max_sessions_per_principal")
        self._admit_stream(principal, delivery)
        session_id = new_id(ids.SESSION)
        stream = EventStream(asyncio.get_running_loop(), delivery, owner_session_id=session_id, owner=principal.name,
                             on_sent=self._count_sent, blocks_others=principal.is_operator)
        session = Session(session_id, stream, self.limits.max_slot_bytes, principal)
        self._sessions[session.session_id] = session
        self.gate.add(stream)
        log.info("session opened", extra={"session_id": session_id, "principal": principal.name})
        return session

    def require_session(self, session_id: str, principal: Principal = ANONYMOUS, *, owner_only: bool = False) -> Session:
        """The open session ``session_id`` of ``principal`` (any, for operators, unless
        ``owner_only``: hooks and calls in a session are its owner's alone); NotFound
        otherwise (Unavailable while the server stops)."""
        self.refuse_when_draining()
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
        self.gate.remove(session.stream)
        session.slots.clear()
        for hook_id in list(session.hook_ids):
            self._remove(hook_id, reason=f"session {session_id} ended")
        self.operands.session_ended(session_id)
        log.info("session %s closed", session_id)

    @property
    def session_count(self) -> int:
        """Open sessions."""
        return len(self._sessions)

    # ---------------------------------------------------------------- hooks

    async def register(self, session_id: str, spec: hook_pb2.HookSpec, principal: Principal = ANONYMOUS) -> HookRecord:
        """Registers and attaches a hook; returns once it fires for the next pass.

        Without a session, the hook must watch shared traffic (SCOPE_ALL/TAGGED),
        carries a TTL (capped at max_ttl_seconds) and delivers to subscribers only;
        with a state folder (``store``) it is saved there before this returns, and
        Unavailable when it cannot be (the hook is not registered then).
        """
        return await self._register(session_id, spec, principal, new_id(ids.HOOK))

    async def _register(
        self, session_id: str, spec: hook_pb2.HookSpec, principal: Principal, hook_id: str,
        restored: _Restored | None = None,
    ) -> HookRecord:
        self.refuse_when_draining()
        principal.require(MINIMUM_ROLE["RegisterHook"], "registering a hook")
        session = self.require_session(session_id, principal, owner_only=True) if session_id else None
        host = self._registry.get(spec.model)
        # The hook holds the named operands it uses from the moment they are resolved: one
        # deleted between the check and the attach would otherwise be used after its delete.
        compile_ = functools.partial(
            compile_spec, spec, host, request_scoped=False, allow_shared_rules=self.allow_shared_rules,
            max_rules=self.limits.max_rules_per_action,
            source=self.operands.source(principal, host.device, holder=(hook_id, f"hook {hook_id}")),
        )
        try:
            # Off the loop when large (decoding big rule operands takes a while: a 256 MiB one,
            # a second) or when it names operands (their checks cost what their size does).
            if spec.ByteSize() > OPERAND_BYTES_INLINE or names_operands(spec):
                compiling = asyncio.ensure_future(asyncio.to_thread(compile_))
                try:
                    compiled = await asyncio.shield(compiling)
                except asyncio.CancelledError:
                    # The thread goes on and may still resolve a name for this hook: its hold
                    # is let go once the thread is done, not before.
                    compiling.add_done_callback(lambda _: self.operands.release(hook_id))
                    raise
            else:
                compiled = compile_()
            return await self._register_compiled(hook_id, session_id, session, spec, host, compiled, principal,
                                                 restored)
        except BaseException:
            if hook_id not in self._hooks:  # once registered, its removal lets them go
                self.operands.release(hook_id)
            raise

    async def _register_compiled(
        self, hook_id: str, session_id: str, session: Session | None, spec: hook_pb2.HookSpec, host: ModelHost,
        compiled: CompiledSpec, principal: Principal, restored: _Restored | None = None,
    ) -> HookRecord:
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
        if session is not None and compiled.uses_slots:
            check_slot_stages(host, [*self._session_specs(session, host), compiled], session.slots.homes())
        if session is not None:
            limits.check(len(session.hook_ids), self.limits.max_hooks_per_session,
                         f"session {session_id} has {len(session.hook_ids)} hooks", "max_hooks_per_session")
        owned = sum(1 for r in self._hooks.values() if principal.owns(r.owner))
        limits.check(owned, self.limits.max_hooks_per_principal, f"{principal.name!r} has {owned} hooks",
                     "max_hooks_per_principal")
        record = HookRecord(
            hook_id, host, spec, compiled, session_id=session_id, slots=session.slots if session else None,
            metrics=self.metrics, owner=principal,
        )
        if session is not None:
            record.streams = (session.stream,)
            session.hook_ids[record.hook_id] = None
        else:
            ttl = min(spec.ttl_seconds, self.limits.max_ttl_seconds)
            now = time.time_ns()
            record.expires_ns = now + ttl * 1_000_000_000
            if restored is not None:  # its expiry is absolute: the time the server was down counts
                record.expires_ns = min(restored.expires_ns, record.expires_ns)
                record.restored_notice = restored.notice
            handle = asyncio.get_running_loop().call_later(
                (record.expires_ns - now) / 1e9,
                functools.partial(self._remove, record.hook_id, reason=f"its TTL of {ttl} s expired"),
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
            self.refuse_when_draining()
            raise NotFound(
                f"hook {record.hook_id} was removed while it was being registered "
                f"({'its session ended' if session is not None and session.closed else 'deregistered'})"
            )
        if session is None and self.store is not None and restored is None:
            await self._save(record, spec, principal)
        log.info("hook %s registered on %s:%s", record.hook_id, host.name, ",".join(compiled.modules) or "<root>")
        return record

    async def _save(self, record: HookRecord, spec: hook_pb2.HookSpec, principal: Principal) -> None:
        """Writes a registered hook without a session to the state folder (on a thread:
        fsync), so that a restarted server registers it again. Unavailable, with the hook
        removed, when that fails: a caller asking for a hook that outlives its client on a
        server with a state folder is promised one that outlives the server too."""
        store = self.store
        assert store is not None
        stored = functools.partial(
            StoredHook, hook_id=record.hook_id, owner=principal.name, role=principal.role,
            authenticated=principal is not ANONYMOUS, expires_ns=record.expires_ns, saved_ns=time.time_ns(),
        )
        if names_operands(spec):
            log.warning("hook %s names operands: a restarted server drops it unless they are uploaded or published "
                        "again first (named operands are not kept across restarts)", record.hook_id)
        saving = asyncio.ensure_future(asyncio.to_thread(
            lambda: store.save(stored(request=hook_service_pb2.RegisterHookRequest(spec=spec).SerializeToString()))
        ))
        try:
            await asyncio.shield(saving)
        except BaseException as exc:
            # A write still running is undone once done: the hook it describes is gone.
            saving.add_done_callback(lambda _: store.remove(record.hook_id))
            self._remove(record.hook_id, reason="registration failed")
            if isinstance(exc, OSError):
                raise Unavailable(f"the hook could not be saved in the server's state_dir: {exc}") from None
            raise
        if record.removed:  # removed while it was written: its _remove found no file yet
            store.remove(record.hook_id)

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

    def _remove(self, hook_id: str, *, reason: str, keep_saved: bool = False) -> HookRecord | None:
        """Stops a hook at once and schedules its detach; its streams are told after that.
        Its file in the state folder goes too, unless ``keep_saved`` (the server stops)."""
        record = self._hooks.pop(hook_id, None)
        if record is None:
            return None
        if self.store is not None and not record.session_id and not keep_saved:
            self.store.remove(hook_id)
        record.removed = True
        record.active = False
        for stream in record.streams:
            stream.wake_producers()  # a pass blocked delivering this hook's event gives up now
        if record.on_removed is not None:
            record.on_removed()
        session = self._sessions.get(record.session_id)
        if session is not None:
            session.hook_ids.pop(hook_id, None)
        # Its compiled rules keep the tensors they use until the detach; the names are free now.
        self.operands.release(hook_id)
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

    async def describe(self, records: list[HookRecord], *, include_operand_data: bool = False) -> list[hook_pb2.Hook]:
        """The wire descriptions of ``records`` (see HookRecord.to_proto); with operand
        data, encoded on a worker thread when the operands are large."""
        if include_operand_data and any(r.operand_bytes > OPERAND_BYTES_INLINE for r in records):
            return await asyncio.to_thread(lambda: [r.to_proto(include_operand_data=True) for r in records])
        return [r.to_proto(include_operand_data=include_operand_data) for r in records]

    @property
    def hook_count(self) -> int:
        """Registered hooks."""
        return len(self._hooks)

    def request_hooks(
        self, host: ModelHost, specs: Iterable[hook_pb2.HookSpec], request_id: str, session: Session | None,
        principal: Principal = ANONYMOUS, *, holder: tuple[str, str] | None = None,
    ) -> list[HookRecord]:
        """Compiles InferRequest.hooks; the pass attaches and detaches them on the worker.
        ``holder``: (id, description) that holds the named operands they use (a harvest job,
        which releases them when it ends); without one a call keeps only the tensors."""
        records: list[HookRecord] = []
        for i, spec in enumerate(specs):
            if spec.model and spec.model != host.name:
                raise InvalidArgument(f"hooks[{i}].model: {spec.model!r} is not the request's model {host.name!r}")
            try:
                compiled = self._compile_request_spec(spec, host, principal, holder)
            except (InvalidArgument, NotFound, FailedPrecondition) as exc:
                raise type(exc)(f"hooks[{i}]: {exc}") from None
            if compiled.uses_slots and session is None:
                raise InvalidArgument(f"hooks[{i}]: save and patch rules keep slots in a session: set session_id")
            if compiled.uses_slots and session is not None:
                try:
                    check_slot_stages(host, [*self._session_specs(session, host), *(r.compiled for r in records),
                                             compiled], session.slots.homes())
                except FailedPrecondition as exc:
                    raise FailedPrecondition(f"hooks[{i}]: {exc}") from None
            records.append(HookRecord(
                new_id(ids.HOOK), host, spec, compiled, request_id=request_id,
                slots=session.slots if session is not None else None, metrics=self.metrics, owner=principal,
                request_index=i + 1,
            ))
        return records

    def _session_specs(self, session: Session, host: ModelHost) -> list[CompiledSpec]:
        """The compiled specs of ``session``'s hooks on ``host``."""
        return [record.compiled for hook_id in session.hook_ids
                if (record := self._hooks.get(hook_id)) is not None and record.host is host]

    def session_uses_slots(self, session: Session) -> bool:
        """Whether a hook of ``session`` saves or patches slots (its calls then never share
        a pass with each other: their saves must be seen in call order)."""
        return any(
            (record := self._hooks.get(hook_id)) is not None and record.compiled.uses_slots
            for hook_id in session.hook_ids
        )

    def _compile_request_spec(
        self, spec: hook_pb2.HookSpec, host: ModelHost, principal: Principal, holder: tuple[str, str] | None,
    ) -> CompiledSpec:
        """compile_spec for a request-scoped hook, from the cache when the same spec (to
        the byte) was compiled for the model before. A compiled spec is immutable but for
        its rules' cast operands, which only the model's worker thread touches. Specs over
        COMPILED_SPEC_MAX_BYTES (large operands) are compiled each time, to bound the cache;
        so are specs naming operands (a name means another tensor once it is uploaded again,
        and another one per principal) and those compiled for a holder."""
        key = None
        if spec.ByteSize() <= COMPILED_SPEC_MAX_BYTES and holder is None:
            key = (host.name, spec.SerializeToString(deterministic=True))
            found = self._compiled.get(key)
            if found is not None:
                return found
        source = self.operands.source(principal, host.device, holder=holder)
        compiled = compile_spec(spec, host, request_scoped=True, max_rules=self.limits.max_rules_per_action,
                                source=source)
        if source.used:
            key = None
        if key is not None:
            with self._compiled_lock:  # compiled on threads (see Inference.infer)
                if len(self._compiled) >= COMPILED_SPECS:
                    self._compiled.pop(next(iter(self._compiled)))
                self._compiled[key] = compiled
        return compiled

    # ---------------------------------------------------------------- restarts

    async def restore(
        self, tokens: TokenStore, parse: Callable[[bytes], hook_service_pb2.RegisterHookRequest] | None = None,
    ) -> int:
        """Registers again the hooks saved in the state folder (``store``), with their ids
        and absolute expiries; returns how many were restored by this call. Called when
        the server starts, and again once its models have loaded: a hook on a model still
        loading waits for the next call. ``parse`` reads a saved RegisterHookRequest with
        the checks of a new one (the request bounds); it and the registration run as for
        a new RegisterHook, so a saved file is data checked like a request.

        A saved hook is dropped (its file removed, a log line saying why) when its TTL ran
        out while the server was down, its owner is no longer in the token file (or the
        hook was registered without authentication and this server requires it), its
        model is no longer configured, or registering it again fails as a new
        registration would: a module or named operand gone (named operands are not kept
        across restarts), its owner's role no longer allows it, a limit. One whose model
        failed to load keeps its file, for a later start. Never raises for a saved hook."""
        if self.store is None:
            return 0
        store = self.store
        if self._unrestored is None:
            self._unrestored = await asyncio.to_thread(store.load)
        parse = parse or hook_service_pb2.RegisterHookRequest.FromString
        now = time.time_ns()
        if store.stopped_ns is not None:
            gap = (f"events from {_when(store.stopped_ns)} to {_when(now)} "
                   f"({(now - store.stopped_ns) / 1e9:.0f} s, the server was stopped) were not captured")
        else:
            gap = (f"the server did not stop cleanly, so events were not captured from an unknown time "
                   f"to {_when(now)}")
        waiting: list[StoredHook] = []
        restored = 0
        for saved in self._unrestored:
            if self._state.draining:
                waiting.append(saved)  # stopping: files stay for the next start
                continue

            def drop(why: str, saved: StoredHook = saved) -> None:
                store.remove(saved.hook_id)
                log.warning("hook %s of %r not restored: %s", saved.hook_id, saved.owner, why)

            if saved.hook_id in self._hooks:
                continue
            if saved.expires_ns <= now:
                drop(f"its TTL ran out at {_when(saved.expires_ns)}, while the server was down")
                continue
            if not saved.authenticated:
                if tokens.enabled:
                    drop("it was registered without authentication, and this server requires tokens")
                    continue
                principal = ANONYMOUS
            else:
                found = tokens.principals.get(saved.owner) if tokens.enabled else None
                if found is None:
                    drop(f"its owner {saved.owner!r} is no longer in the token file")
                    continue
                principal = found
            try:
                request = await asyncio.to_thread(parse, saved.request)
                if request.session_id:
                    raise InvalidArgument("session_id: only hooks without a session are saved")
                entry = self._registry.entry(request.spec.model)
            except HookwireServerError as exc:
                drop(str(exc))
                continue
            if entry.state is ModelState.LOADING:
                waiting.append(saved)
                continue
            if entry.state is ModelState.FAILED:
                log.warning("hook %s of %r not restored: model %r failed (%s); its file is kept for a later start",
                            saved.hook_id, saved.owner, entry.name, entry.reason)
                continue
            try:
                await self._register("", request.spec, principal, saved.hook_id,
                                     _Restored(saved.expires_ns, f"hook {saved.hook_id} restored after a restart: {gap}"))
            except Unavailable:
                waiting.append(saved)  # the server began stopping: try at the next start
            except HookwireServerError as exc:
                drop(f"registering it again failed: {exc}")
            else:
                restored += 1
                log.info("hook %s of %r restored on %s (expires %s)", saved.hook_id, saved.owner,
                         request.spec.model, _when(saved.expires_ns))
        self._unrestored = waiting
        return restored

    # ---------------------------------------------------------------- slots

    def slots(self, session_id: str, principal: Principal = ANONYMOUS) -> SlotStore:
        """The slots of an open session of ``principal``; NotFound otherwise."""
        principal.require(MINIMUM_ROLE["GetSlot"], "reading slots")  # GetSlot and ListSlots
        return self.require_session(session_id, principal).slots

    # ---------------------------------------------------------------- subscriptions

    def subscribe(self, hook_ids: Iterable[str], delivery: DeliveryLimits, principal: Principal = ANONYMOUS) -> Subscription:
        """A stream for the events of existing hooks of ``principal`` (any, for operators);
        NotFound if any is unknown (or someone else's)."""
        self.refuse_when_draining()
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
        self.gate.add(sub.stream)
        for record in records:
            if record.restored_notice:  # before any event of its second life
                sub.stream.put_notice(_notice(
                    hook_service_pb2.NOTICE_KIND_HOOK_RESTORED, record.hook_id, record.restored_notice,
                ))
                record.restored_notice = ""
            record.streams = record.streams + (sub.stream,)
            record.subscriptions.append(sub)
            record.listeners_changed()
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        """Detaches a subscription from its hooks and frees its buffer."""
        self._subscriptions.discard(sub)
        sub.stream.close()
        self.gate.remove(sub.stream)
        for hook_id in list(sub.hook_ids):
            record = self._hooks.get(hook_id)
            if record is not None:
                record.streams = tuple(s for s in record.streams if s is not sub.stream)
                if sub in record.subscriptions:
                    record.subscriptions.remove(sub)
                record.listeners_changed()
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
                session.stream.wake_producers()  # a pass it held for another caller drops instead
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
                sub.stream.wake_producers()  # a pass it held for another caller drops instead
                ended += self._narrow(sub)
        principals = tokens.principals
        for record in list(self._hooks.values()):
            if record.owner is ANONYMOUS:  # identity: a configured principal may be called "anonymous" too
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
            record.listeners_changed()
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
        self._state.draining = True
        for session in list(self._sessions.values()):
            session.stream.close(SHUTDOWN_REASON)
            self.close_session(session.session_id)
        for sub in list(self._subscriptions):
            sub.stream.close(SHUTDOWN_REASON)

    async def close(self, timeout: float | None = None) -> None:
        """Ends every session and stream, then waits for the detaches, at most
        ``timeout`` seconds: a detach runs on the model's worker after the pass in
        flight, and a pass that outlives the grace period must not hold the exit
        (its thread is abandoned with the process, hooks and all)."""
        for session_id in list(self._sessions):
            self.close_session(session_id)
        for record in list(self._hooks.values()):
            self._remove(record.hook_id, reason="server stopping", keep_saved=True)
        if self._background:
            await asyncio.wait(list(self._background), timeout=timeout)
