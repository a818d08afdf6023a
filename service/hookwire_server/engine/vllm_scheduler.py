"""hookwire's scheduler for vLLM (vLLM's ``scheduler_cls``): one engine, two kinds of
request.

vLLM's speed comes from its scheduler: chunked prefill (a prompt split across steps,
beside other requests' decoding), its admission (KV cache given to a sequence as it
grows, not reserved at full length) and preemption (a request put back and recomputed
when the cache runs out). Each would fire a hook out of step: a chunked prompt fires its
hooks once per chunk, a preempted request runs its prompt again, a call whose requests
start in different steps sees its step 0 twice. vLLM's settings for them are per engine;
this scheduler (a subclass of vLLM's own, run wherever vLLM runs its scheduler: the
server's process or vLLM's engine process) makes them per request. The front tells it,
in each request's ``SamplingParams.extra_args`` (set when the call enters vLLM), whether
a hook can fire on the request (``TOUCHED``) and which call it belongs to (``CALL``, the
call's request count ``SEQUENCES``):

- **a request no hook touches** is vLLM's like any other (priority 1): prefix caching,
  chunked prefill, admitted as vLLM admits, preempted when the cache runs out;
- **a touched request** (priority 0) starts with every other request of its call, in one
  step, each prompt whole. Its call waits in vLLM's queue until all its requests have
  arrived and fit the step beside what the running requests may take (seats, the step's
  tokens, free KV blocks). Running requests no hook touches are preempted to make room,
  newest first, if that makes it fit (they are recomputed later, their full blocks from
  the prefix cache); where the untouched prompts being chunked will give the step's
  tokens back within a few steps it waits for them instead, rather than throw their
  work away, and no untouched request starts meanwhile. Where only touched requests
  ending can make room, it waits for them and untouched requests go on. A
  touched request is never chunked (the last check before vLLM schedules a prompt's
  tokens), and vLLM's priority policy preempts untouched requests before it would a
  touched one. Touched calls whose requests have all arrived start in arrival order.

The front reserves every touched call's KV cache at full length among the touched calls
(``VllmEngine._admit_waiting``), so touched requests never need to preempt each other;
untouched ones use the rest, as vLLM would. Should vLLM still split or preempt a touched
call (a model whose KV cache has groups of other block sizes, say), the front sees it
when it lays the step out and fails that call as out of step.

Built on vLLM 0.32's ``Scheduler``: ``schedule``, ``add_request`` and two of its
per-request checks (``_handle_blocked_waiting_request``, ``_reserve_prefill_lookahead``)
are overridden; a vLLM upgrade must re-read them.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from . import vllm_threads
from .vllm_worker import CALL, SEQUENCES, TOUCHED


def _extra(request: Request) -> dict[str, Any]:
    return getattr(getattr(request, "sampling_params", None), "extra_args", None) or {}


def touched(request: Request) -> bool:
    """Whether the front said a hook may fire on ``request``; a request without the flag
    (not hookwire's call) counts as touched, as in the workers."""
    return bool(_extra(request).get(TOUCHED, True))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class HookwireScheduler(Scheduler):
    """vLLM's scheduler, with touched requests started whole and never chunked."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # In vLLM's engine-core process (worker processes): off the workers' cores, which it
        # would take from them while it polls for their results (vllm_threads.keep_to).
        vllm_threads.keep_engine_core()
        #: The touched requests that may start in the step being scheduled.
        self._released: set[str] = set()
        #: Whether a touched call waits for room in the step being scheduled.
        self._holding = False
        #: For tests and docs (in-process: VllmEngine.scheduler): steps in which vLLM ran
        #: part of an untouched request's prompt (a chunk that is not its last); the same
        #: for touched ones (never); untouched requests preempted to make room for a
        #: touched call; the most requests running at once.
        self.chunked_prefills = 0
        self.touched_chunked = 0
        self.preempted_for_touched = 0
        self.most_running = 0

    def add_request(self, request: Request) -> None:
        # The priority policy's queue order and its choice of whom to preempt.
        request.priority = 0 if touched(request) else 1
        super().add_request(request)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self._release_touched()
        try:
            out = super().schedule(*args, **kwargs)
        finally:
            self._released, self._holding = set(), False
        self._count(out)
        return out

    # ------------------------------------------------------------------ touched calls

    def _release_touched(self) -> None:
        """Decides which waiting touched calls start in this step: in arrival order, each
        whole (all its requests arrived) and only while it fits beside what the running
        requests may take, making room by preempting untouched running requests (only if
        that makes it fit)."""
        calls: dict[str, list[Request]] = {}
        for request in self.waiting:  # the priority queue iterates in its order
            if request.status == RequestStatus.WAITING and request.num_computed_tokens == 0 and touched(request):
                calls.setdefault(str(_extra(request).get(CALL, request.request_id)), []).append(request)
        if not calls:
            return
        pool = self.kv_cache_manager.block_pool
        budget = min(self.max_num_scheduled_tokens, self.scheduler_config.max_num_batched_tokens)
        seats = self.max_num_running_reqs - len(self.running)
        tokens = budget - sum(self._wants(r) for r in self.running)
        growth = sum(self._grows(r) for r in self.running)
        for requests in calls.values():
            if len(requests) < int(_extra(requests[0]).get(SEQUENCES, 1)):
                continue  # the rest of its call has not reached vLLM yet
            need_seats = len(requests)
            need_tokens = sum(r.num_tokens for r in requests)
            need_blocks = sum(_cdiv(r.num_tokens, self.block_size) for r in requests)
            if need_seats > self.max_num_running_reqs or need_tokens > budget or need_blocks >= pool.num_gpu_blocks:
                continue  # never fits (the front refuses such calls): it must not hold the others
            victims = sorted((r for r in self.running if not touched(r) and self._request_blocks_can_be_freed(r)),
                             key=lambda r: r.arrival_time)
            # Preempt only if taking every untouched request out would make room; else it
            # waits for touched requests to end, and so do the touched calls after it, but
            # untouched ones go on meanwhile (they are preempted once that makes room).
            if not (need_seats <= seats + len(victims)
                    and need_tokens <= tokens + sum(self._wants(r) for r in victims)
                    and need_blocks <= pool.get_num_free_blocks() - growth
                    + sum(self._grows(r) + self._freed_by(r) for r in victims)):
                return
            while not (need_seats <= seats and need_tokens <= tokens
                       and need_blocks <= pool.get_num_free_blocks() - growth):
                # The step's tokens come back within a few steps, once the untouched prompts
                # being chunked are done (none starts meanwhile): wait for them rather than
                # throw their work away. Seats and blocks come back only when requests end.
                soon = tokens + sum(self._wants(r) - 1 for r in victims if self._wants(r) > 1)
                if need_seats <= seats and need_tokens <= soon and need_blocks <= pool.get_num_free_blocks() - growth:
                    self._holding = True
                    return
                if not victims:
                    return  # the estimate above was off (shared blocks): it waits as above
                victim = victims.pop()  # the newest
                seats += 1
                tokens += self._wants(victim)
                growth -= self._grows(victim)
                self.running.remove(victim)
                self._preempt_request(victim, time.monotonic())
                # As vLLM's reset_prefix_cache does: the runner forgets it (it is not
                # resumed in this step: _handle_blocked_waiting_request).
                self.prev_step_scheduled_req_ids.discard(victim.request_id)
                self.preempted_for_touched += 1
            seats -= need_seats
            tokens -= need_tokens
            growth += need_blocks
            self._released.update(r.request_id for r in requests)

    @staticmethod
    def _wants(request: Request) -> int:
        """The most tokens a running request takes in the next step (vLLM's count)."""
        return max(0, request.num_tokens_with_spec + request.num_output_placeholders - request.num_computed_tokens)

    def _freed_by(self, request: Request) -> int:
        """The KV blocks preempting a running request gives back: those no other request
        shares (a shared prefix block stays held)."""
        blocks = self.kv_cache_manager.get_blocks(request.request_id).blocks
        return sum(1 for group in blocks for block in group if block.ref_cnt <= 1)

    def _grows(self, request: Request) -> int:
        """The most KV blocks a running request takes in the next step (it holds blocks
        for its computed tokens)."""
        done = request.num_computed_tokens
        return _cdiv(done + self._wants(request), self.block_size) - _cdiv(done, self.block_size)

    # ------------------------------------------------------------------ vLLM's checks

    def _handle_blocked_waiting_request(self, request: Request) -> bool:
        # Asked of each waiting request before vLLM schedules it: False skips it this step.
        if touched(request):
            if (request.status == RequestStatus.WAITING and request.num_computed_tokens == 0
                    and request.request_id not in self._released):
                return False
        elif self._holding or request.request_id in self.reset_preempted_req_ids:
            return False  # it would take a waiting touched call's room, or the room it just gave
        return bool(super()._handle_blocked_waiting_request(request))

    def _reserve_prefill_lookahead(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> int:
        # The last cut of a request's tokens before vLLM allocates them: a touched prompt
        # runs whole or not at all (0: vLLM leaves it, and the requests after it, waiting).
        # (A touched request vLLM preempted anyway runs out of step whatever happens: the
        # front fails its call; it may be chunked, so as not to stop the queue.)
        n = int(super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens))
        if n and touched(request) and not request.num_preemptions and num_computed_tokens + n < request.num_tokens:
            return 0
        return n

    def _count(self, out: Any) -> None:
        self.most_running = max(self.most_running, len(self.running))
        for rid in out.num_scheduled_tokens:
            request = self.requests.get(rid)
            # After schedule() a request's computed tokens include the step's.
            if request is not None and request.num_computed_tokens < request.num_tokens:
                if touched(request):
                    self.touched_chunked += 1
                else:
                    self.chunked_prefills += 1
