"""One admission step, shared by every kind of call (Infer, InferStream, Generate,
Tokenize, GetParameters, harvest jobs): who may make it, whether the server still takes
calls, which model it is for; and for calls with request-scoped hooks (Infer, Generate)
the hooks' count limit, the session the call is made in, the hooks compiled (off the
event loop) and whether the call must keep its own pass (slots). Each check answers in
the same words for every kind of call."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from hookwire.v1 import hook_pb2

from ..auth import MINIMUM_ROLE, Principal
from ..limits import exceeded
from ..memory_budget import Claim, Estimate
from ..models.memory_estimate import Estimator, Inputs
from ..hooks.hook_manager import HookManager, Session
from ..hooks.hook_record import HookRecord
from ..models.model_registry import ModelHost, ModelRegistry
from ..state import ServerState


def captured_modules(records: Sequence[HookRecord]) -> int:
    """How many module tensors a call's request-scoped hooks capture in a pass (each part
    captured at each resolved module: its copy is held until the response goes), for the
    call's memory estimate."""
    return sum(
        len(r.compiled.modules) * sum(len(a.capture) for a in r.compiled.actions if a.capture)
        for r in records
    )


class Admission:
    """The admission step (see the module docstring). Event loop."""

    def __init__(self, registry: ModelRegistry, hooks: HookManager, state: ServerState) -> None:
        self._registry = registry
        self._hooks = hooks
        self.state = state

    def enter(
        self, rpc: str, principal: Principal, model: str, *, action: str | None = None, hooks: int = 0,
        refuse: Sequence[tuple[str, str]] = (),
    ) -> ModelHost:
        """The model a call of ``rpc`` by ``principal`` is for: PermissionDenied unless the
        principal holds the RPC's role (``action`` names what it is doing), Unavailable
        while the server stops, NotFound/Unavailable for a model that is unknown or not
        ready, Unimplemented when its engine refuses a feature of ``refuse`` ((feature,
        what the caller asked for) pairs), ResourceExhausted for more than
        max_request_hooks request-scoped ``hooks``."""
        principal.require(MINIMUM_ROLE[rpc], action or rpc)
        self.state.refuse_when_draining()
        host = self._registry.get(model, refuse)
        limit = self.state.limits.max_request_hooks
        if hooks > limit:
            raise exceeded("hooks", f"{hooks} request-scoped hooks", limit, "max_request_hooks")
        return host

    def enter_call(
        self, rpc: str, principal: Principal, model: str, *, hooks: int, session_id: str,
        refuse: Sequence[tuple[str, str]] = (),
    ) -> tuple[ModelHost, Session | None]:
        """``enter`` for a call with request-scoped hooks (Infer, Generate), and the
        caller's own open session it is made in (None for none): NotFound for another's
        or an ended one (hooks and calls in a session are its owner's alone)."""
        host = self.enter(rpc, principal, model, hooks=hooks, refuse=refuse)
        session = self._hooks.require_session(session_id, principal, owner_only=True) if session_id else None
        return host, session

    async def request_hooks(
        self, host: ModelHost, specs: Sequence[hook_pb2.HookSpec], request_id: str, session: Session | None,
        principal: Principal,
    ) -> tuple[list[HookRecord], str | None]:
        """The call's request-scoped hooks, compiled off the event loop (each resolves its
        module glob against every module path; InvalidArgument/PermissionDenied naming the
        hook that is wrong), and the group its passes belong to: the session whose calls
        must never share a pass with each other (their hooks save and patch slots, whose
        saves must be seen in call order), or None."""
        records: list[HookRecord] = []
        if specs:
            records = await asyncio.to_thread(self._hooks.request_hooks, host, specs, request_id, session, principal)
        slots = any(r.compiled.uses_slots for r in records) or (
            session is not None and self._hooks.session_uses_slots(session)
        )
        return records, (session.session_id if session is not None else "") if slots else None

    async def claim_memory(
        self, host: ModelHost, engine: Any, what: str, estimate: Callable[[Estimator], Estimate],
        *, probe: Inputs | None = None,
    ) -> Claim | None:
        """Claims a call's estimated peak in the server's memory budget (memory_budget.py)
        for as long as it runs (release the returned Claim when it ends): ``estimate``
        computes it from the model's Estimator; ``probe``: the call's inputs, for a model
        without a config whose probe pass for their shapes has not run yet (on a thread of
        its own: it never waits for the model's running pass). None for an engine that sizes its own
        memory (no ``estimator``: vLLM, whose KV cache is sized when it loads).
        ResourceExhausted naming the estimate and memory_budget_bytes when it can never
        fit; waits while earlier calls hold what it needs. Event loop."""
        estimator = await self._estimator(host, engine)
        if estimator is None:
            return None
        budget = self.state.budget
        if probe is not None:
            known, key = estimator.cached(probe)
            if not known:
                await asyncio.to_thread(estimator.probe, key)
        return await budget.claim(estimate(estimator), what)

    async def check_memory(
        self, host: ModelHost, engine: Any, what: str, estimate: Callable[[Estimator], Estimate],
    ) -> None:
        """ResourceExhausted (as ``claim_memory``) when work of this estimate could never
        fit the memory budget: for a harvest job at its start, whose batches claim their
        memory one by one as they run. Event loop."""
        estimator = await self._estimator(host, engine)
        if estimator is not None:
            self.state.budget.check(estimate(estimator), what)

    async def _estimator(self, host: ModelHost, engine: Any) -> Estimator | None:
        """The engine's Estimator (None: it sizes its own memory), the model's weights
        recorded in the budget as what it keeps, once."""
        estimator: Estimator | None = getattr(engine, "estimator", None)
        if host.name not in self.state.budget.resident:
            await self.note_resident(host, engine)
        return estimator

    async def note_resident(self, host: ModelHost, engine: Any) -> None:
        """Records in the memory budget what ``host`` keeps for good: its weights in host
        memory (an Estimator's count), or what its engine says (``resident``: a vLLM
        engine's KV cache and weights). Event loop."""
        estimator: Estimator | None = getattr(engine, "estimator", None)
        if estimator is not None:
            self.state.budget.keep(host.name, await asyncio.to_thread(estimator.resident_bytes))
        else:
            self.state.budget.keep(host.name, int(getattr(engine, "resident", 0)))
