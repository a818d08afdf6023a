"""The scheduler runs background work (harvest batches) only when no live work waits,
always alone, and without changing what live calls expect of their company."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from hookwire_server.models.model_registry import ModelHost
from hookwire_server.engine.scheduler import Scheduler, Work
from hookwire_server.engine.seam import Plan

pytestmark = pytest.mark.asyncio


class _Recording:
    """An engine behind the seam whose passes record their plans and return each item upper-cased."""

    name = "recording"
    refused: dict[str, str] = {}

    def __init__(self, host: ModelHost) -> None:
        self.host = host
        self.plans: list[Plan] = []

    def execute(self, plan: Plan) -> list[Any]:
        self.plans.append(plan)
        return [p.upper() for p in plan.items]


def _scheduler() -> tuple[Scheduler, _Recording]:
    engine = _Recording(ModelHost("lin", torch.nn.Linear(2, 2)))
    return Scheduler(engine.host, engine), engine


async def test_live_work_queued_after_background_work_runs_first_and_background_runs_alone() -> None:
    sched, engine = _scheduler()
    sched.hold()
    works = [
        Work("harvest", "bg1", key=None, rows=1, background=True),
        Work("harvest", "bg2", key=None, rows=1, background=True),
        Work("infer", "live1", key="k", rows=1),
        Work("infer", "live2", key="k", rows=1),
    ]
    tasks = [asyncio.ensure_future(sched.submit(w)) for w in works]
    while sched.queued < len(works):
        await asyncio.sleep(0)
    sched.release()
    results = await asyncio.gather(*tasks)
    assert results == ["BG1", "BG2", "LIVE1", "LIVE2"]
    # The live calls joined one pass ahead of both background works, which ran one at a time.
    assert engine.plans == [Plan("infer", ["live1", "live2"]), Plan("harvest", ["bg1"]), Plan("harvest", ["bg2"])]


async def test_a_background_pass_does_not_make_live_calls_wait_for_company() -> None:
    sched, engine = _scheduler()

    # A large background pass, then a lone live call: it must not wait for "expected" company
    # (there is none), so its pass runs as soon as it can; here we only check that the
    # scheduler's expectation did not change.
    await sched.submit(Work("harvest", "bg", key=None, rows=8, background=True))
    assert sched._company == 0 and sched._last_works == 0
    await sched.submit(Work("infer", "live", key="k", rows=1))
    assert [item for plan in engine.plans for item in plan.items] == ["bg", "live"] and sched._company == 1


async def test_schedule_returns_data_and_runs_nothing() -> None:
    """``schedule`` decides (which works share a pass, or how long to wait) and changes
    nothing: the queue is as it was, and no plan was executed."""
    sched, engine = _scheduler()
    sched.hold()
    works = [Work("infer", "a", key="k", rows=1), Work("infer", "b", key="k", rows=1),
             Work("infer", "c", key="other", rows=1), Work("generate", "d", key="k", rows=1)]
    tasks = [asyncio.ensure_future(sched.submit(w)) for w in works]
    while sched.queued < len(works):
        await asyncio.sleep(0)
    assert sched.schedule(0.0).works == []  # held: nothing runs
    sched._held = False  # look without letting the loop run
    decision = sched.schedule(0.0)
    assert decision.works == works[:2] and decision.plan == Plan("infer", ["a", "b"])
    assert sched.queued == len(works) and engine.plans == []
    sched.release()
    assert await asyncio.gather(*tasks) == ["A", "B", "C", "D"]


class _Gated(_Recording):
    """A recording engine whose first pass waits until the test opens the gate."""

    def __init__(self, host: ModelHost) -> None:
        super().__init__(host)
        import threading

        self.gate = threading.Event()

    def execute(self, plan: Plan) -> list[Any]:
        if not self.plans:
            self.gate.wait(60)
        return super().execute(plan)


async def test_company_is_every_caller_seen_lately_not_only_the_last_pass() -> None:
    """Closed-loop callers in two groups (one group's calls arrive while the other's pass
    runs) must not settle into alternating passes of 4: when a pass of 4 ends with 4 more
    waiting, 8 callers were seen, and the next pass waits (within max_batch_delay_ms,
    its longest here, so that nothing depends on timing) until the first group sent again."""
    import dataclasses

    from hookwire_server.models.batch_settings import LIMIT_MAX_BATCH_DELAY_MS

    engine = _Gated(ModelHost("lin", torch.nn.Linear(2, 2)))
    engine.host.batching = dataclasses.replace(engine.host.batching, max_batch_delay_ms=LIMIT_MAX_BATCH_DELAY_MS, max_batch_size=8)
    sched = Scheduler(engine.host, engine)
    sched.hold()
    first = [asyncio.ensure_future(sched.submit(Work("infer", f"a{i}", key="k", rows=1))) for i in range(4)]
    while sched.queued < 4:
        await asyncio.sleep(0)
    sched.release()  # the pass of a0..a3 starts and waits at the gate
    while sched.queued:
        await asyncio.sleep(0)
    second = [asyncio.ensure_future(sched.submit(Work("infer", f"b{i}", key="k", rows=1))) for i in range(4)]
    while sched.queued < 4:
        await asyncio.sleep(0)
    engine.gate.set()
    assert await asyncio.gather(*first) == ["A0", "A1", "A2", "A3"]
    for _ in range(50):  # the loop's turns: b0..b3 must wait for company, not run as a pass of 4
        await asyncio.sleep(0)
    assert sched.queued == 4 and len(engine.plans) == 1, engine.plans
    again = [asyncio.ensure_future(sched.submit(Work("infer", f"c{i}", key="k", rows=1))) for i in range(4)]
    assert await asyncio.gather(*second, *again) == ["B0", "B1", "B2", "B3", "C0", "C1", "C2", "C3"]
    assert [len(plan.items) for plan in engine.plans] == [4, 8], engine.plans


async def test_a_wait_for_company_that_runs_out_expects_fewer_for_a_while() -> None:
    """Company that does not come (an open-loop stream: callers that do not send again):
    the pass runs when the delay runs out, and for the next SHORT_PASSES passes the
    callers already waiting are not counted as company, so such a stream does not wait
    on every other pass."""
    from hookwire_server.engine.scheduler import SHORT_PASSES

    sched, engine = _scheduler()
    sched._company = 8
    work = Work("infer", "x", key="k", rows=1)
    sched._queue.append(work)
    deadline = sched.schedule(0.0).wait_until
    assert deadline is not None  # 1 row waits, 8 expected: wait for company
    decision = sched.schedule(deadline)  # the delay ran out
    assert decision.works == [work] and decision.short
    sched._queue.clear()
    # Through the loop: a pass that waited and ran short, with another call waiting when it ends.
    sched._company = 8
    gate = asyncio.Event()
    original = engine.execute

    def execute(plan: Plan) -> list[Any]:
        if plan.items == ["short"]:  # another call arrives while the short pass runs
            sched._loop_ref.call_soon_threadsafe(gate.set)
        return original(plan)

    engine.execute = execute  # type: ignore[method-assign]
    sched._loop_ref = asyncio.get_running_loop()  # type: ignore[attr-defined]
    short = asyncio.ensure_future(sched.submit(Work("infer", "short", key="k", rows=1)))
    await gate.wait()
    waiting = asyncio.ensure_future(sched.submit(Work("infer", "next", key="k", rows=1)))
    assert await short == "SHORT"
    assert sched._company == 1 and sched._short == SHORT_PASSES - 1  # the waiting call is not counted
    assert await waiting == "NEXT"
