"""The fleet client: one model served by many replicas, hooked and called as one."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import inspect
import logging
import socket
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence, Union

from ._client import CallRef, Client, ConnectOptions, HookHandle, _check_timeout, connect, request_id_of
from ._errors import AlreadyExistsError, HookwireError, NotFoundError, UnavailableError
from ._operands import OperandInfo, upload_messages
from ._specs import ActionLike, HookSpec, OnErrorName, Sampling, ScopeName
from ._types import InferResult, InterceptEvent

log = logging.getLogger("hookwire.fleet")

Resolver = Callable[[], Union[Sequence[str], Awaitable[Sequence[str]]]]
TargetsLike = Union[str, Sequence[str], Resolver]


@dataclasses.dataclass(frozen=True)
class FleetNotice:
    """A change in the fleet: ``kind`` is "replica_joined", "replica_lost" or "hook_failed"."""

    kind: str
    replica: str
    message: str
    time: float = dataclasses.field(default_factory=time.time)


def dns_resolver(name: str) -> Resolver:
    """Resolves "dns:///host:port" (or "host:port") to every address of host, e.g. a
    Kubernetes headless Service, at each call."""
    hostport = name.removeprefix("dns:///").removeprefix("dns:")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected dns:///host:port, got {name!r}")

    async def resolve() -> list[str]:
        infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        addresses = sorted({str(info[4][0]) for info in infos})
        return [f"[{a}]:{port}" if ":" in a else f"{a}:{port}" for a in addresses]

    return resolve


def _resolver(targets: TargetsLike) -> Resolver:
    if callable(targets):
        return targets
    if isinstance(targets, str):
        if targets.startswith("dns:"):
            return dns_resolver(targets)
        fixed = [targets]
    else:
        fixed = list(targets)
    return lambda: fixed


class _Replica:
    def __init__(self, target: str, options: ConnectOptions) -> None:
        self.target = target
        self.client: Client = connect(target, options=options)
        self.up = True


class FleetClient:
    """Several replicas of the same models, used as one.

    - Hooks are registered on every live replica, all or nothing: if one refuses,
      the others are rolled back and its error is raised.
    - A hook's ``events()`` merges the replicas' streams; each event's ``replica``
      says where it came from.
    - ``model(...)`` calls go round-robin over live replicas; a replica that is
      unreachable is marked lost and the call moves on to the next one.
    - Every ``refresh_seconds`` the targets are resolved again: a new replica gets
      the fleet's hooks, a lost one is retried. Changes are kept in ``notices``
      and logged.
    """

    def __init__(self, targets: TargetsLike, *, options: ConnectOptions | None = None, refresh_seconds: float = 5.0):
        self._resolve = _resolver(targets)
        self.options = options or ConnectOptions()
        self.refresh_seconds = refresh_seconds
        self._replicas: dict[str, _Replica] = {}
        self._hooks: list[FleetHookHandle] = []
        #: The fleet's named operands (name -> value, ttl): every replica gets them, a
        #: joining one before the fleet's hooks (which may name them).
        self._operands: dict[str, tuple[Any, float | None]] = {}
        self._rr = 0
        self._lock = asyncio.Lock()
        self._refresher: asyncio.Task[None] | None = None
        #: What happened to the fleet, oldest first.
        self.notices: list[FleetNotice] = []

    # ---------------------------------------------------------------- membership

    @property
    def replicas(self) -> dict[str, bool]:
        """Known replicas and whether each is live."""
        return {t: r.up for t, r in self._replicas.items()}

    def _notice(self, kind: str, replica: str, message: str) -> None:
        self.notices.append(FleetNotice(kind, replica, message))
        (log.warning if kind != "replica_joined" else log.info)("fleet: %s %s: %s", kind, replica, message)

    async def _targets(self) -> list[str]:
        result = self._resolve()
        if inspect.isawaitable(result):
            result = await result
        return list(dict.fromkeys(result))

    async def refresh(self) -> None:
        """Resolves the targets now: joins new replicas, retries lost ones."""
        async with self._lock:
            try:
                targets = await self._targets()
            except OSError as exc:
                self._notice("resolve_failed", "", str(exc))
                return
            for gone in [t for t in self._replicas if t not in targets]:
                vanished = self._replicas.pop(gone)
                self._lost(vanished, "no longer resolved")
                await vanished.client.close()
            for target in targets:
                known = self._replicas.get(target)
                if known is None:
                    fresh = self._replicas[target] = _Replica(target, self.options)
                    if await self._join(fresh):
                        self._notice("replica_joined", target, f"{len(self._hooks)} fleet hooks registered")
                elif not known.up and await self._join(known):
                    self._notice("replica_joined", target, "back; fleet hooks registered again")

    async def _join(self, replica: _Replica) -> bool:
        try:
            await replica.client.list_models()
            for name, (value, ttl) in list(self._operands.items()):
                await self._upload_to(replica, name, value, ttl)
            for hook in list(self._hooks):
                await hook._attach(replica)
        except HookwireError as exc:
            if replica.up:
                self._lost(replica, str(exc))
            return False
        replica.up = True
        return True

    def _lost(self, replica: _Replica, why: str) -> None:
        if replica.up:
            replica.up = False
            self._notice("replica_lost", replica.target, why)

    def _live(self) -> list[_Replica]:
        return [r for r in self._replicas.values() if r.up]

    async def __aenter__(self) -> FleetClient:
        await self.refresh()
        if not self._live():
            raise UnavailableError("no replica of the fleet answered")
        self._refresher = asyncio.ensure_future(self._refresh_forever())
        return self

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_seconds)
            await self.refresh()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stops refreshing, ends every replica's session (removing the fleet's hooks)."""
        if self._refresher is not None:
            self._refresher.cancel()
            await asyncio.gather(self._refresher, return_exceptions=True)
        for hook in self._hooks:
            hook._stop()
        await asyncio.gather(*(r.client.close() for r in self._replicas.values()), return_exceptions=True)

    async def wait_ready(self, models: Sequence[str] | None = None, *, timeout: float | None = None) -> None:
        """Waits until every live replica has the named models (all it configures, when
        None) ready: Client.wait_ready on each replica at once. Blocks; raises what the
        first failing replica's wait raises (FailedPreconditionError for a model that
        failed to load, NotFoundError, TimeoutError after ``timeout`` seconds)."""
        await asyncio.gather(*(r.client.wait_ready(models, timeout=timeout) for r in self._live()))

    # ---------------------------------------------------------------- named operands

    @staticmethod
    async def _upload_to(replica: _Replica, name: str, value: Any, ttl: float | None) -> OperandInfo:
        try:
            return await replica.client.upload_operand(name, value, ttl=ttl)
        except AlreadyExistsError:
            # A replica that was lost and came back may still hold the fleet's own copy (its
            # session outlived the link): that one, an upload of the same kind, dtype and
            # shape, counts as there. Anything else of that name (a published operand,
            # another upload) is never replaced: the error stands.
            sent = upload_messages(name, value)
            header = next(sent).operand  # type: ignore[union-attr]
            kind = "sae" if header.HasField("sae") else "tensor"
            tensor = header.sae.w_enc if kind == "sae" else header.tensor
            for op in await replica.client.list_operands():
                if op.name != name or op.published or op.ended or op.kind != kind:
                    continue
                have = op.raw.sae.w_enc if kind == "sae" else op.raw.tensor
                if have.dtype == tensor.dtype and tuple(have.shape) == tuple(tensor.shape):
                    return op
            raise

    async def upload_operand(self, name: str, value: Any, *, ttl: float | None = None) -> OperandInfo:
        """Client.upload_operand on every live replica, all or nothing: if one refuses,
        the operand is deleted from the others and its error raised. Replicas that join
        later get it too (the fleet keeps ``value`` for them: its memory stays with the
        fleet until ``delete_operand``). Returns the first replica's description."""
        async with self._lock:
            live = self._live()
            results = await asyncio.gather(*(self._upload_to(r, name, value, ttl) for r in live), return_exceptions=True)
            done = [r for r, result in zip(live, results) if not isinstance(result, BaseException)]
            failures = [(r, e) for r, e in zip(live, results) if isinstance(e, BaseException)
                        and not isinstance(e, UnavailableError)]
            for replica, result in zip(live, results):
                if isinstance(result, UnavailableError):
                    self._lost(replica, str(result))  # gone, not refusing: it gets the operand when back
            if not failures and not done:
                failures = [(r, UnavailableError("no live replica of the fleet answered")) for r in live[:1]]
            if failures:
                await asyncio.gather(*(r.client.delete_operand(name) for r in done), return_exceptions=True)
                replica, error = failures[0]
                if isinstance(error, HookwireError):
                    raise type(error)(f"replica {replica.target} refused the operand: {error.details}") from None
                raise error
            self._operands[name] = (value, ttl)
            first = next(result for result in results if not isinstance(result, BaseException))
            assert isinstance(first, OperandInfo)
            return first

    async def delete_operand(self, name: str) -> None:
        """Deletes a fleet operand from every live replica (FailedPreconditionError from
        the first that still uses it in a hook: it is then kept everywhere it is left)."""
        async with self._lock:
            live = self._live()
            results = await asyncio.gather(*(r.client.delete_operand(name) for r in live), return_exceptions=True)
            refused = [result for result in results if isinstance(result, BaseException)
                       and not isinstance(result, (UnavailableError, NotFoundError))]
            if refused:  # still on the replicas that refused, and the fleet's hooks may name it: kept for joiners
                raise refused[0]
            self._operands.pop(name, None)

    # ---------------------------------------------------------------- calls

    def model(self, name: str) -> FleetModel:
        """A model served by the fleet; nothing is sent until it is used."""
        return FleetModel(self, name)

    async def _call(self, fn: Callable[[Client], Awaitable[Any]]) -> Any:
        live = self._live()
        last: UnavailableError | None = None
        start = self._rr
        self._rr += 1
        for i in range(len(live)):  # each live replica once, starting at the round-robin position
            replica = live[(start + i) % len(live)]
            if not replica.up:
                continue
            try:
                return await fn(replica.client)
            except UnavailableError as exc:
                # UNAVAILABLE also answers a call to a model that is still loading: a
                # replica that answers ListModels is alive, and only this call moves on.
                try:
                    await replica.client.list_models()
                except HookwireError:
                    self._lost(replica, str(exc))
                last = exc
        raise UnavailableError(f"no live replica of the fleet answered the call (last: {last})" if live else
                               "no live replica of the fleet answered")


class FleetModel:
    """A model served by every replica: calls go round-robin, hooks go everywhere."""

    def __init__(self, fleet: FleetClient, name: str) -> None:
        self._fleet = fleet
        self.name = name

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs forward on the next live replica; see RemoteModel.__call__."""
        return (await self.infer(*args, kwargs=kwargs)).output

    async def infer(self, *args: Any, **kwargs: Any) -> InferResult:
        """RemoteModel.infer on the next live replica (moving on from unreachable ones)."""
        return await self._fleet._call(lambda client: client.model(self.name).infer(*args, **kwargs))

    def hook(
        self, module: str, *, prehook: ActionLike = None, posthook: ActionLike = None,
        backward_prehook: ActionLike = None, backward_hook: ActionLike = None,
        prehook_kwargs: dict[str, bool] | None = None, posthook_kwargs: dict[str, bool] | None = None,
        backward_prehook_kwargs: dict[str, bool] | None = None, backward_hook_kwargs: dict[str, bool] | None = None,
        train_update: bool = True, eval_update: bool = True, scope: ScopeName = "session",
        tags: Sequence[str] = (), on_error: OnErrorName = "default", sampling: Sampling | None = None,
    ) -> PendingFleetHook:
        """A hook on every replica (see RemoteModel.hook): await it, or ``async with`` it."""
        spec = HookSpec(
            module=module, prehook=prehook, posthook=posthook, backward_prehook=backward_prehook,
            backward_hook=backward_hook, prehook_kwargs=prehook_kwargs, posthook_kwargs=posthook_kwargs,
            backward_prehook_kwargs=backward_prehook_kwargs, backward_hook_kwargs=backward_hook_kwargs,
            train_update=train_update, eval_update=eval_update, scope=scope, model=self.name,
            tags=tuple(tags), on_error=on_error, sampling=sampling,
        )
        return PendingFleetHook(self._fleet, spec)


class PendingFleetHook:
    """``fleet_model.hook(...)``: awaitable and an async context manager."""

    def __init__(self, fleet: FleetClient, spec: HookSpec) -> None:
        self._fleet = fleet
        self._spec = spec
        self._handle: FleetHookHandle | None = None

    async def _register(self) -> FleetHookHandle:
        handle = FleetHookHandle(self._fleet, self._spec)
        async with self._fleet._lock:
            live = self._fleet._live()
            results = await asyncio.gather(*(handle._attach(r) for r in live), return_exceptions=True)
            failures = []
            for replica, result in zip(live, results):
                if isinstance(result, UnavailableError):
                    self._fleet._lost(replica, str(result))  # gone, not refusing: it gets the hook when back
                elif isinstance(result, BaseException):
                    failures.append((replica, result))
            if not failures and not handle.handles:
                failures = [(r, UnavailableError("no live replica of the fleet answered")) for r in live[:1]]
            if failures:
                await handle._remove_locked()
                replica, error = failures[0]
                if isinstance(error, HookwireError):
                    raise type(error)(f"replica {replica.target} refused the hook: {error.details}") from None
                raise error
            self._fleet._hooks.append(handle)
        return handle

    def __await__(self):  # type: ignore[no-untyped-def]
        return self._register().__await__()

    async def __aenter__(self) -> FleetHookHandle:
        self._handle = await self._register()
        return self._handle

    async def __aexit__(self, *exc: object) -> None:
        if self._handle is not None:
            await self._handle.remove()


class FleetHookHandle:
    """One hook on every replica. ``events()`` merges them; ``remove()`` is idempotent."""

    def __init__(self, fleet: FleetClient, spec: HookSpec) -> None:
        self._fleet = fleet
        self.spec = spec
        #: The hook on each replica, by target.
        self.handles: dict[str, HookHandle] = {}
        # Events of every replica, merged in arrival order: (replica, position in that
        # replica's session stream, event). The position lets events(until=call) stop
        # exactly at the call's end marker on the replica that ran it.
        self._merged: collections.deque[tuple[str, int, InterceptEvent]] = collections.deque()
        self._wake = asyncio.Event()
        self._pumps: dict[str, asyncio.Task[None]] = {}
        self._removed = False
        self._stopped = False

    async def _attach(self, replica: _Replica) -> None:
        if self._removed:
            return
        old = self.handles.pop(replica.target, None)
        if old is not None:
            self._pumps.pop(replica.target).cancel()
            try:  # it may still be there (a transient failure made the replica look lost)
                await old.remove()
            except HookwireError:
                pass
        handle = await replica.client.register_hook(self.spec)
        self.handles[replica.target] = handle
        if handle._router is not None:  # a call's end marker wakes events(until=...)
            handle._router.call_listeners.add(self._wake.set)
        self._pumps[replica.target] = asyncio.ensure_future(self._pump(replica, handle))

    async def _pump(self, replica: _Replica, handle: HookHandle) -> None:
        # An event leaves the replica's inbox and enters the merged queue in one step (no
        # await between): an event is always in exactly one of them, which events(until=)
        # relies on.
        try:
            if handle._router is None:  # no session (fleet hooks have one): no positions
                async for event in handle.events():
                    self._put(replica.target, 0, event)
            else:
                async for position, event in handle._router.positioned_events(handle.id):
                    self._put(replica.target, position, event)
        except HookwireError as exc:
            if not self._removed:
                self._fleet._lost(replica, f"event stream failed: {exc}")

    def _put(self, target: str, position: int, event: InterceptEvent) -> None:
        self._merged.append((target, position, dataclasses.replace(event, replica=target)))
        self._wake.set()

    def events(self, *, until: CallRef | None = None, timeout: float | None = None) -> AsyncIterator[InterceptEvent]:
        """Events of every replica, merged in arrival order (each event's ``replica``
        says where it came from), as HookHandle.events gives one replica's.

        Waits for each event; ends after remove() (or the fleet's close()). ``until``
        (a call: the InferResult of ``fleet_model.infer``, or its request id) also ends
        the iteration once that call is over, without a timeout: once its CallEnded
        marker has arrived on the session stream of the replica that ran it and every
        event of this hook from that replica that came before the marker has been
        yielded (with the other replicas' events that arrived before those, in merged
        order; later ones stay for the next iteration). It ends at once for a call whose
        marker an earlier iteration already passed. A call that failed over to another
        replica is marked on the replica that answered it.

        ``timeout`` (seconds) also ends the iteration, quietly, once no event has
        arrived for that long: an idle limit, not a limit on the whole iteration;
        events that come later stay queued for the next one.

        Raises ValueError for a ``timeout`` that is not > 0, TypeError / ValueError for
        an ``until`` that names no call. Raises nothing when a replica's stream fails:
        the replica is marked lost (``fleet.notices``) and the others go on.
        """
        request_id = None if until is None else request_id_of(until)
        _check_timeout(timeout)
        return self._merged_events(request_id, timeout)

    def _call_over(self, request_id: str) -> bool:
        """Whether ``request_id``'s marker has arrived on some replica's stream and every
        event of this hook from that replica before it has left the merged queue."""
        for target, handle in self.handles.items():
            router = handle._router
            end = None if router is None else router.calls.position(request_id)
            if router is None or end is None:
                continue
            if router.pending_before(handle.id, end):
                return False  # not pumped yet
            return not any(t == target and p < end for t, p, _ in self._merged)
        return False

    async def _merged_events(self, request_id: str | None, timeout: float | None) -> AsyncIterator[InterceptEvent]:
        while True:
            # Cleared before the checks: a put or a marker after them wakes the wait below.
            self._wake.clear()
            if request_id is not None and self._call_over(request_id):
                return
            if self._merged:
                yield self._merged.popleft()[2]
                continue
            if self._stopped:
                return
            if timeout is None:
                await self._wake.wait()
                continue
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:  # the wait holds nothing: cancelling it loses no event
                return

    async def remove(self) -> None:
        """Removes the hook from every replica that has it (unreachable ones lose it with their session)."""
        if self._removed:
            return
        async with self._fleet._lock:  # not while a refresh attaches it somewhere
            await self._remove_locked()

    async def _remove_locked(self) -> None:
        self._removed = True
        if self in self._fleet._hooks:
            self._fleet._hooks.remove(self)
        await asyncio.gather(*(h.remove() for h in self.handles.values()), return_exceptions=True)
        self._stop()

    def _stop(self) -> None:
        for pump in self._pumps.values():
            pump.cancel()
        for handle in self.handles.values():
            if handle._router is not None:
                handle._router.call_listeners.discard(self._wake.set)
        self._stopped = True
        self._wake.set()


def connect_fleet(
    targets: TargetsLike, *, options: ConnectOptions | None = None, refresh_seconds: float = 5.0
) -> FleetClient:
    """A client for many replicas: a list of "host:port", "dns:///name:port" (every
    address the name resolves to, e.g. a Kubernetes headless Service), or a function
    returning the current targets. Use ``async with`` (which connects and raises
    UnavailableError when no replica answers)."""
    return FleetClient(targets, options=options, refresh_seconds=refresh_seconds)
