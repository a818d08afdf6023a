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
    assert sched._last_rows == 0 and sched._last_works == 0
    await sched.submit(Work("infer", "live", key="k", rows=1))
    assert [item for plan in engine.plans for item in plan.items] == ["bg", "live"] and sched._last_rows == 1


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
