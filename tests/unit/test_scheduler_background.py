"""The scheduler runs background work (harvest batches) only when no live work waits,
always alone, and without changing what live calls expect of their company."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from hookwire_server.models.model_registry import ModelHost
from hookwire_server.engine.scheduler import Work

pytestmark = pytest.mark.asyncio


def _host() -> ModelHost:
    return ModelHost("lin", torch.nn.Linear(2, 2))


async def test_live_work_queued_after_background_work_runs_first_and_background_runs_alone() -> None:
    host = _host()
    ran: list[list[str]] = []

    def run(h: Any, payloads: list[str]) -> list[Any]:
        ran.append(list(payloads))
        return [p.upper() for p in payloads]

    sched = host.scheduler
    sched.hold()
    works = [
        Work(run, "bg1", key=None, rows=1, kind="harvest", background=True),
        Work(run, "bg2", key=None, rows=1, kind="harvest", background=True),
        Work(run, "live1", key="k", rows=1, kind="infer"),
        Work(run, "live2", key="k", rows=1, kind="infer"),
    ]
    tasks = [asyncio.ensure_future(sched.submit(w)) for w in works]
    while sched.queued < len(works):
        await asyncio.sleep(0)
    sched.release()
    results = await asyncio.gather(*tasks)
    assert results == ["BG1", "BG2", "LIVE1", "LIVE2"]
    # The live calls joined one pass ahead of both background works, which ran one at a time.
    assert ran == [["live1", "live2"], ["bg1"], ["bg2"]]


async def test_a_background_pass_does_not_make_live_calls_wait_for_company() -> None:
    host = _host()
    sched = host.scheduler
    order: list[str] = []

    def run(h: Any, payloads: list[str]) -> list[Any]:
        order.extend(payloads)
        return payloads

    # A large background pass, then a lone live call: it must not wait for "expected" company
    # (there is none), so its pass runs as soon as it can; here we only check that the
    # scheduler's expectation did not change.
    await sched.submit(Work(run, "bg", key=None, rows=8, kind="harvest", background=True))
    assert sched._last_rows == 0 and sched._last_works == 0
    await sched.submit(Work(run, "live", key="k", rows=1, kind="infer"))
    assert order == ["bg", "live"] and sched._last_rows == 1
